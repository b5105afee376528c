"""--dump-node: a node file from the NVML backend, read back by the simulated backend."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import dump, nodefile
from agent.gpu.simulated import SimulatedBackend
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import LIBRARY_NOT_FOUND


def test_dump_round_trip(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200x2")
    backend = start_backend(fake)
    data = json.loads(json.dumps(dump.dump_node(backend)))
    parsed = nodefile.parse(data)
    assert parsed.info == backend.node_info()
    assert [d.status for d in parsed.devices] == [backend.device_status(i) for i in (0, 1)]
    assert data["timing"]["status_call_s"] >= 0
    assert data["timing"]["pcie_sample_s"] >= 0
    assert data["devices"][0]["topology"][0]["nvlinks"] == 18
    assert fake.calls.count("nvmlDeviceGetPcieThroughput") == 2 * (2 + dump.EXTRA_PCIE_SAMPLES)


def test_main_writes_a_file_the_simulator_serves(
    make_fake: MakeFake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake("h200")
    monkeypatch.setattr("agent.gpu.cuda_driver.LibCuda.open", staticmethod(lambda: None))
    target = tmp_path / "node.json"
    assert dump.main([str(target)]) == 0
    simulated = SimulatedBackend.from_file(str(target))
    (dev,) = simulated.node_info().devices
    assert dev.uuid == fake.devices[0]["uuid"]
    assert dev.memory.l2_cache_kib is None  # no CUDA here
    assert fake.shutdowns == 1
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]  # no temporary left


def test_main_without_driver_is_one_line(
    make_fake: MakeFake, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    make_fake("h200").init_error = LIBRARY_NOT_FOUND
    assert dump.main([str(tmp_path / "node.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--simulate" in err
    assert not (tmp_path / "node.json").exists()


def test_the_node_file_is_on_disk_before_it_is_renamed_into_place_and_its_name_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Durable as the agent's state files: a crash or a power loss right after the dump
    leaves the whole file at its name, not an empty or a half one."""
    events: list[tuple[str, ...]] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def recorded_fsync(fd: int) -> None:
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind))
        fsync(fd)

    def recorded(name: str, move: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            events.append((name,))
            move(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "rename", recorded("rename", rename))
    monkeypatch.setattr(os, "replace", recorded("replace", replace))
    target = tmp_path / "node.json"
    dump.write_node_file({"schema": 1, "devices": []}, str(target))
    assert events == [("fsync", "file"), ("rename",), ("fsync", "directory")]
    assert json.loads(target.read_text()) == {"schema": 1, "devices": []}
    assert stat.S_IMODE(target.stat().st_mode) == dump.NODE_FILE_MODE == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]
