"""`kvconductor dead-letters`: inspect and re-drive dead-lettered records (`tool`)."""
