"""Driver volume builds reach the agent's counters through the store's listeners."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.metrics.agent_metrics import AgentMetrics
from plugin.discovery import find_driver_files
from plugin.volume_build import BuildReport
from plugin.volumes import VolumeStore
from tests.support.fake_driver import FakeDriver
from tests.unit.metrics.conftest import values

NAME = "nvidia_driver_580.159.04"


def _store(tmp_path: Path, fake_driver: FakeDriver) -> VolumeStore:
    files = find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )
    return VolumeStore(tmp_path / "volumes", files, progress_interval_s=0.0)


def test_a_build_is_counted_once_with_its_time_and_bytes(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    store = _store(tmp_path, fake_driver)
    counters = AgentMetrics()
    reports: list[BuildReport] = []
    store.build_listeners.append(counters.observe_volume_build)
    store.build_listeners.append(lambda _name, report: reports.append(report))
    store.create(NAME)
    store.create(NAME)  # already there: no build
    (report,) = reports
    text = counters.render().decode()
    assert values(text, "nvidia_docker_volume_builds_total", volume=NAME) == [1]
    assert values(text, "nvidia_docker_volume_build_bytes_total", volume=NAME) == [
        report.size_bytes
    ]
    assert report.size_bytes > 0
    assert values(text, "nvidia_docker_volume_build_duration_seconds_sum", volume=NAME) == [
        pytest.approx(report.seconds)
    ]


def test_a_failing_listener_does_not_fail_the_build(
    tmp_path: Path, fake_driver: FakeDriver, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path, fake_driver)

    def broken(_name: str, _report: BuildReport) -> None:
        raise RuntimeError("listener bug")

    store.build_listeners.append(broken)
    assert store.create(NAME).is_dir()
    assert any(
        r.levelno == logging.ERROR and "volume build listener" in r.getMessage()
        for r in caplog.records
    )
