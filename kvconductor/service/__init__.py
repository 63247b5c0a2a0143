"""The long-running processes: `daemon` (Kafka in, index in memory, HTTP out,
snapshots) and `replica` (the daemon's index rebuilt and kept fresh in any process).
"""
