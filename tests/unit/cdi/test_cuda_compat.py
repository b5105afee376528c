"""CUDA forward compatibility libraries of an image: the toolkit's rule (used only when newer
than the host's driver), and the hook putting them first in the container's linker cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cdi import cuda_compat
from plugin.discovery import find_driver_files
from plugin.volume_build import build_tree
from tests.support.fake_driver import NEW_VERSION, OLD_VERSION, FakeDriver, build_cuda_compat

HOST = "580.159.04"
LDCONFIG = shutil.which("ldconfig", path="/usr/sbin:/sbin:/usr/bin:/bin") or "/sbin/ldconfig"
REPO = Path(__file__).resolve().parents[3]


def image(root: Path, *names: str, link: bool = True) -> Path:
    """A root with ``/usr/local/cuda-13.1/compat`` holding ``names`` (empty files) and,
    with ``link``, ``/usr/local/cuda -> cuda-13.1`` as CUDA images have it."""
    compat = root / "usr/local/cuda-13.1/compat"
    compat.mkdir(parents=True)
    for name in names:
        (compat / name).touch()
    if link:
        (root / "usr/local/cuda").symlink_to("cuda-13.1")
    return compat


@pytest.mark.parametrize(
    ("names", "used"),
    [
        (("libcuda.so.590.48.01", "libcuda.so.1", "libnvidia-ptxjitcompiler.so.1"), True),
        (("libcuda.so.580.200.01",), False),  # the same major: the host's driver is right
        (("libcuda.so.570.86.10",), False),  # older
        (("libcuda.so.1",), False),  # no version
        (("libcuda.so.590.48.01", "libcuda.so.600.1"), False),  # two: which? neither
        ((), False),
    ],
)
def test_the_compat_directory_is_used_when_its_libcuda_is_of_a_newer_major(
    tmp_path: Path, names: tuple[str, ...], used: bool
) -> None:
    image(tmp_path, *names)
    expected = "/usr/local/cuda-13.1/compat" if used else None
    assert cuda_compat.compat_dir(tmp_path, HOST) == expected


def test_no_compat_directory_or_an_odd_host_version_is_no_compat(tmp_path: Path) -> None:
    assert cuda_compat.compat_dir(tmp_path, HOST) is None
    image(tmp_path, "libcuda.so.590.48.01")
    assert cuda_compat.compat_dir(tmp_path, "not-a-version") is None


def test_a_link_out_of_the_image_resolves_inside_it(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    image(outside, "libcuda.so.590.48.01", link=False)
    root = tmp_path / "root"
    (root / "usr/local").mkdir(parents=True)
    (root / "usr/local/cuda").symlink_to(outside / "usr/local/cuda-13.1")  # the host's path
    assert cuda_compat.compat_dir(root, HOST) is None  # looked for inside the root: absent


@pytest.mark.skipif(os.geteuid() != 0, reason="ldconfig -r chroots: needs root")
@pytest.mark.parametrize(("compat", "first"), [(NEW_VERSION, NEW_VERSION), (OLD_VERSION, HOST)])
def test_the_hook_puts_newer_compat_libraries_first_in_the_cache(
    tmp_path: Path, fake_driver: FakeDriver, compat: str, first: str
) -> None:
    bundle = tmp_path / "bundle"
    root = bundle / "rootfs"
    (root / "usr/local/nvidia").mkdir(parents=True)
    build_tree(
        find_driver_files(
            fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
        ),
        root / "usr/local/nvidia",
        what="test volume",
    )
    (root / "etc/ld.so.conf.d").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    build_cuda_compat(root / "usr/local/cuda-13.1/compat", compat)
    (root / "usr/local/cuda").symlink_to("cuda-13.1")
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    args = ["update-ldcache", "--ldconfig", LDCONFIG, "--folder", "/usr/local/nvidia/lib64"]
    args += ["--host-driver-version", fake_driver.version]
    done = subprocess.run(
        [sys.executable, "-m", "cdi.hook", *args],
        input=json.dumps({"ociVersion": "1.0.2", "bundle": str(bundle)}),
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    cache = subprocess.run(
        [LDCONFIG, "-r", str(root), "-p"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    found = [line.split(" => ")[1] for line in cache.splitlines() if "libcuda.so.1 " in line]
    assert Path(os.path.realpath(root / found[0].lstrip("/"))).name == f"libcuda.so.{first}"
    conf = (root / "etc/ld.so.conf.d/00-nvidia-docker.conf").read_text().splitlines()
    compat_first = ["/usr/local/cuda-13.1/compat"] if first == NEW_VERSION else []
    assert conf[1:] == [*compat_first, "/usr/local/nvidia/lib64"]
