"""The driver volume on disk: layout, links, atomic build, concurrency, copies, confinement."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from plugin import filecopy, volume_build
from plugin.discovery import DriverFiles
from plugin.volumes import VolumeError, VolumeStore
from tests.support.fake_driver import FakeDriver
from tests.support.services import mounted_tmpfs

NAME = "nvidia_driver_580.159.04"


def tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_size) for p in root.rglob("*")
    )


def test_layout_files_and_links(store: VolumeStore, fake_driver: FakeDriver) -> None:
    path = store.create(NAME)
    assert path == store.volume_dir / "nvidia_driver" / "580.159.04"
    assert sorted(p.name for p in path.iterdir()) == ["bin", "lib", "lib64"]
    lib64 = path / "lib64"
    assert fake_driver.expected_lib64() <= {p.name for p in lib64.iterdir()}
    assert os.readlink(lib64 / "libcuda.so.1") == "libcuda.so.580.159.04"
    assert os.readlink(lib64 / "libcuda.so") == "libcuda.so.580.159.04"
    assert os.readlink(lib64 / "libGLX_indirect.so.0") == "libGLX_nvidia.so.580.159.04"
    assert not (lib64 / "libnvidia-tls.so.580.159.04").is_symlink()  # soname is the file
    for directory in (path, path / "bin", path / "lib", lib64):
        assert directory.stat().st_mode & 0o777 == 0o755  # readable by any container user
    # Same filesystem here: hard links, the driver's own inodes.
    source = fake_driver.lib64 / "libcuda.so.580.159.04"
    assert (lib64 / "libcuda.so.580.159.04").stat().st_ino == source.stat().st_ino
    if fake_driver.lib32 is not None:
        assert os.readlink(path / "lib" / "libnvidia-ml.so.1") == "libnvidia-ml.so.580.159.04"
    assert store.list() == [(NAME, path)]


def test_the_volume_s_nvml_loads_and_answers(store: VolumeStore) -> None:
    """As the GPU test does with the real driver: dlopen by soname from the volume."""
    lib64 = store.create(NAME) / "lib64"
    nvml = ctypes.CDLL(str(lib64 / "libnvidia-ml.so.1"))
    assert nvml.nvmlInit_v2() == 0
    buf = ctypes.create_string_buffer(80)
    assert nvml.nvmlSystemGetDriverVersion(buf, 80) == 0
    assert buf.value == b"580.159.04"
    ctypes.CDLL(str(lib64 / "libcuda.so.1"))


def test_sixteen_concurrent_creates_make_one_volume(
    store: VolumeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = []
    real_build = volume_build.build_tree

    def counting(*args: object, **kwargs: object) -> volume_build.BuildReport:
        builds.append(threading.get_ident())
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("plugin.volumes.build_tree", counting)
    with ThreadPoolExecutor(16) as pool:
        paths = list(pool.map(lambda _: store.create(NAME), range(16)))
    assert len(set(paths)) == 1
    assert len(builds) == 1
    assert [p.name for p in (store.volume_dir / "nvidia_driver").iterdir()] == ["580.159.04"]


def test_two_stores_on_one_directory_race_to_one_volume(
    tmp_path: Path, driver_files: DriverFiles
) -> None:
    """Two agents (processes) share a volume directory: the rename decides, both succeed."""
    stores = [VolumeStore(tmp_path / "v", driver_files) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda s: s.create(NAME), stores))
    assert len(set(paths)) == 1
    assert sorted(p.name for p in (tmp_path / "v" / "nvidia_driver").iterdir()) == ["580.159.04"]


def test_a_failed_build_leaves_nothing_that_looks_like_a_volume(
    store: VolumeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def failing(source: Path, target: Path, progress: object = None) -> filecopy.Method:
        calls.append(source)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.link(source, target)
        return filecopy.Method.LINK

    monkeypatch.setattr(volume_build, "place_file", failing)
    with pytest.raises(OSError, match="No space left"):
        store.create(NAME)
    assert list((store.volume_dir / "nvidia_driver").iterdir()) == []
    with pytest.raises(VolumeError, match="no such volume"):
        store.get(NAME)


def test_a_crashed_build_is_never_a_volume_and_is_cleaned_at_start(
    store: VolumeStore, tmp_path: Path, driver_files: DriverFiles
) -> None:
    parent = store.volume_dir / "nvidia_driver"
    parent.mkdir(parents=True)
    dead = parent / ".580.159.04.building-dead01"  # a builder killed mid-way: no lock held
    (dead / "lib64").mkdir(parents=True)
    (dead / "lib64" / "libcuda.so.1").write_bytes(b"half")
    (parent / ".580.159.04.building-dead01.lock").touch()
    gone = parent / ".470.57.02.removing-dead02"
    gone.mkdir()
    live = parent / ".580.159.04.building-live01"  # a builder at work in another process
    live.mkdir()
    live_lock = parent / ".580.159.04.building-live01.lock"
    holder = os.open(live_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # its own open file: the store cannot take it
    try:
        assert store.list() == []
        with pytest.raises(VolumeError, match="no such volume"):
            store.get(NAME)
        fresh = VolumeStore(tmp_path / "volumes", driver_files)
        assert fresh.clean_stale() == 2
        assert sorted(p.name for p in parent.iterdir()) == [live.name, live_lock.name]
    finally:
        os.close(holder)
    assert fresh.clean_stale() == 1
    assert list(parent.iterdir()) == []


def _no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)


def _assert_copies(volume: Path, driver_files: DriverFiles) -> None:
    for item in driver_files.all_files:
        sub = "bin" if item in driver_files.binaries else None
        sub = sub or ("lib64" if item in driver_files.libraries_64 else "lib")
        copy = volume / sub / item.name
        st, src = copy.stat(), item.source.stat()
        assert st.st_ino != src.st_ino
        assert st.st_mode == src.st_mode
        assert st.st_mtime_ns == src.st_mtime_ns
        assert copy.read_bytes() == item.source.read_bytes()


def test_copies_keep_content_and_mode_when_links_fail(
    store: VolumeStore,
    driver_files: DriverFiles,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _no_link(monkeypatch)
    caplog.set_level(logging.INFO, "nvidia-docker-plugin")
    volume = store.create(NAME)
    _assert_copies(volume, driver_files)
    progress = [r.getMessage() for r in caplog.records if "files," in r.getMessage()]
    total = len(driver_files.all_files)
    assert progress[-1].startswith(f"building {NAME}: {total}/{total} files,")
    built = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("built"))
    assert f"0 linked, 0 reflinked, {total} copied" in built


def test_sendfile_when_copy_file_range_is_refused(
    store: VolumeStore, driver_files: DriverFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_link(monkeypatch)

    def refuse(*_: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    _assert_copies(store.create(NAME), driver_files)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", "size=64m") as mountpoint:
        yield mountpoint


def test_a_volume_directory_on_another_filesystem_gets_copies(
    tmpfs: Path, driver_files: DriverFiles
) -> None:
    store = VolumeStore(tmpfs / "volumes", driver_files)
    _assert_copies(store.create(NAME), driver_files)


@pytest.mark.parametrize(
    "name",
    [
        "nvidia_driver_..",
        "nvidia_driver_.",
        "nvidia_driver_../..",
        "nvidia_driver_/etc",
        "nvidia_driver_580.159.04/../..",
        "nvidia_driver_580..159",
        "nvidia_driver_",
        "nvidia_driver",
        "_580.159.04",
        "nvidia_driver_580.159.04\n",
        "nvidia_driver_-1",
    ],
)
def test_names_that_could_escape_are_bad_format(store: VolumeStore, name: str) -> None:
    store.create(NAME)
    before = tree(store.volume_dir.parent)
    for operation in (store.create, store.remove, store.get, store.mountpoint):
        with pytest.raises(VolumeError) as caught:
            operation(name)
        assert str(caught.value) == f"bad volume format: {name}"
    assert tree(store.volume_dir.parent) == before


def test_unsupported_other_versions_and_missing(store: VolumeStore) -> None:
    with pytest.raises(VolumeError, match=r"^unsupported volume: cuda_12\.0$"):
        store.create("cuda_12.0")
    with pytest.raises(VolumeError, match=r"^invalid volume version: nvidia_driver_470\.57\.02$"):
        store.create("nvidia_driver_470.57.02")
    with pytest.raises(VolumeError, match=r"^no such volume: nvidia_driver_470\.57\.02$"):
        store.remove("nvidia_driver_470.57.02")
    assert not store.volume_dir.joinpath("nvidia_driver").exists()


def test_an_old_driver_s_volume_mounts_the_running_driver_s_and_stays_removable(
    store: VolumeStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Containers created before a driver upgrade name the old volume: they get the files
    of the driver that is loaded, since the old libraries cannot talk to its module."""
    caplog.set_level(logging.INFO)
    old = store.volume_dir / "nvidia_driver" / "470.57.02"
    (old / "lib64").mkdir(parents=True)
    assert store.list() == [("nvidia_driver_470.57.02", old)]
    running = store.volume_dir / "nvidia_driver" / "580.159.04"
    assert store.mountpoint("nvidia_driver_470.57.02") == running
    assert (running / "lib64" / "libcuda.so.1").exists()  # built on the way
    assert store.mountpoint("nvidia_driver_470.57.02") == running
    redirects = [r.getMessage() for r in caplog.records if "Mount of" in r.getMessage()]
    assert redirects == [
        "Mount of nvidia_driver_470.57.02: driver 470.57.02 is not the one loaded; serving "
        "nvidia_driver_580.159.04 (the running driver's files) instead"
    ]  # one line per name, however often it is mounted
    assert [name for name, _ in store.list()] == [
        "nvidia_driver_470.57.02",
        "nvidia_driver_580.159.04",
    ]  # docker volume ls keeps showing the old name until it is removed
    store.remove("nvidia_driver_470.57.02")
    assert [p.name for p in old.parent.iterdir()] == ["580.159.04"]


def test_after_an_upgrade_the_previous_driver_s_name_mounts_the_new_one(
    store: VolumeStore, driver_files: DriverFiles
) -> None:
    """Even when the old volume was never built on disk (``docker volume create`` of a
    container whose first start is after the upgrade)."""
    newer = dataclasses.replace(driver_files, driver_version="590.48.01")
    store.use_files(newer)
    assert store.driver_version == "590.48.01"
    mounted = store.mountpoint(NAME)
    assert mounted == store.volume_dir / "nvidia_driver" / "590.48.01"
    with pytest.raises(VolumeError, match=r"no such volume: nvidia_driver_1\.2\.3"):
        store.mountpoint("nvidia_driver_1.2.3")  # never a driver of this node
    with pytest.raises(VolumeError, match="invalid volume version"):
        store.create(NAME)  # the old version cannot be created any more


def test_a_symlinked_version_directory_is_refused(store: VolumeStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "lib64").mkdir(parents=True)
    parent = store.volume_dir / "nvidia_driver"
    parent.mkdir(parents=True)
    (parent / "580.159.04").symlink_to(outside)
    with pytest.raises(VolumeError, match="bad volume format"):
        store.remove(NAME)
    assert (outside / "lib64").is_dir()
