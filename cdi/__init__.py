"""The Container Device Interface (CDI) for NVIDIA GPUs: the spec (``spec``) and the
createContainer hook that updates a container's linker cache (``hook``).

A pure library, as ``mesos``: plain values in, a JSON-ready document out; it imports
nothing of ours. The agent gives it the node's facts and writes the file (docs/cdi.md).
"""
