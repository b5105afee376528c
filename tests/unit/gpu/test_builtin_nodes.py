"""The built-in simulated nodes against what --dump-node read off real H200 machines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agent.gpu import nodefile
from agent.gpu.model import PciLink

DUMPS = Path(__file__).resolve().parents[2] / "fixtures" / "dumps"


@pytest.mark.parametrize("name", nodefile.BUILTIN_NODES)
def test_every_builtin_node_loads(name: str) -> None:
    node = nodefile.load(name)
    assert node.info.devices
    assert all(dev.uuid and dev.uuid.startswith("GPU-") for dev in node.info.devices)


def test_h200_equals_a_real_dump_but_for_the_uuid() -> None:
    ours = nodefile.load("h200").info
    real = nodefile.parse(json.loads((DUMPS / "h200.json").read_text())).info
    assert (ours.driver_version, ours.cuda_version) == (real.driver_version, real.cuda_version)
    assert len(ours.devices) == len(real.devices) == 1
    # The real dump predates the MIG fields (its machine's nvidia-smi -q: MIG mode Disabled).
    assert ours.devices[0].mig_enabled is False
    assert real.devices[0].mig_enabled is None
    assert dataclasses.replace(ours.devices[0], uuid=None, mig_enabled=None) == (
        dataclasses.replace(real.devices[0], uuid=None)
    )


def test_h200x2_is_the_real_nvlink_pair() -> None:
    devices = nodefile.load("h200x2").info.devices
    assert [(p.link, p.nvlinks) for d in devices for p in d.topology] == [
        (PciLink.HOST_BRIDGE, 18),
        (PciLink.HOST_BRIDGE, 18),
    ]
    assert devices[0].topology[0].bus_id == devices[1].pci.bus_id
