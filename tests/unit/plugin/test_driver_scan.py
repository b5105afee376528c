"""Finding the driver's files in a child process (``plugin.driver_scan``): the same answer
as ``find_driver_files`` in this process, and one clear line for every way the child can
fail, a linker cache that blocks the reader included (a FIFO: the child is killed)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from plugin.discovery import DriverFiles, find_driver_files, from_json, to_json
from plugin.driver_scan import DriverScanError, scan_driver_files
from plugin.ldcache import LdCacheError
from tests.support.fake_driver import FakeDriver


def test_the_child_finds_what_this_process_finds(
    fake_driver: FakeDriver, driver_files: DriverFiles
) -> None:
    scanned = scan_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )
    assert scanned == driver_files
    assert scanned.skipped == driver_files.skipped  # not compared by ==
    assert scanned.libraries_64


def test_the_child_searches_this_process_s_path_by_default(
    fake_driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_driver.search_path)
    scanned = scan_driver_files(fake_driver.version, ldcache=fake_driver.ldcache)
    assert [b.name for b in scanned.binaries] == ["nvidia-debugdump", "nvidia-smi"]


def test_the_answer_survives_json(driver_files: DriverFiles) -> None:
    again = from_json(json.loads(json.dumps(to_json(driver_files))))
    assert again == driver_files
    assert again.skipped == driver_files.skipped


@pytest.mark.parametrize(
    "document",
    [
        None,
        [],
        {"driver_version": "580.159.04"},
        {"driver_version": 580, "binaries": [], "libraries_64": [], "libraries_32": [],
         "skipped": []},
        {"driver_version": "580", "binaries": [{"source": "/x", "name": "x", "component": "x",
         "soname": None, "size_bytes": -1}], "libraries_64": [], "libraries_32": [],
         "skipped": []},
        {"driver_version": "580", "binaries": [{"source": "/x", "name": "x", "component": "x",
         "soname": None, "size_bytes": True}], "libraries_64": [], "libraries_32": [],
         "skipped": []},
        {"driver_version": "580", "binaries": ["/x"], "libraries_64": [], "libraries_32": [],
         "skipped": []},
    ],
)  # fmt: skip
def test_a_bad_document_is_refused(document: object) -> None:
    with pytest.raises(ValueError, match="not a list of driver files"):
        from_json(document)


def test_an_unreadable_linker_cache_is_said_as_in_process(tmp_path: Path) -> None:
    garbage = tmp_path / "ld.so.cache"
    garbage.write_bytes(b"this is no linker cache" * 10)
    with pytest.raises(LdCacheError) as here:
        find_driver_files("580.159.04", ldcache=garbage)
    with pytest.raises(DriverScanError) as child:
        scan_driver_files("580.159.04", ldcache=garbage)
    assert str(child.value) == str(here.value)


def test_a_missing_linker_cache_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DriverScanError) as child:
        scan_driver_files("580.159.04", ldcache=tmp_path / "none")
    assert "No such file or directory" in str(child.value)
    assert "\n" not in str(child.value)


def test_a_cache_that_never_answers_costs_the_child_not_the_caller(tmp_path: Path) -> None:
    """A FIFO in place of the cache: opening it blocks for ever; the child is killed."""
    fifo = tmp_path / "ld.so.cache"
    os.mkfifo(fifo)
    with pytest.raises(DriverScanError, match=r"took more than 1 s \(the child was killed\)"):
        scan_driver_files("580.159.04", ldcache=fifo, timeout_s=1)


@pytest.mark.parametrize(
    ("script", "said"),
    [
        ("exit 1", "the driver file scan failed (exit code 1)"),
        ("echo 'Traceback ...' >&2; echo 'KeyError: x' >&2; exit 1",
         "the driver file scan failed (KeyError: x)"),
        ("echo '{\"driver_version\": 1}'", "the driver file scan answered badly (not a list"),
        ("echo 'not json'", "the driver file scan answered badly ("),
        ("kill -9 $$", "the driver file scan failed (exit code -9)"),
    ],
)  # fmt: skip
def test_a_child_that_fails_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, said: str
) -> None:
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    with pytest.raises(DriverScanError) as failed:
        scan_driver_files("580.159.04", ldcache=tmp_path / "ld.so.cache")
    assert str(failed.value).startswith(said)
    assert "\n" not in str(failed.value)


def test_a_child_that_cannot_start_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(DriverScanError, match=r"cannot start the driver file scan \(No such"):
        scan_driver_files("580.159.04", ldcache=tmp_path / "ld.so.cache")
