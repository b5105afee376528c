"""nvidia-docker-plugin: the GPU node agent (discovery, REST API, lifecycle)."""

__version__ = "2.0.0"
