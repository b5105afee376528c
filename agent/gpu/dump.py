"""``--dump-node``: a node's GPU facts as a node file, for ``--simulate`` on another machine.

``dump_node(backend)`` reads the static facts, one status and one PCIe sample per device,
and measures what the calls cost so that a simulated node answers as slowly as the real
one (``timing``). ``python -m agent.gpu.dump [FILE|-]`` does the same with the NVML
backend; the schema is in ``docs/node-file.md``.
"""

from __future__ import annotations

import functools
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from agent.files import write_atomically
from agent.gpu import nodefile
from agent.gpu.backend import GpuBackend, GpuBackendError
from agent.gpu.model import DeviceStatus, PcieThroughput

# How often each call is timed. Status calls are fast (well under 1 ms); a PCIe sample
# takes about 42 ms on NVML, so it is timed once per device plus a few extra on GPU 0.
STATUS_REPEATS = 15
EXTRA_PCIE_SAMPLES = 2
NODE_FILE_MODE = 0o600  # its owner only, as the agent's lease state; copy it to share it

T = TypeVar("T")


def _timed(call: Callable[[], T], durations: list[float]) -> T:
    start = time.perf_counter()
    result = call()
    durations.append(time.perf_counter() - start)
    return result


def dump_node(backend: GpuBackend) -> dict[str, Any]:
    """The node file (as a JSON-ready dict) of the node ``backend`` describes."""
    info = backend.node_info()
    status_s: list[float] = []
    pcie_s: list[float] = []
    statuses: list[DeviceStatus] = []
    throughputs: list[PcieThroughput] = []
    for dev in info.devices:
        read_status = functools.partial(backend.device_status, dev.index)
        statuses.append(_timed(read_status, status_s))
        for _ in range(STATUS_REPEATS - 1):
            _timed(read_status, status_s)
        throughputs.append(_timed(functools.partial(backend.pcie_throughput, dev.index), pcie_s))
    if info.devices:
        for _ in range(EXTRA_PCIE_SAMPLES):
            _timed(functools.partial(backend.pcie_throughput, 0), pcie_s)
    out = nodefile.dump(
        info,
        statuses,
        throughputs,
        status_call_s=round(statistics.median(status_s), 6) if status_s else None,
        pcie_sample_s=round(statistics.median(pcie_s), 6) if pcie_s else None,
    )
    comment = (
        f"Dumped from {socket.gethostname()} ({backend.name}) on "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; timing is the median measured call time."
    )
    return {"schema": out.pop("schema"), "comment": comment, **out}


def write_node_file(data: dict[str, Any], target: str) -> None:
    """Write a node file to ``target`` (``-``: stdout) as the agent writes its state files,
    through ``agent.files.write_atomically``: mode 0600, synced to disk before it is renamed
    into place (its directory made if missing, and synced after), so that readers, and the
    disk after a crash, hold the old file or the whole new one; ``OSError``."""
    text = json.dumps(data, indent=1) + "\n"
    if target == "-":
        sys.stdout.write(text)
        return
    path = Path(target)
    write_atomically(path.parent, path.name, text.encode(), mode=NODE_FILE_MODE)


def dump_to(simulate: str | None, target: str, report: Callable[[str], None]) -> int:
    """Read the node (NVML, or ``simulate``) and write it to ``target`` (``-``: stdout);
    ``report`` gets one line for an error or for what was written. Returns an exit code."""
    from agent.gpu.backends import open_backend  # noqa: PLC0415 - pynvml only here

    try:
        backend = open_backend(simulate)
    except GpuBackendError as err:
        report(f"Error: {err}")
        return 1
    try:
        data = dump_node(backend)
    finally:
        backend.close()
    try:
        write_node_file(data, target)
    except OSError as err:
        report(f"Error: cannot write the node file {target}: {err}")
        return 1
    if target != "-":
        report(f"Wrote the node file {target} ({len(data['devices'])} GPUs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m agent.gpu.dump [FILE|-]``: dump this machine's GPUs (NVML)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print("usage: python -m agent.gpu.dump [FILE|-]  (default: - for stdout)")
        return 0 if args and args[0] in ("-h", "--help") else 2
    return dump_to(
        None, args[0] if args else "-", lambda line: print(f"dump-node | {line}", file=sys.stderr)
    )


if __name__ == "__main__":
    sys.exit(main())
