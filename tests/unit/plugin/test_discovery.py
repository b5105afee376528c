"""Finding the driver's files in a fake driver root through a real ldconfig cache."""

from __future__ import annotations

from pathlib import Path

from plugin.discovery import DriverFiles, find_driver_files
from tests.support.fake_driver import FakeDriver


def test_finds_the_driver_and_resolves_symlinks(
    fake_driver: FakeDriver, driver_files: DriverFiles
) -> None:
    ours = {f.name for f in driver_files.libraries_64 if f.source.parent == fake_driver.lib64}
    assert ours == {lib.file_name() for lib in fake_driver.libs_64}
    for item in driver_files.all_files:
        assert not item.source.is_symlink()
        assert item.size_bytes == item.source.stat().st_size
    assert [b.name for b in driver_files.binaries] == ["nvidia-debugdump", "nvidia-smi"]
    cuda = next(f for f in driver_files.libraries_64 if f.component == "libcuda")
    assert (cuda.name, cuda.soname) == ("libcuda.so.580.159.04", "libcuda.so.1")


def test_32_bit_libraries_go_apart(fake_driver: FakeDriver, driver_files: DriverFiles) -> None:
    names = sorted(f.name for f in driver_files.libraries_32)
    expected = sorted(lib.file_name() for lib in fake_driver.libs_32)
    assert names == expected  # empty where gcc -m32 cannot link


def test_leaves_out_other_vendors_other_abis_and_other_drivers(
    fake_driver: FakeDriver, driver_files: DriverFiles
) -> None:
    sources = {f.source for f in driver_files.all_files}
    decoys = set(fake_driver.decoys.rglob("*"))
    assert not sources & decoys
    reasons = {Path(s.path).parent.name: s.reason for s in driver_files.skipped}
    assert "another vendor" in reasons["mesa"]
    assert reasons["tls"] == "TLS library for ABI 2.2.5, not 2.3.99"
    assert reasons["old"] == "not of the running driver 580.159.04"


def test_another_running_version_finds_no_driver_library(fake_driver: FakeDriver) -> None:
    files = find_driver_files("470.57.02", ldcache=fake_driver.ldcache, search_path="/nonexistent")
    assert [f.source.parent.name for f in files.libraries_64 if f.component == "libcuda"] == ["old"]
    assert not any(f.source.parent == fake_driver.lib64 for f in files.all_files)
    assert files.binaries == ()
