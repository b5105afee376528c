"""Reading the installed driver (the linker cache) and the loaded one (the kernel module)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.node.drivers import (
    InstalledDriver,
    LoadedModule,
    SimulatedModule,
    VolumeSetupError,
    prepare_volumes,
)
from tests.support.fake_driver import (
    NEW_VERSION,
    VERSION,
    FakeDriver,
    build_fake_driver,
    install_driver,
    remove_fake_driver,
)


@pytest.fixture(scope="module")
def two_drivers() -> Iterator[tuple[FakeDriver, FakeDriver]]:
    old, new = build_fake_driver(), build_fake_driver(version=NEW_VERSION)
    try:
        yield old, new
    finally:
        remove_fake_driver(old)
        remove_fake_driver(new)


def test_the_installed_driver_follows_the_linker_cache(
    two_drivers: tuple[FakeDriver, FakeDriver],
) -> None:
    old, new = two_drivers
    installed = InstalledDriver(old.ldcache)
    assert installed.version() == VERSION
    install_driver(old, new)
    assert installed.version() == NEW_VERSION


def test_no_nvml_in_the_cache_or_no_cache_is_unknown(tmp_path: Path) -> None:
    assert InstalledDriver(tmp_path / "missing.cache").version() is None
    (tmp_path / "garbage.cache").write_bytes(b"not a cache")
    assert InstalledDriver(tmp_path / "garbage.cache").version() is None


@pytest.mark.parametrize(
    ("first_line", "version"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 14 2025",
            "580.159.04",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  590.48.01  Release Build  "
            "(dvs-builder@U16-I3-B03-3-1)  Mon Nov 24 2025",
            "590.48.01",
        ),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54  Thu Feb 22 2024", "550.54"),
    ],
)
def test_the_loaded_module_s_version_from_proc(
    tmp_path: Path, first_line: str, version: str
) -> None:
    proc = tmp_path / "version"
    proc.write_text(first_line + "\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert LoadedModule(proc, tmp_path / "none").version() == version


def test_the_loaded_module_from_sys_then_none(tmp_path: Path) -> None:
    sys_file = tmp_path / "sys-version"
    sys_file.write_text("580.159.04\n")
    assert LoadedModule(tmp_path / "none", sys_file).version() == "580.159.04"
    sys_file.unlink()
    assert LoadedModule(tmp_path / "none", sys_file).version() is None  # no module loaded


def test_a_simulated_module_is_the_node_file_s_driver_version(tmp_path: Path) -> None:
    node = tmp_path / "node.json"
    node.write_text(json.dumps({"driver_version": VERSION}))
    module = SimulatedModule(node)
    assert module.version() == VERSION
    staged = tmp_path / "node.json.new"
    staged.write_text(json.dumps({"driver_version": NEW_VERSION}))
    os.replace(staged, node)
    assert module.version() == NEW_VERSION
    node.write_text('{"driver_version": "6')  # half written in place: still what it was
    assert module.version() == NEW_VERSION
    node.unlink()
    assert module.version() == NEW_VERSION


def test_a_volume_directory_that_cannot_be_made_names_d(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    volumes = tmp_path / "a-file" / "volumes"
    with pytest.raises(VolumeSetupError) as refused:
        prepare_volumes(volumes, VERSION, ldcache=None)
    assert str(refused.value) == (
        f"-d {volumes}: the volume directory cannot be used (Not a directory): give a "
        "directory the agent can create and write"
    )


def test_a_linker_cache_that_cannot_be_read_names_ldcache(tmp_path: Path) -> None:
    missing = tmp_path / "ld.so.cache"
    with pytest.raises(VolumeSetupError) as refused:
        prepare_volumes(tmp_path / "volumes", VERSION, ldcache=missing)
    assert str(refused.value).startswith(
        f"--ldcache {missing}: cannot read the dynamic linker cache {missing}: No such file"
    )
    assert str(refused.value).endswith("(ldconfig writes /etc/ld.so.cache)")


def test_a_fifo_as_the_linker_cache_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "ld.so.cache"
    os.mkfifo(fifo)  # no writer: a read would wait until the scan's 60 s ran out
    with pytest.raises(VolumeSetupError) as refused:
        prepare_volumes(tmp_path / "volumes", VERSION, ldcache=fifo)
    assert str(refused.value).startswith(f"--ldcache {fifo} is a FIFO, not a regular file")
    assert InstalledDriver(fifo).version() is None  # the watch's look does not wait either
