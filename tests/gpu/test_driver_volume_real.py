"""The real driver volume, built from the real /etc/ld.so.cache on a machine with a GPU.

On the H200 test machine the driver lives on a read-only squashfs under /usr/local/nvidia, so
hard links fail and every file must be copied. The test builds ``nvidia_driver_<running
version>`` into a temporary directory, loads ``libcuda.so.1`` and ``libnvidia-ml.so.1`` from the
volume with ctypes and asks NVML, through the volume's library, for the driver version.
Run with ``pytest -m gpu tests/gpu/test_driver_volume_real.py -s`` to see what it built.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("elftools", reason="pyelftools is needed to read the driver's ELF files")

from plugin.discovery import find_driver_files
from plugin.ldcache import read_ldcache
from plugin.volumes import VolumeStore

pytestmark = pytest.mark.gpu

LDCACHE = Path("/etc/ld.so.cache")


def _running_driver_version() -> str:
    """The driver version of the loaded kernel module (no NVML needed)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        pytest.skip("no NVIDIA driver loaded (/proc/driver/nvidia/version is missing)")
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    pytest.skip(f"cannot read the driver version from: {text.splitlines()[0]}")


def test_builds_the_real_volume_and_nvml_answers_through_it(tmp_path: Path) -> None:
    version = _running_driver_version()
    if not any(e.name == "libcuda.so.1" for e in read_ldcache(LDCACHE)):
        pytest.skip("libcuda.so.1 is not in /etc/ld.so.cache")
    started = time.monotonic()
    files = find_driver_files(version, ldcache=LDCACHE)
    found_s = time.monotonic() - started
    store = VolumeStore(tmp_path / "volumes", files)
    name = f"nvidia_driver_{version}"
    started = time.monotonic()
    volume = store.create(name)
    build_s = time.monotonic() - started

    lib64 = volume / "lib64"
    sources = {item.source for item in files.all_files}
    same_fs = all(os.stat(s).st_dev == os.stat(tmp_path).st_dev for s in sources)
    copied = [p for p in lib64.iterdir() if not p.is_symlink() and p.stat().st_nlink == 1]
    print(
        f"\n{name}: {files.summary()}\n"
        f"  discovery {found_s:.2f} s, build {build_s:.2f} s "
        f"({files.size_bytes / 2**20 / max(build_s, 1e-9):.0f} MiB/s), "
        f"{len(copied)} lib64 files copied, same filesystem as the driver: {same_fs}\n"
        f"  lib64: {' '.join(sorted(p.name for p in lib64.iterdir()))}\n"
        f"  bin: {' '.join(sorted(p.name for p in (volume / 'bin').iterdir()))}\n"
        f"  skipped: {[(s.path, s.reason) for s in files.skipped][:10]}"
    )
    assert (lib64 / "libcuda.so.1").resolve().name == f"libcuda.so.{version}"
    assert (lib64 / "libnvidia-ml.so.1").resolve().name == f"libnvidia-ml.so.{version}"
    if not same_fs:
        assert len(copied) == len(files.libraries_64)  # links failed: every library copied

    cuda = ctypes.CDLL(str(lib64 / "libcuda.so.1"))
    assert cuda.cuInit(0) == 0
    driver_version = ctypes.c_int()
    assert cuda.cuDriverGetVersion(ctypes.byref(driver_version)) == 0
    assert driver_version.value >= 12000

    nvml = ctypes.CDLL(str(lib64 / "libnvidia-ml.so.1"))
    assert nvml.nvmlInit_v2() == 0
    try:
        buf = ctypes.create_string_buffer(96)
        assert nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0
        assert buf.value.decode() == version
        count = ctypes.c_uint()
        assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        assert count.value >= 1
    finally:
        nvml.nvmlShutdown()
    # Both came from the volume, not from the driver's own directory.
    maps = Path("/proc/self/maps").read_text()
    assert str(lib64 / f"libnvidia-ml.so.{version}") in maps
    assert str(lib64 / f"libcuda.so.{version}") in maps
