"""MIG and the CDI spec on a real NVIDIA GPU (the H200 machine: MIG is off there).

Only reads: nothing here changes a GPU's MIG mode or makes MIG instances. The spec is
written into a temporary directory, with the real driver's volume built into another one,
as the agent does at start; nothing goes to /var/run/cdi.

    pytest -m gpu -s tests/gpu/test_cdi_mig_real.py
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.api import render_json, render_text
from agent.api.docker_cli import control_devices
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter, find_linker_cache_hook, volume_builder
from agent.gpu.backend import GpuBackendError
from agent.gpu.model import NodeInfo
from agent.gpu.nvml_backend import NvmlBackend
from agent.node.facts import NodeFacts
from plugin.discovery import find_driver_files
from plugin.volumes import VolumeStore
from tests.support.cdi_schema import schema_errors

pytestmark = pytest.mark.gpu

LDCACHE = Path("/etc/ld.so.cache")


@pytest.fixture(scope="module")
def info() -> Iterator[NodeInfo]:
    with pytest.MonkeyPatch.context() as env:  # start() edits the environment: restore it
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_UNIFIED_MEMORY", "CUDA_CACHE_DISABLE"):
            env.setenv(name, os.environ.get(name, ""))
        try:
            backend = NvmlBackend.start(cuda=lambda _bus_ids: None)
        except GpuBackendError as err:
            pytest.skip(f"no usable NVIDIA driver here: {err}")
        try:
            yield backend.node_info()
        finally:
            backend.close()


def _smi_mig_modes() -> list[str] | None:
    """``nvidia-smi --query-gpu=mig.mode.current`` per GPU, or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return [line.strip() for line in done.stdout.splitlines()] if done.returncode == 0 else None


def test_mig_mode_is_read_and_reported_off(info: NodeInfo) -> None:
    modes = [dev.mig_enabled for dev in info.devices]
    print(f"\nMIG mode per GPU (NVML): {modes}; nvidia-smi: {_smi_mig_modes()}")
    print(f"the agent's log line: MIG mode: {render_text.mig_summary(info)}")
    assert modes == [False] * len(info.devices)  # H200s can do MIG, and it is off here
    assert all(dev.mig_devices == () for dev in info.devices)
    smi = _smi_mig_modes()
    if smi is not None:
        assert smi == ["Disabled"] * len(info.devices)
    assert render_text.mig_summary(info) == "off for every GPU"
    body = json.loads(render_json.info(info))
    assert all("MIG" not in device for device in body["Devices"])  # the old body, unchanged


def test_the_real_drivers_spec_validates_and_names_what_exists(
    info: NodeInfo, tmp_path: Path
) -> None:
    files = find_driver_files(info.driver_version, ldcache=LDCACHE)
    if not any(f.component == "libcuda" for f in files.libraries_64):
        pytest.skip(f"no libcuda.so.{info.driver_version} in {LDCACHE}")
    store = VolumeStore(tmp_path / "volumes", files)
    hook = find_linker_cache_hook()
    writer = CdiSpecWriter(CdiSettings(tmp_path / "cdi", hook=hook), volume_builder(store))
    assert asyncio.run(writer.write(NodeFacts(info, control_devices())))
    document = json.loads(writer.path.read_text())
    print(
        f"\n{writer.path}: CDI {document['cdiVersion']}, devices "
        f"{[d['name'] for d in document['devices']]}"
    )

    assert schema_errors(document) == []
    assert document["cdiVersion"] == "0.5.0"
    uuids = [dev.uuid for dev in info.devices]
    names = [device["name"] for device in document["devices"]]
    assert names == [n for i, uuid in enumerate(uuids) for n in (str(i), uuid)] + ["all"]

    nodes = {
        node["path"]
        for edits in [
            document["containerEdits"],
            *(d["containerEdits"] for d in document["devices"]),
        ]
        for node in edits.get("deviceNodes", [])
    }
    missing = sorted(path for path in nodes if not Path(path).exists())
    print(f"device nodes: {sorted(nodes)}; missing: {missing}")
    # /dev/nvidia-uvm appears when nvidia-uvm is loaded (the agent runs nvidia-modprobe -u
    # at start; this test does not): every other node the spec names must exist.
    assert [path for path in missing if path != "/dev/nvidia-uvm"] == []

    mounts = document["containerEdits"]["mounts"]
    (mount,) = [m for m in mounts if m["containerPath"] == "/usr/local/nvidia"]  # and host files
    volume = Path(mount["hostPath"])
    assert mount["containerPath"] == "/usr/local/nvidia"
    libcuda = volume / "lib64" / "libcuda.so.1"
    assert libcuda.resolve().name == f"libcuda.so.{info.driver_version}"
    in_volume = [*(volume / "lib64").iterdir(), *(volume / "bin").iterdir()]
    assert in_volume
    assert all(p.exists() for p in in_volume)  # no dangling link
    print(f"driver volume {volume}: {len(in_volume)} entries in lib64/ and bin/")

    if hook is not None:
        (entry,) = document["containerEdits"]["hooks"]
        assert entry["hookName"] == "createContainer"
        assert os.access(entry["path"], os.X_OK)
        ldconfig = entry["args"][entry["args"].index("--ldconfig") + 1]
        assert os.access(ldconfig, os.X_OK)
