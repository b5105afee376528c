"""``nvidia-docker-plugin --dump-node FILE``: write this node's facts as a node file and exit."""

from __future__ import annotations

import logging

from agent.gpu.dump import dump_to

log = logging.getLogger("nvidia-docker-plugin")


def dump_node(simulate: str | None, target: str) -> int:
    """Read the node (NVML, or ``simulate``), write it to ``target`` (``-``: stdout); the
    exit code (docs/agent.md), with one log line for an error or for what was written."""

    def report(line: str) -> None:
        (log.error if line.startswith("Error") else log.info)("%s", line)

    return dump_to(simulate, target, report)
