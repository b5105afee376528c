"""Docker volume plugin: the socket protocol and the driver volume on disk."""
