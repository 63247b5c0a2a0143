"""Kafka plumbing shared by the daemon, the replica, the bridge and the tools:
`clients` starts and retires aiokafka clients, `access` turns refusals into one line,
`topics` creates and checks the topics, `partitioner` is Kafka's default partitioner.
"""
