"""Contract v2 section 1: wherever a namespace field arrives, null and "" mean
the default (`tenant_id` "default", `lora_name` the base model, `cache_salt`
no salt): in engine and pool events here, in HTTP bodies in test_http_api.py,
in registrations in test_registrations.py."""

from __future__ import annotations

from msgspec import structs

from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index
from kvconductor.index.namespace import NamespaceKey, namespace_key
from kvconductor.wire.events import PoolEvent
from kvconductor.wire.query import TokenQuery
from tests.harness import engine_headers, vllm_payload
from tests.harness import stored as harness_stored
from tests.test_index_rules import PROMPT, ask, engine, hits, pool, seq, stored


def test_namespace_key_takes_empty_as_default() -> None:
    base = NamespaceKey("default", "m", 4, None, "")
    assert namespace_key("", "m", 4, "", "") == base
    assert namespace_key(None, "m", 4, None, None) == base
    assert namespace_key("t", "m", 4, "ad", "s") == NamespaceKey("t", "m", 4, "ad", "s")


def test_engine_event_with_empty_lora_name_is_the_base_model() -> None:
    ix = Index()
    engine(ix, "a", structs.replace(stored(0, 2), lora_name=""))
    assert hits(ix) == (8, 8, 8)
    assert hits(ix, lora_name="") == (8, 8, 8)
    assert hits(ix, tenant_id="", cache_salt="") == (8, 8, 8)


def test_pool_event_empty_fields_fall_back_like_missing_ones() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 1))
    pool(
        ix,
        PoolEvent(
            "stored",
            [seq(1)],
            parent_hash=seq(0),
            token_ids=PROMPT[4:8],
            medium="cpu",
            tenant_id="",
            lora_name="",
            additional_salt="",
        ),
    )
    assert hits(ix) == (4, 8, 8)
    assert list(ask(ix)) == ["default"]


def test_empty_tenant_and_salt_headers_are_the_defaults() -> None:
    conductor = Conductor()
    event = harness_stored([seq(0)], PROMPT[:4], block_size=4)
    headers = engine_headers(**{"kv-tenant": "", "kv-salt": ""})
    conductor.ingest_engine_record(b"a", headers, vllm_payload([event]), 1.0)
    query = TokenQuery(model="m", block_size=4, token_ids=PROMPT, tenant_id="", cache_salt="")
    assert list(conductor.query(query)) == ["default"]
    assert conductor.query(query)["default"]["a"]["GPU"] == 4
