"""Finding the host files a GPU container gets, on a fake node root: only what is there, as
found, each checked to be what it should be."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

import pytest

from agent.cdi_spec import host_files
from agent.cdi_spec.host_files import find_host_files, sysfs_address
from cdi.host_files import Access, HostMount
from tests.support.cdi_node import DRM, INFO, make_dev_root

VERSION = INFO.driver_version

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the fake node's nodes need mknod: root")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    node = tmp_path / "root"
    make_dev_root(node, host_files=True)
    return node


def volume_with(tmp_path: Path, *programs: str) -> Path:
    volume = tmp_path / "volume"
    (volume / "bin").mkdir(parents=True)
    for name in programs:
        (volume / "bin" / name).write_text("#!/bin/true\n")
    return volume


def by_container_path(mounts: Iterable[HostMount]) -> dict[str, HostMount]:
    return {mount.container_path: mount for mount in mounts}


def test_the_fake_nodes_files_are_found_where_the_toolkit_finds_them(
    root: Path, tmp_path: Path
) -> None:
    volume = volume_with(tmp_path, "nvidia-smi", "nvidia-cuda-mps-control")
    found = by_container_path(find_host_files(INFO, volume, root).mounts)
    assert found == {
        "/usr/bin/nvidia-smi": HostMount(str(volume / "bin/nvidia-smi"), "/usr/bin/nvidia-smi"),
        "/usr/bin/nvidia-cuda-mps-control": HostMount(
            str(volume / "bin/nvidia-cuda-mps-control"), "/usr/bin/nvidia-cuda-mps-control"
        ),
        # reached through two links with absolute targets, resolved inside the root
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": HostMount(
            str(root / "usr/share/nvidia/10_nvidia.json"),
            "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        ),
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": HostMount(
            str(root / "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json"),
            "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        ),
        "/etc/OpenCL/vendors/nvidia.icd": HostMount(
            str(root / "etc/OpenCL/vendors/nvidia.icd"), "/etc/OpenCL/vendors/nvidia.icd"
        ),
        # the host has it in /usr/share; the toolkit gives it in /etc
        "/etc/vulkan/icd.d/nvidia_icd.json": HostMount(
            str(root / "usr/share/vulkan/icd.d/nvidia_icd.json"),
            "/etc/vulkan/icd.d/nvidia_icd.json",
        ),
        "/run/nvidia-persistenced/socket": HostMount(
            str(root / "run/nvidia-persistenced/socket"),
            "/run/nvidia-persistenced/socket",
            Access.TALK,
        ),
        "/tmp/nvidia-mps": HostMount(str(root / "tmp/nvidia-mps"), "/tmp/nvidia-mps", Access.TALK),
        **{
            f"/lib/firmware/nvidia/{VERSION}/{name}": HostMount(
                str(root / f"lib/firmware/nvidia/{VERSION}/{name}"),
                f"/lib/firmware/nvidia/{VERSION}/{name}",
            )
            for name in ("gsp_ga10x.bin", "gsp_tu10x.bin")
        },
    }


def test_each_gpu_gets_its_own_drm_nodes(root: Path) -> None:
    drm = find_host_files(INFO, None, root).drm
    assert {i: [node.path for node in nodes] for i, nodes in drm.items()} == {
        i: [f"/dev/dri/{name}" for name in names] for i, names in DRM.items()
    }
    assert drm[0][0].host_path == str(root / "dev/dri/card1")


def test_a_drm_name_without_its_device_node_is_left_out(root: Path) -> None:
    (root / "dev/dri/renderD129").unlink()
    (root / "dev/dri/renderD129").write_text("not a device\n")
    assert [n.path for n in host_files.drm_nodes(root, str(INFO.devices[1].pci.bus_id))] == [
        "/dev/dri/card2"
    ]


def test_a_bare_root_has_nothing(tmp_path: Path) -> None:
    assert find_host_files(INFO, None, tmp_path) == host_files.HostFiles()


def test_what_is_not_what_it_should_be_is_not_mounted(root: Path, tmp_path: Path) -> None:
    # a regular file where the socket should be, and the fabric manager's as a socket
    sock = root / "run/nvidia-persistenced/socket"
    sock.unlink()
    sock.write_text("not a socket\n")
    (root / "var/run/nvidia-fabricmanager").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(root / "var/run/nvidia-fabricmanager/socket"))
    # a directory instead of a vendor file; the MPS directory not root's
    vendor = root / "etc/OpenCL/vendors/nvidia.icd"
    vendor.unlink()
    vendor.mkdir()
    os.chown(root / "tmp/nvidia-mps", 1000, 1000)
    found = by_container_path(find_host_files(INFO, volume_with(tmp_path), root).mounts)
    assert "/run/nvidia-persistenced/socket" not in found
    assert found["/var/run/nvidia-fabricmanager/socket"].access is Access.TALK
    assert "/etc/OpenCL/vendors/nvidia.icd" not in found
    assert "/tmp/nvidia-mps" not in found


def test_an_mps_directory_behind_a_link_is_not_mounted(root: Path, tmp_path: Path) -> None:
    (root / "tmp/nvidia-mps/log").unlink()
    (root / "tmp/nvidia-mps").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "tmp/nvidia-mps").symlink_to(tmp_path / "elsewhere")
    assert "/tmp/nvidia-mps" not in by_container_path(host_files.ipc(root))


def test_firmware_from_the_kernels_own_path_parameter_comes_first(root: Path) -> None:
    custom = root / "srv/firmware/nvidia" / VERSION
    custom.mkdir(parents=True)
    (custom / "gsp_ga10x.bin").write_bytes(b"custom\n")
    (custom / "not-firmware.txt").write_text("left out\n")
    parameter = root / "sys/module/firmware_class/parameters/path"
    parameter.parent.mkdir(parents=True)
    parameter.write_text("/srv/firmware\n")
    found = host_files.gsp_firmware(root, VERSION, "6.1.0-test")
    assert [(m.container_path, Path(m.host_path).read_bytes()) for m in found] == [
        (f"/srv/firmware/nvidia/{VERSION}/gsp_ga10x.bin", b"custom\n"),
        (
            f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
            f"GSP firmware gsp_ga10x.bin of {VERSION}\n".encode(),
        ),
        (
            f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
            f"GSP firmware gsp_tu10x.bin of {VERSION}\n".encode(),
        ),
    ]


@pytest.mark.parametrize(
    ("nvml", "sysfs"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0000:AB:1F.7", "0000:ab:1f.7"),
        ("00000001:00:06.0", "0001:00:06.0"),
        ("not a bus id", None),
        ("0000:18:00", None),
    ],
)
def test_sysfs_names_the_pci_device_by_its_short_domain(nvml: str, sysfs: str | None) -> None:
    assert sysfs_address(nvml) == sysfs
