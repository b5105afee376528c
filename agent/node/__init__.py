"""The node: its facts and state, GPU and MIG selection, the driver's life, live status."""
