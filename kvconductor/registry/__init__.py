"""Registrations of engines and pool backends (Mooncake Conductor's `/register`):
`bodies` holds the request bodies and their rules (pure), `publishers` what a bridge
relays, `log` the compacted registrations topic, `routes` the HTTP routes.
"""
