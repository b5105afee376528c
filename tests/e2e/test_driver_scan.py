"""The daemon finds its driver's files in a child process (``plugin.driver_scan``): with a
real linker cache (the fake driver's, made by ldconfig) the volume's files are found, and the
daemon itself never imports pyelftools (``-X importtime`` lists every module it imports)."""

from __future__ import annotations

from pathlib import Path

from plugin.discovery import find_driver_files
from tests.support.agent_process import launch_agent, wait_ready
from tests.support.fake_driver import FakeDriver
from tests.support.services import stop_process


def test_the_daemon_finds_driver_files_without_loading_pyelftools(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    agent = launch_agent(
        tmp_path,
        driver=fake_driver,
        python_flags=("-X", "importtime"),
        environment={"NV_DEBUG": "1"},
    )
    try:
        wait_ready(agent)
    finally:
        stop_process(agent.proc)
    log = agent.log_path.read_text()
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in log.splitlines()
        if line.startswith("import time:")
    }
    assert {"aiohttp", "plugin.discovery", "plugin.driver_scan"} <= imported  # it lists
    assert sorted(m for m in imported if m.startswith(("elftools", "plugin.elf"))) == []
    here = find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=fake_driver.search_path
    )
    assert here.libraries_64
    assert f"Driver files found: {here.summary()}\n" in log, log[-2000:]
    assert here.skipped  # the decoys: said under NV_DEBUG, as before the child
    for skipped in here.skipped:
        assert f"skipping {skipped.path}: {skipped.reason}\n" in log
