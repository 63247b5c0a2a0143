"""kvconductor: a KV-cache index of an LLM fleet, fed by Kafka, queried over HTTP.

Packages by layer; each imports only those after it (pyproject.toml's import-linter
contracts hold it): `tools` (the commands), then `service` and `bridge` (the processes),
then the adapters `http`, `snapshots`, `registry`, `kafka`, `obs` and
`consumers`, then `index` (the pure core), then `wire` (the contract's byte layouts),
then `kernel` (the compiled kernel's loader). `config`, `lifecycle` and
`records_first` are shared leaves.
"""
