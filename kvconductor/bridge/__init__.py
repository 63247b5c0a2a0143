"""The engine bridge: KV-event publishers' ZMQ streams to Kafka records.

    cfg = load_bridge_config(Path("config/bridge.toml"))
    exit_code = await run_bridge(cfg)

Modules, one job each: `config` (the TOML/env configuration), `frames`
(ZMQ frame layouts), `subscription` (a SUB socket per publisher rank),
`replay` (the DEALER replay client), `relay` (sequence order, gaps, replay,
resync), `records` (keys and headers of the contract), `buffer` (ordered
bounded buffers, backpressure), `sink` (the idempotent producer and its
recovery), `registry` (run-time registrations on a compacted topic), `http`
(the API), `metrics`, `stream` (one publisher socket end to end) and `app`
(the bridge and `run_bridge`), each imported from its module: the daemon
imports the pure ones (`config`, `records`) through
`kvconductor.registry.bodies` without the rest. See docs/bridge.md.
"""
