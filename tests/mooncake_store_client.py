"""Mooncake's own store client, driven line by line (run as a script).

`tests/test_mooncake_master.py` runs this in a subprocess with the client
wheel (`.ci/mooncake`) on PYTHONPATH: the wheel's native code stays out of
the test process, and its `mooncake` package out of the project's venv.

argv: master rpc address, metadata URL, segment bytes. stdin: one JSON
command a line, `{"op": "put", "key": k, "size": n}`, `{"op": "remove",
"key": k}`, `{"op": "remove_all"}`, `{"op": "close"}`; stdout: one JSON
result a line, `{"rc": <the client's return code>}`.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    master, metadata, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
    print(json.dumps({"rc": rc}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "put":
            rc = store.put(cmd["key"], b"k" * int(cmd["size"]))
        elif op == "remove":
            rc = store.remove(cmd["key"])
        elif op == "remove_all":
            rc = store.remove_all()
        elif op == "close":
            store.close()
            print(json.dumps({"rc": 0}), flush=True)
            return
        else:
            rc = -1
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    main()
