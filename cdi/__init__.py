"""The Container Device Interface (CDI) for NVIDIA GPUs: the spec (``spec``), what containers
get from the host (``host_files``), other specs of the same kind (``others``), and the
createContainer hook that updates a container's linker cache (``hook``, with
``cuda_compat`` and ``rooted``).

A library that imports nothing of ours: plain values in, a JSON-ready document out (the
hook alone works on a container's files). The agent gives it the node's facts and writes
the file (docs/cdi.md).
"""
