"""`kvconductor soak`: `run` drives the traffic of `traffic` against the processes of
`procs` under faults; `check` proves the end state.
"""
