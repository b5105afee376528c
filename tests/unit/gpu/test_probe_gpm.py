"""The GPM probe runs through on the fake pynvml: every GPU, every metric id, MIG included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.benchmarks import probe_gpm
from tests.unit.gpu.conftest import MakeFake
from tests.unit.gpu.fake_nvml import FakeMig


def test_the_probe_reports_every_metric_of_every_gpu(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    fake.capture["devices"][1]["mig_mode"] = [1, 1]
    fake.enable_mig(1, [FakeMig(0, "MIG-aaaa", "7g.141gb", 143360, 0, 0)])
    fake.gpm_values[0] = {1: 97.5}
    fake.gpm_values[1, 0] = {1: 12.0}
    fake.gpm_supported[1] = True
    monkeypatch.setattr(probe_gpm, "pynvml", fake.module)
    out = tmp_path / "gpm.json"
    monkeypatch.setattr(sys, "argv", ["probe_gpm", "--interval", "0.01", "--out", str(out)])
    assert probe_gpm.main() == 0
    doc = json.loads(out.read_text())
    gpu0, gpu1 = doc["gpus"]
    assert gpu0["support"]["isSupportedDevice"] == 1
    assert gpu0["streaming_enabled"] == 0
    graphics = gpu0["gpu"]["metrics"]["1"]
    assert (graphics["name"], graphics["nvmlReturn"], graphics["value"]) == (
        "GRAPHICS_UTIL", 0, 97.5,
    )  # fmt: skip
    assert gpu0["gpu"]["metrics"]["2"]["nvmlReturn"] == 3  # not supported, said so
    assert len(gpu0["gpu"]["metrics"]) == len(probe_gpm.metric_ids())
    assert gpu0["gpu"]["interval_s"] >= 0.01
    assert gpu1["gpu_instances"]["0"]["metrics"]["1"]["value"] == 12.0
    assert fake.shutdowns == 1
    assert all(sample.freed for sample in fake.gpm_samples)
