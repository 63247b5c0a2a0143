"""Snapshots (contract section 5): `units` maps the index to compactable units and
back (pure); `store` publishes generations to the snapshot topic and reads them back.
"""
