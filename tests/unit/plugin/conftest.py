"""Fixtures of the plugin's unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.discovery import DriverFiles, find_driver_files
from plugin.volumes import VolumeStore
from tests.support.fake_driver import FakeDriver

_ROOT = Path(__file__).resolve().parents[3]
FIXTURES = next(
    (
        root / "shared" / "fixtures" / "h200"
        for root in (_ROOT.parent, _ROOT)
        if (root / "shared" / "fixtures" / "h200").is_dir()
    ),
    _ROOT.parent / "shared" / "fixtures" / "h200",
)


@pytest.fixture
def driver_files(fake_driver: FakeDriver) -> DriverFiles:
    return find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )


@pytest.fixture
def store(tmp_path: Path, driver_files: DriverFiles) -> VolumeStore:
    return VolumeStore(tmp_path / "volumes", driver_files, progress_interval_s=0.0)
