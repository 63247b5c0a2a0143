"""The fixed-answer cost curve (figure 6b): its filler reaches each size on
the base's own instances and never changes an answer. No timing asserted."""

from __future__ import annotations

from bench.fixed_answer import CHAIN, Filler, chains_for, fixed_answer_figure, instances_of
from bench.peers import dynamo_available
from bench.workload import Workload, WorkloadConfig, generate


def _tiny() -> Workload:
    return generate(
        WorkloadConfig.for_entries(
            12_000,
            queries=20,
            system_prompts=3,
            documents=8,
            document_tokens=(256, 1024),
            max_context_tokens=4096,
            query_tokens=1024,
        )
    )


def test_filler_continues_each_instances_sequence_on_its_tiers() -> None:
    w = _tiny()
    owners = {o.key: o for o in instances_of(w)}
    last = {k: o.seq for k, o in owners.items()}
    records = list(Filler(w).records(2 * len(owners)))
    assert {r.key for r in records} == set(owners)
    for r in records:
        fields = dict(r.headers)
        last[r.key] += 1
        assert int(fields["kv-seq"]) == last[r.key]
        # Write-through to the host tier on local-mode instances only.
        local = fields["kv-offload"] == b"local"
        assert r.blocks == (2 if local else 1) * CHAIN


def test_each_size_is_reached_and_every_answer_is_kept() -> None:
    w = _tiny()
    base = w.stats["entries"]
    sizes = (base, 2 * base, 5 * base)
    assert chains_for(w, sizes)[0] == 0
    peers = ("kvconductor", "dynamo") if dynamo_available() is None else ("kvconductor",)
    fig = fixed_answer_figure(w, peers, sizes, queries=20, rounds=1, log=lambda _: None)
    points = fig["peers"]["kvconductor"]
    assert [p["entries"] for p in points][:2] == [base, base]
    for size, p in zip(sizes, points[1:], strict=True):
        assert size <= p["entries"] < size + 2 * CHAIN
    for name in peers:
        assert all(p["identical"] for p in fig["peers"][name]), name
        assert [p["entries"] for p in fig["peers"][name]] == sorted(
            p["entries"] for p in fig["peers"][name]
        )
