"""The GPU-aware engine socket (docs/engine-socket.md): the Docker Engine API forwarded byte
for byte, except container creates that ask for GPUs, which get the node's leases."""
