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
(the bridge and `run_bridge`). See docs/bridge.md.
"""

from kvconductor.bridge.app import Bridge, run_bridge
from kvconductor.bridge.config import BridgeConfig, PublisherConfig, load_bridge_config

__all__ = ["Bridge", "BridgeConfig", "PublisherConfig", "load_bridge_config", "run_bridge"]
