"""A simulated GPU's energy counter grows at its power draw, as a real GPU's does, read with
the slow sample as NVML's is, so the usage ledger and ``/metrics`` see energy on a simulated
node (docs/node-file.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agent.gpu import nodefile
from agent.gpu.simulated import SimulatedBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def _node(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(nodefile.resolve("hgx-h200-8").read_text())
    data.pop("timing", None)
    _write(path, data)
    return data


def _counter(backend: SimulatedBackend, index: int) -> int | None:
    """The counter after a slow sample, as status serves it."""
    backend.pcie_throughput(index)
    return backend.device_status(index).telemetry.total_energy_mj


def test_the_counter_starts_at_the_files_value_and_grows_at_the_draw(tmp_path: Path) -> None:
    data = _node(tmp_path / "node.json")
    telemetry = data["devices"][0]["status"]["telemetry"]
    start, draw_mw = telemetry["total_energy_mj"], telemetry["power_mw"]
    clock = Clock()
    backend = SimulatedBackend(nodefile.load(str(tmp_path / "node.json")), "t", clock=clock)
    assert _counter(backend, 0) == start
    clock.now += 2.5
    assert _counter(backend, 0) == start + int(draw_mw * 2.5)  # mW x s = mJ
    clock.now += 10.0
    # Status serves the last sample's reading, as with NVML: not grown until sampled again.
    assert backend.device_status(0).telemetry.total_energy_mj == start + int(draw_mw * 2.5)
    assert _counter(backend, 0) == start + int(draw_mw * 12.5)
    # Each GPU counts its own draw, from its first read.
    assert _counter(backend, 3) == data["devices"][3]["status"]["telemetry"]["total_energy_mj"]


def test_without_power_mw_the_watts_count_and_a_new_value_starts_it_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.json"
    data = _node(path)
    del data["devices"][1]["status"]["telemetry"]["power_mw"]
    data["devices"][1]["status"]["power_w"] = 300
    _write(path, data)
    clock = Clock()
    backend = SimulatedBackend.from_file(str(path), clock=clock)
    start = data["devices"][1]["status"]["telemetry"]["total_energy_mj"]
    assert _counter(backend, 1) == start
    clock.now += 2.0
    assert _counter(backend, 1) == start + 600_000  # 300 W for 2 s
    data["devices"][1]["status"]["telemetry"]["total_energy_mj"] = 5_000  # a driver reload
    _write(path, data)
    assert backend.follow_file() == []
    assert _counter(backend, 1) == 5_000
    clock.now += 1.0
    assert _counter(backend, 1) == 305_000


def test_a_device_without_a_counter_has_none(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    data = _node(path)
    data["devices"][2]["status"]["telemetry"]["total_energy_mj"] = None
    _write(path, data)
    clock = Clock()
    backend = SimulatedBackend(nodefile.load(str(path)), "t", clock=clock)
    clock.now += 5.0
    assert _counter(backend, 2) is None
