"""Node files for tests: a built-in node with the GPU processes a test names (real PIDs)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.gpu import nodefile

GpuProcessSpec = tuple[int, str, int]  # pid, name, memory used MiB


def with_processes(
    base: str, processes: Mapping[int, Sequence[GpuProcessSpec]], path: Path
) -> Path:
    """Write ``base`` (a built-in node) to ``path`` with these processes on these GPUs
    (GPU index -> processes); the other GPUs keep theirs. Returns ``path``."""
    raw = json.loads(nodefile.resolve(base).read_text(encoding="utf-8"))
    for index, specs in processes.items():
        raw["devices"][index]["status"]["processes"] = [
            {"pid": pid, "name": name, "memory_used_mib": mib} for pid, name, mib in specs
        ]
    path.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    return path
