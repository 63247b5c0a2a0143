"""Operator and developer commands, behind `cli` (the `kvconductor` command): `demo`,
`soak`, `kafka_local` and `dead_letters` are packages of their own; `query_status`
is `kvconductor query` and `status`, `bench` the benchmark's command line,
`api_client` and `termui` what the commands share.
"""
