"""kvconductor's benchmark: workload generator, peers, runners, report.

Run it with `kvconductor bench` (see `docs/benchmarks.md`). Everything here
measures; nothing here is imported by the daemon.
"""
