"""What the processes say: `metrics` (Prometheus), `logs` (structlog set-up),
`overflow_log` (index bounds that dropped input).
"""
