"""`kvconductor demo`: `run` drives a local broker, the daemon and the simulated
engines of `engines` live.
"""
