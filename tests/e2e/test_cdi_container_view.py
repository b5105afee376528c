"""What a container gets from the agent's CDI spec besides its GPUs, seen from inside it
with a real Podman (Debian 12's 4.3.1).

A real agent serves the simulated ``h200x2-mig`` node against the fake driver root and writes
its spec into ``/var/run/cdi`` (under the machine's CDI lock, removed afterwards), with a
private dev root that holds what a real node has besides its device nodes: the driver's
vendor files (EGL through Debian's alternatives links, Vulkan, OpenCL), GSP firmware,
nvidia-persistenced's socket, the MPS pipe directory, ``/dev/nvidia-modeset`` and each GPU's
DRM nodes with the sysfs directory that names them; no fabric manager.

Checked from inside a plain busybox image (no PATH or LD_LIBRARY_PATH of ours) that sets
``NVIDIA_VISIBLE_DEVICES=all``: ``nvidia-smi`` runs by name from PATH, the vendor files and
the socket paths are where their loaders and clients look, the GPU's own DRM nodes and no
other, ``NVIDIA_VISIBLE_DEVICES`` is ``void``; and in a Debian image with CUDA forward
compatibility libraries: the hook loads them when they are newer than the driver, the
driver's own ``libcuda`` when they are not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cdi_node import (
    CDI_DIR,
    DRM,
    INFO,
    LABELS,
    PROGRAM,
    SPEC_NAME,
    CdiAgent,
    machine_cdi_agent,
)
from tests.support.cdi_schema import schema_errors
from tests.support.fake_driver import (
    NEW_VERSION,
    OLD_VERSION,
    VENDOR_FILES,
    FakeDriver,
    build_cuda_compat,
)
from tests.support.podman import Podman, private_podman
from tests.support.systemd_hosts import ensure_rootfs_tarball

pytestmark = pytest.mark.e2e

SPEC = CDI_DIR / SPEC_NAME
VERSION = INFO.driver_version
VENDOR_IN_CONTAINER = {  # where the container has each vendor file (as the toolkit mounts them)
    "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "usr/share/nvidia/10_nvidia.json",
    "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": (
        "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json"
    ),
    "/etc/vulkan/icd.d/nvidia_icd.json": "usr/share/vulkan/icd.d/nvidia_icd.json",
    "/etc/OpenCL/vendors/nvidia.icd": "etc/OpenCL/vendors/nvidia.icd",
}
FIRMWARE = [f"/lib/firmware/nvidia/{VERSION}/{n}" for n in ("gsp_ga10x.bin", "gsp_tu10x.bin")]
SOCKET = "/run/nvidia-persistenced/socket"
MPS = "/tmp/nvidia-mps"


@pytest.fixture(scope="module")
def agent(fake_driver: FakeDriver) -> Iterator[CdiAgent]:
    with machine_cdi_agent(fake_driver, host_files=True) as running:
        yield running


@pytest.fixture(scope="module")
def podman(agent: CdiAgent) -> Iterator[Podman]:  # after the agent: the locks' order
    with private_podman() as engine:
        yield engine


@pytest.fixture(scope="module")
def plain(podman: Podman) -> str:
    """busybox with NVIDIA_VISIBLE_DEVICES=all, as images built FROM nvidia/cuda set it."""
    base = podman.import_busybox("nvd-cdi-view/busybox", LABELS)
    podman("create", "--name", "nvd-cdi-view-base", base, "true")
    podman(
        "commit", "--quiet", "--change", "ENV NVIDIA_VISIBLE_DEVICES=all",
        "nvd-cdi-view-base", "nvd-cdi-view/plain",
    )  # fmt: skip
    podman("rm", "nvd-cdi-view-base")
    return "nvd-cdi-view/plain"


@pytest.fixture(scope="module")
def debian(podman: Podman) -> str:
    return podman.import_tarball(ensure_rootfs_tarball(), "nvd-cdi-view/debian", LABELS)


def test_the_spec_names_what_the_host_has_and_nothing_else(agent: CdiAgent) -> None:
    document = json.loads(SPEC.read_text())
    assert schema_errors(document) == []
    assert document["cdiVersion"] == "0.5.0"  # env and more mounts need nothing newer
    edits = document["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert set(mounts) == {
        "/usr/local/nvidia",
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump",  # the fake driver has no persistenced or MPS programs
        *VENDOR_IN_CONTAINER,
        *FIRMWARE,
        SOCKET,  # and no fabric manager
        MPS,
    }
    devroot = agent.node_file.parent / "devroot"
    for path, under_root in VENDOR_IN_CONTAINER.items():
        assert mounts[path]["hostPath"] == str(devroot / under_root)  # links resolved there
    assert all(Path(m["hostPath"]).exists() for m in edits["mounts"])
    assert mounts[SOCKET]["options"] == ["nosuid", "nodev", "noexec", "bind"]
    assert mounts["/usr/bin/nvidia-smi"]["options"] == ["ro", "nosuid", "nodev", "bind"]
    assert "/dev/nvidia-modeset" in [node["path"] for node in edits["deviceNodes"]]

    def nodes(name: str) -> set[str]:
        (device,) = [d for d in document["devices"] if d["name"] == name]
        return {node["path"] for node in device["containerEdits"]["deviceNodes"]}

    card0, render0 = (f"/dev/dri/{name}" for name in DRM[0])
    card1, render1 = (f"/dev/dri/{name}" for name in DRM[1])
    assert {card0, render0} <= nodes("0")
    assert {card1, render1} <= nodes("1")
    assert not {card1, render1} & nodes("0")
    assert not {card0, render0} & nodes("0:1")  # a MIG device gets no display
    assert {card0, render0, card1, render1} <= nodes("all")


LOOK = f"""
echo "PATH=$PATH"
echo "LD_LIBRARY_PATH=${{LD_LIBRARY_PATH-unset}}"
echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"
command -v nvidia-smi
nvidia-smi
command -v nvidia-persistenced || echo "no nvidia-persistenced"
test -S {SOCKET} && echo "socket {SOCKET}"
test -e /run/nvidia-fabricmanager/socket || echo "no fabric manager socket"
test -d {MPS} && cat {MPS}/log
ls /lib/firmware/nvidia/{VERSION}
ls /dev/dri
test -c /dev/nvidia-modeset && echo "modeset"
"""


def test_a_plain_image_finds_the_drivers_tools_files_and_sockets(
    agent: CdiAgent, podman: Podman, plain: str, fake_driver: FakeDriver
) -> None:
    done = podman.run(plain, "sh", "-c", LOOK, devices=["nvidia.com/gpu=1"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("PATH=")
    assert "/usr/local/nvidia" not in lines[0]  # nothing of ours on PATH: /usr/bin is there
    assert lines[1:] == [
        "LD_LIBRARY_PATH=unset",
        "NVIDIA_VISIBLE_DEVICES=void",  # the image's "all" is overridden by the spec
        "/usr/bin/nvidia-smi",
        f"nvidia-smi (fake) driver {fake_driver.version}",
        "no nvidia-persistenced",
        f"socket {SOCKET}",
        "no fabric manager socket",
        "MPS pipes",
        "gsp_ga10x.bin",
        "gsp_tu10x.bin",
        *DRM[1],  # GPU 1's card and render node, neither GPU 0's nor the other vendor's
        "modeset",
    ]


def test_the_vendor_files_are_where_their_loaders_read_them(
    agent: CdiAgent, podman: Podman, plain: str
) -> None:
    paths = list(VENDOR_IN_CONTAINER)
    done = podman.run(plain, "cat", *paths, devices=["nvidia.com/gpu=0"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(VENDOR_FILES[VENDOR_IN_CONTAINER[p]] for p in paths)


def test_without_a_gpu_the_image_gets_none_of_it(podman: Podman, plain: str) -> None:
    done = podman.run(plain, "sh", "-c", LOOK)
    assert "NVIDIA_VISIBLE_DEVICES=all" in done.stdout.splitlines()
    assert "/usr/bin/nvidia-smi" not in done.stdout


def _image_with_compat(podman: Podman, debian: str, version: str) -> str:
    """The Debian image with CUDA forward compatibility libraries of driver ``version`` at
    /usr/local/cuda-13.1/compat, and /usr/local/cuda -> cuda-13.1 as CUDA images have it."""
    tag = f"nvd-cdi-view/debian-compat:{version}"
    with tempfile.TemporaryDirectory(prefix="nvd-compat-") as tmp:
        tree = Path(tmp) / "local"
        build_cuda_compat(tree / "cuda-13.1" / "compat", version)
        (tree / "cuda").symlink_to("cuda-13.1")
        name = f"nvd-cdi-view-compat-{version}"
        podman("create", "--name", name, debian, "true")
        try:
            podman("cp", f"{tree}/.", f"{name}:/usr/local/")
            podman("commit", "--quiet", name, tag)
        finally:
            podman("rm", "--force", name, check=False)
    return tag


@pytest.mark.parametrize(
    ("compat", "loaded"),
    [
        (NEW_VERSION, f"/usr/local/cuda-13.1/compat/libcuda.so.{NEW_VERSION}"),  # newer: used
        (OLD_VERSION, f"/usr/local/nvidia/lib64/libcuda.so.{VERSION}"),  # older: the driver's
    ],
)
def test_cuda_compat_libraries_are_loaded_only_when_newer_than_the_driver(
    agent: CdiAgent, podman: Podman, debian: str, compat: str, loaded: str
) -> None:
    image = _image_with_compat(podman, debian, compat)
    done = podman.run(image, "python3", "-c", PROGRAM, devices=["nvidia.com/gpu=1"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"cuInit 0 driver {VERSION}", loaded]


def test_the_hook_is_told_the_host_drivers_version(agent: CdiAgent) -> None:
    (hook,) = json.loads(SPEC.read_text())["containerEdits"]["hooks"]
    assert hook["args"][-2:] == ["--host-driver-version", VERSION]
    assert shutil.which(hook["path"]) or Path(hook["path"]).exists()
    assert (
        subprocess.run([hook["path"], "--help"], capture_output=True, check=False).returncode == 0
    )
