"""Code that runs off the node: nvidia-docker wrapper, NV_HOST transports, fleet queries."""
