"""``nvidia-docker-plugin --dump-node FILE``: write this node's facts as a node file and exit."""

from __future__ import annotations

import logging

from agent.backends import open_backend
from agent.exit_codes import EXIT_OK, EXIT_STARTUP_FAILED
from agent.gpu.backend import GpuBackendError
from agent.gpu.dump import dump_node as dump
from agent.gpu.dump import write_node_file

log = logging.getLogger("nvidia-docker-plugin")


def dump_node(simulate: str | None, target: str) -> int:
    """Read the node (NVML, or ``simulate``), write it to ``target`` (``-``: stdout)."""
    try:
        backend = open_backend(simulate)
    except GpuBackendError as err:
        log.error("Error: %s", err)
        return EXIT_STARTUP_FAILED
    try:
        data = dump(backend)
    finally:
        backend.close()
    try:
        write_node_file(data, target)
    except OSError as err:
        log.error("Error: cannot write the node file %s: %s", target, err)
        return EXIT_STARTUP_FAILED
    if target != "-":
        log.info("Wrote the node file %s", target)
    return EXIT_OK
