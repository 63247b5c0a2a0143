"""A small client of the daemon's HTTP API for the operator commands.

Synchronous (urllib, no event loop): `kvconductor query` and `kvconductor
status` make a handful of requests and exit. Every failure becomes a
`ToolError` with one line that says what to check.

The bearer token (`[http] auth_token`) goes only to the URL asked for:
redirects are not followed, since urllib would replay the Authorization
header to wherever they point, and the daemon never redirects.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvconductor.config import Config, reveal
from kvconductor.tools.termui import ToolError

DEFAULT_TIMEOUT_S = 10.0


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urlopen then raises HTTPError with the 3xx status


_opener = urllib.request.build_opener(_NoRedirects)


def daemon_url(cfg: Config, url: str | None) -> str:
    """`url` if given, else the daemon's address from the `[http]` config
    (a wildcard listen address is reached through the loopback)."""
    if url:
        return url.rstrip("/")
    host = cfg.http.host
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{cfg.http.port}"


class Api:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, cfg: Config, url: str | None, timeout_s: float) -> Api:
        return cls(daemon_url(cfg, url), reveal(cfg.http.auth_token), timeout_s)

    def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with _opener.open(req, timeout=self.timeout_s) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            if exc.code == 401:
                raise ToolError(self._unauthorized()) from None
            if 300 <= exc.code < 400:
                raise ToolError(
                    f"{self.url}{path} redirects ({exc.code}) to "
                    f"{exc.headers.get('Location', '?')}: not following (kvconductor never "
                    "redirects; is --url right?)"
                ) from None
            return int(exc.code), bytes(payload)
        except urllib.error.URLError as exc:
            reason = exc.reason
            text = getattr(reason, "strerror", None) or str(reason)
            raise ToolError(
                f"cannot reach kvconductor at {self.url}: {text} (is `kvconductor run` up? "
                "set --url or [http] host/port)"
            ) from None
        except (TimeoutError, OSError) as exc:
            raise ToolError(
                f"cannot reach kvconductor at {self.url}: {exc.strerror or exc}"
            ) from None

    def _unauthorized(self) -> str:
        where = "[http] auth_token, auth_token_file or KVCONDUCTOR_HTTP_AUTH_TOKEN(_FILE)"
        if self.token:
            return f"{self.url} rejected the bearer token (401): check {where} against the daemon's"
        return f"{self.url} needs a bearer token (401): set {where}"

    def json(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        status, raw = self.request(method, path, body)
        try:
            return status, json.loads(raw)
        except ValueError:
            raise ToolError(
                f"{self.url}{path} answered {status} with something that is not JSON "
                "(is this a kvconductor daemon?)"
            ) from None

    def metrics(self) -> Metrics:
        status, raw = self.request("GET", "/metrics")
        if status != 200:
            raise ToolError(f"{self.url}/metrics answered {status}")
        return parse_metrics(raw.decode("utf-8", "replace"))


# sample name -> [(labels, value)]
Metrics = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition -> samples by name (counters keep `_total`)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), float(sample.value)))
    return dict(out)


def metric_sum(metrics: Metrics, name: str, **match: str) -> float:
    return sum(
        value
        for labels, value in metrics.get(name, [])
        if all(labels.get(k) == v for k, v in match.items())
    )


def metric_by(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in metrics.get(name, []):
        out[labels.get(label, "")] += value
    return dict(out)
