"""Every host path of the CDI spec built from the real driver exists and is the driver's.

On a machine with an NVIDIA GPU (the H200 machine: driver 580 under /usr/local/nvidia, a
read-only file system, no Docker): the spec is built as the agent builds it at start, the
driver volume into a temporary directory and the spec into another (nothing goes to
/var/run/cdi), and each path it names is checked against the host:

- device nodes (control, GPU, DRM) are character devices there; a DRM node is one of a GPU
  of this node (named under ``/sys/bus/pci/devices/<its bus id>/drm``);
- the driver volume holds the driver's files; each program mounted at ``/usr/bin`` is the
  volume's copy of the program the driver installed (the same bytes as the one on PATH);
- vendor files are regular files that name NVIDIA's libraries; GSP firmware is the running
  driver version's; IPC sockets are sockets, the MPS pipe directory a directory;
- the environment says ``NVIDIA_VISIBLE_DEVICES=void``, the hook is told this driver's
  version, and the spec is still CDI 0.5.0 and valid.

What the machine has besides the GPU (vendor files, firmware, sockets, DRM nodes) depends on
how the driver was installed: what is absent is printed, not failed.

    pytest -m gpu -s tests/gpu/test_cdi_paths_real.py
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.api.docker_cli import control_devices
from agent.cdi_spec.host_files import sysfs_address
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter, find_linker_cache_hook, volume_builder
from agent.gpu.backend import GpuBackendError
from agent.gpu.model import NodeInfo
from agent.gpu.nvml_backend import NvmlBackend
from agent.node.facts import NodeFacts
from cdi import host_files
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


@pytest.fixture(scope="module")
def document(info: NodeInfo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    files = find_driver_files(info.driver_version, ldcache=LDCACHE)
    if not any(f.component == "libcuda" for f in files.libraries_64):
        pytest.skip(f"no libcuda.so.{info.driver_version} in {LDCACHE}")
    tmp = tmp_path_factory.mktemp("cdi-paths")
    store = VolumeStore(tmp / "volumes", files)
    writer = CdiSpecWriter(
        CdiSettings(tmp / "cdi", hook=find_linker_cache_hook()), volume_builder(store)
    )
    assert asyncio.run(writer.write(NodeFacts(info, control_devices())))
    loaded: dict[str, Any] = json.loads(writer.path.read_text())
    return loaded


def _edits(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [document["containerEdits"], *(d["containerEdits"] for d in document["devices"])]


def test_the_spec_is_valid_void_and_tells_the_hook_the_driver(
    info: NodeInfo, document: dict[str, Any]
) -> None:
    assert schema_errors(document) == []
    assert document["cdiVersion"] == "0.5.0"
    assert document["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    for hook in document["containerEdits"].get("hooks", []):
        assert hook["args"][-2:] == ["--host-driver-version", info.driver_version]


def test_every_device_node_is_a_device_of_this_node(
    info: NodeInfo, document: dict[str, Any]
) -> None:
    nodes = {
        node.get("hostPath", node["path"]): node["path"]
        for edits in _edits(document)
        for node in edits.get("deviceNodes", [])
    }
    ours_drm = {
        f"/dev/dri/{name}"
        for device in info.devices
        if device.pci.bus_id and (address := sysfs_address(device.pci.bus_id))
        for name in _names(Path("/sys/bus/pci/devices") / address / "drm")
    }
    print(f"\ndevice nodes: {sorted(nodes)}")
    for host, path in nodes.items():
        if path == "/dev/nvidia-uvm" and not os.path.exists(host):
            continue  # made when nvidia-uvm loads (the agent runs nvidia-modprobe -u at start)
        assert stat.S_ISCHR(os.stat(host).st_mode), host
        if path.startswith("/dev/dri/"):
            assert path in ours_drm, f"{path} is not a DRM node of this node's GPUs"


def test_every_mounted_file_exists_and_is_the_drivers(
    info: NodeInfo, document: dict[str, Any]
) -> None:
    mounts = {m["containerPath"]: m["hostPath"] for m in document["containerEdits"]["mounts"]}
    volume = Path(mounts.pop("/usr/local/nvidia"))
    assert (volume / "lib64" / "libcuda.so.1").resolve().name == (
        f"libcuda.so.{info.driver_version}"
    )
    firmware_dir = f"/nvidia/{info.driver_version}/"
    seen: dict[str, list[str]] = {}
    for container_path, host_path in mounts.items():
        host = Path(host_path)
        assert host.exists(), f"{container_path}: {host} is missing"
        if container_path.startswith(f"{host_files.PROGRAM_DIR}/"):
            name = container_path.rsplit("/", 1)[1]
            assert host.parent == volume / "bin"
            installed = shutil.which(name)
            assert installed is not None, f"{name} is in the volume but not on PATH"
            assert host.read_bytes() == Path(installed).read_bytes(), name
            seen.setdefault("programs", []).append(name)
        elif container_path in (f"/run/{s}" for s in host_files.IPC_SOCKETS) or (
            container_path in (f"/var/run/{s}" for s in host_files.IPC_SOCKETS)
        ):
            assert stat.S_ISSOCK(os.stat(host).st_mode), host
            seen.setdefault("sockets", []).append(container_path)
        elif container_path == host_files.MPS_PIPE_DIR:
            assert host.is_dir()
            seen.setdefault("MPS", []).append(container_path)
        elif firmware_dir in container_path:
            assert host_files.is_gsp_firmware(host.name), host  # of the running driver
            seen.setdefault("firmware", []).append(host.name)
        else:
            assert host.is_file(), host
            assert b"nvidia" in host.read_bytes().lower(), f"{host} names nothing of NVIDIA's"
            seen.setdefault("vendor files", []).append(container_path)
    print(f"\nmounted besides the driver volume: {seen}")
    absent = {"programs", "vendor files", "firmware", "sockets", "MPS"} - set(seen)
    print(f"absent on this machine: {sorted(absent)}")
    assert "nvidia-smi" in seen.get("programs", [])


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []
