"""The CUDA driver facts, read in a short-lived child process.

Loading ``libcuda`` and running ``cuInit`` maps tens of megabytes into a process and keeps
them there; the agent needs the answers only once, at start. So a child process
(``python -m agent.gpu.cuda_probe BUS_ID...``) opens libcuda, reads the facts of the given
GPUs and their peer access, prints them as JSON and exits; the process that asked (the GPU
worker, or ``--dump-node``) keeps the answers (``ProbedCuda``) and never maps libcuda
itself. A crash or hang in the CUDA driver cannot take that process with it either: the
child has a timeout, and any failure means the CUDA facts are null, with one log line.

The child also says the CUDA version (``cuDriverGetVersion``), which the GPU worker's NVML
cannot (``agent.gpu.hidden_libcuda``). It prints two lines: first
``{"driver_version": 13000}`` (``null``: unknown), written before ``cuInit`` runs, so that a
``cuInit`` that hangs or crashes still leaves the version; then the facts (``null`` when
libcuda could not be opened or initialised).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from agent.gpu import codec
from agent.gpu.cuda_driver import UNKNOWN_FACTS, CudaDeviceFacts, LibCuda, cuda_bus_id
from agent.gpu.hidden_libcuda import without_empty_libcuda

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0

# The environment CUDA discovery runs in, as nvidia-docker 1.0 set it before it started:
# every GPU visible whatever the caller's CUDA_VISIBLE_DEVICES, no JIT cache on disk, no
# unified memory (docs/gpu-backends.md). Only the child process gets it: nothing of ours
# changes the environment of the process that reads the facts (the nvidia-docker wrapper
# execs docker with the user's environment unchanged).
DISCOVERY_ENV_SET = {"CUDA_DISABLE_UNIFIED_MEMORY": "1", "CUDA_CACHE_DISABLE": "1"}
DISCOVERY_ENV_REMOVED = ("CUDA_VISIBLE_DEVICES",)


def discovery_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with every GPU visible and CUDA's cache and unified memory off, and the
    GPU worker's empty ``libcuda.so.1`` off ``LD_LIBRARY_PATH``."""
    env = without_empty_libcuda(environ)
    for name in DISCOVERY_ENV_REMOVED:
        env.pop(name, None)
    env.update(DISCOVERY_ENV_SET)
    return env


class ProbedCuda:
    """``CudaFacts`` answered from what the child process read."""

    def __init__(
        self,
        facts: dict[str, CudaDeviceFacts],
        peers: dict[tuple[str, str], bool | None],
        driver_version: int | None = None,
    ) -> None:
        self._facts = facts
        self._peers = peers
        self._driver_version = driver_version

    @property
    def driver_version(self) -> int | None:
        return self._driver_version

    def device_facts(self, bus_id: str) -> CudaDeviceFacts:
        return self._facts.get(cuda_bus_id(bus_id), UNKNOWN_FACTS)

    def can_access_peer(self, bus_id: str, peer_bus_id: str) -> bool | None:
        return self._peers.get((cuda_bus_id(bus_id), cuda_bus_id(peer_bus_id)))


def read_facts(cuda: LibCuda, bus_ids: Sequence[str]) -> dict[str, Any]:
    """In the child: the facts of ``bus_ids`` and every ordered pair's peer access."""
    devices = {cuda_bus_id(bus): codec.to_json(cuda.device_facts(bus)) for bus in bus_ids}
    peers = [
        [cuda_bus_id(a), cuda_bus_id(b), cuda.can_access_peer(a, b)]
        for a in bus_ids
        for b in bus_ids
        if a != b
    ]
    return {"devices": devices, "peers": peers}


def _version(data: Any) -> int | None:
    version = data.get("driver_version") if isinstance(data, dict) else None
    return version if type(version) is int and version > 0 else None


def _no_facts(version: int | None) -> ProbedCuda | None:
    return ProbedCuda({}, {}, version) if version is not None else None


def parse_answer(text: str) -> ProbedCuda | None:
    """The child's two JSON lines as ``ProbedCuda``; ``None`` when it said nothing usable.
    Facts missing or ``null`` (libcuda not initialised, the child cut off after the first
    line) with a known version: ``ProbedCuda`` with that version and no facts."""
    lines = text.splitlines()
    version = _version(json.loads(lines[0])) if lines else None
    data = json.loads(lines[1]) if len(lines) > 1 else None
    if data is None:
        return _no_facts(version)
    facts = {
        bus: codec.from_json(CudaDeviceFacts, entry, f"devices[{bus}]", lenient=True)
        for bus, entry in data["devices"].items()
    }
    peers = {
        (str(a), str(b)): (can if isinstance(can, bool) else None) for a, b, can in data["peers"]
    }
    return ProbedCuda(facts, peers, version)


def version_only(said: str) -> ProbedCuda | None:
    """The version of the child's first line alone, when it wrote a whole one (a child cut
    off, failed or answering badly afterwards); ``None`` otherwise."""
    first, newline, _ = said.partition("\n")
    try:
        version = _version(json.loads(first)) if newline else None
    except ValueError:
        return None
    return _no_facts(version)


def probe(bus_ids: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> ProbedCuda | None:
    """Run the child for ``bus_ids``; ``None`` (and one log line) on any failure, or only the
    CUDA version when the child said that much before it failed."""
    known = [bus for bus in bus_ids if bus]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agent.gpu.cuda_probe", *known],
            env=discovery_environment(os.environ),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        log.warning("Reading the CUDA facts failed (%s): they are reported as null", err)
        said = err.stdout  # what it wrote before it was killed: bytes, whatever ``text``
        return version_only(said.decode(errors="replace") if isinstance(said, bytes) else "")
    except OSError as err:
        log.warning("Reading the CUDA facts failed (%s): they are reported as null", err)
        return None
    for line in done.stderr.splitlines():  # the child's own warnings, passed on
        log.warning("CUDA: %s", line)
    if done.returncode != 0:
        log.warning(
            "Reading the CUDA facts failed (exit code %d): they are reported as null",
            done.returncode,
        )
        return version_only(done.stdout)
    try:
        return parse_answer(done.stdout)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("The CUDA facts could not be read (%s): they are reported as null", err)
        return version_only(done.stdout)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    cuda = LibCuda.load()
    version = cuda.read_driver_version() if cuda is not None else None
    print(json.dumps({"driver_version": version}), flush=True)  # before cuInit: see above
    print(json.dumps(read_facts(cuda, argv) if cuda is not None and cuda.init() else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
