"""What the profiling (GPM) values cost a sweep and a scrape, on the simulated 8-GPU node.

In one run, interleaved so that both sides see the same machine:

- in process: one sweep's trip across the worker pipe (encode, JSON both ways, decode the
  eight ``DeviceStatus``) and the rendering of the GPU families, for the node as it is
  (``hgx-h200-8``: profiling values on every GPU) and for the same node without them;
- end to end: two real agents, one on each of those nodes, asked in turn by one keep-alive
  client for ``/gpu/status/json`` and ``/metrics`` (median latency, body size).

    python -m tests.benchmarks.bench_gpm [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.gpu import nodefile
from agent.gpu import worker_protocol as wp
from agent.gpu.model import UNKNOWN_PROFILING, DeviceStatus
from agent.metrics.exposition import render_families
from agent.metrics.gpu_families import gpu_families
from tests.support.services import free_port, port_open, stop_process, wait_until

NODE = "hgx-h200-8"


def _without_profiling(status: DeviceStatus) -> DeviceStatus:
    telemetry = dataclasses.replace(status.telemetry, profiling=UNKNOWN_PROFILING)
    return dataclasses.replace(status, telemetry=telemetry)


def _median_us(work: Callable[[], object], rounds: int) -> float:
    spent = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1e6


def in_process(rounds: int) -> dict[str, Any]:
    node = nodefile.load(NODE)
    sides = {
        "on": [d.status for d in node.devices],
        "off": [_without_profiling(d.status) for d in node.devices],
    }
    throughputs = [d.throughput for d in node.devices]

    def pipe(statuses: list[DeviceStatus]) -> object:
        frame = wp.frame({"id": 1, "ok": [wp.encode_status(s) for s in statuses]})
        answer = json.loads(frame[wp.HEADER.size :])
        return [wp.decode_status(s) for s in answer["ok"]]

    def render(statuses: list[DeviceStatus]) -> bytes:
        families = gpu_families(node.info.devices, statuses, throughputs, {},
                                driver_version="580.159.04", hostname="gpu-node-7")  # fmt: skip
        return render_families(families)

    found: dict[str, Any] = {}
    for name, work in (("pipe_us", pipe), ("render_us", render)):
        medians: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(5):  # interleaved batches
            for side, statuses in sides.items():
                medians[side].append(_median_us(lambda w=work, s=statuses: w(s), rounds))  # type: ignore[misc]
        on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
        found[name] = {
            "gpm_on": round(on, 1),
            "gpm_off": round(off, 1),
            "ratio": round(on / off, 3),
        }
    found["frame_bytes"] = {side: len(wp.frame({"ok": [wp.encode_status(s) for s in st]}))
                            for side, st in sides.items()}  # fmt: skip
    found["render_bytes"] = {side: len(render(st)) for side, st in sides.items()}
    return found


def _start(base: Path, node_file: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    log = (base / "agent.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
         "-s", str(base / "plugins"), "-d", str(base / "volumes"), "--state-dir",
         str(base / "state"), "--cdi-spec-dir", "", "--simulate", node_file],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_until(lambda: port_open(port), what=f"agent ({base / 'agent.log'})", proc=proc)
    return proc, port


def end_to_end(rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nvd-bench-gpm-") as tmp:
        root = Path(tmp)
        data = json.loads(nodefile.resolve(NODE).read_text())
        for device in data["devices"]:
            device["status"]["telemetry"].pop("profiling", None)
        plain = root / "no-profiling.json"
        plain.write_text(json.dumps(data))
        agents = {}
        for side, node_file in (("on", NODE), ("off", str(plain))):
            (root / side).mkdir()
            agents[side] = _start(root / side, node_file)
        try:
            conns = {s: http.client.HTTPConnection("127.0.0.1", p, timeout=10)
                     for s, (_, p) in agents.items()}  # fmt: skip
            found: dict[str, Any] = {}
            for path in ("/gpu/status/json", "/metrics"):
                spent: dict[str, list[float]] = {"on": [], "off": []}
                size = {}
                for _ in range(rounds):
                    for side, conn in conns.items():
                        started = time.perf_counter()
                        conn.request("GET", path)
                        body = conn.getresponse().read()
                        spent[side].append(time.perf_counter() - started)
                        size[side] = len(body)
                on = statistics.median(spent["on"]) * 1e3
                off = statistics.median(spent["off"]) * 1e3
                found[path] = {"p50_ms": {"gpm_on": round(on, 3), "gpm_off": round(off, 3)},
                               "ratio": round(on / off, 3), "bytes": size}  # fmt: skip
            return found
        finally:
            for proc, _ in agents.values():
                stop_process(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    doc = {"node": NODE, "in_process": in_process(args.rounds), "agents": end_to_end(args.rounds)}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
