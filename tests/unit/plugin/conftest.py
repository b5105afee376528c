"""Fixtures of the plugin's unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.discovery import DriverFiles, find_driver_files
from plugin.volumes import VolumeStore
from tests.support.fake_driver import FakeDriver
from tests.support.fixture_files import H200

FIXTURES = H200  # the real H200's ld.so.cache and driver file list


@pytest.fixture
def driver_files(fake_driver: FakeDriver) -> DriverFiles:
    return find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )


@pytest.fixture
def store(tmp_path: Path, driver_files: DriverFiles) -> VolumeStore:
    return VolumeStore(tmp_path / "volumes", driver_files, progress_interval_s=0.0)
