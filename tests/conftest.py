"""Fixtures shared by the whole suite, and the rule that CI runs every test."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator

import pytest

from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.fake_driver import FakeDriver, build_fake_driver, remove_fake_driver
from tests.support.plugin_agent import PluginAgent, running_plugin_agent
from tests.support.podman import describe as podman_layout
from tests.support.prerequisites import in_ci, require_command, require_root
from tests.support.sshd import SshServer, start_sshd, stop_sshd

# Agents the tests start write no CDI spec unless a test asks for one (--cdi-spec-dir): the
# default, /var/run/cdi, is the machine's own, read by every CDI engine here.
os.environ["NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR"] = ""
# And they run on asyncio's own event loop, which every install has, although uvloop (a test
# dependency) is installed: scripts/test-all runs the network-facing end-to-end tests a
# second time with NVIDIA_DOCKER_PLUGIN_EVENT_LOOP=uvloop, as `pip install '.[fast]'` runs.
os.environ.setdefault("NVIDIA_DOCKER_PLUGIN_EVENT_LOOP", "asyncio")
# Property tests keep no database of examples: scripts/test-all runs the suite with the newest
# Hypothesis and then with the declared minimum, in one checkout, and an example saved by one
# version is replayed by the other as bytes it no longer draws the same way (a Flaky error).
# (A GPU machine that runs only `pytest -m gpu` may lack Hypothesis: nothing to set there.)
try:
    from hypothesis import settings
except ImportError:  # pragma: no cover - the test extra always has it
    pass
else:
    settings.register_profile("suite", database=None)
    settings.load_profile("suite")


# Fixtures that start real services: a test that is the first to ask for one also waits for
# it to start (dockerd, a fake driver compiled with gcc, an agent), which on a loaded 2-core
# machine can take longer than the suite's default time limit for one test.
SLOW_TO_START = frozenset({"docker_engine", "plugin_agent", "fake_driver", "sshd_server"})
SERVICE_TEST_TIMEOUT_S = 300


# Loggers a command's edge configures for its process (controller/logs.py quiets "agent" and
# "paramiko" by stopping their propagation); tests run many commands in one process, and a
# later test's caplog must still see those loggers' records.
_EDGE_LOGGERS = ("", "agent", "paramiko", "nvidia-docker-plugin")


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Put back, after each test, what a command's edge changed in the process's logging."""
    saved = []
    for name in _EDGE_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, list(logger.handlers), logger.level))
    yield
    for logger, propagate, handlers, level in saved:
        logger.propagate = propagate
        logger.handlers[:] = handlers
        logger.setLevel(level)


def pytest_report_header() -> str:
    """Which cgroup layout the machine booted and which runtime the Podman tests use."""
    return podman_layout()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """More time for tests that start real services, unless they say how long themselves."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & SLOW_TO_START and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SERVICE_TEST_TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """In CI (``CI=true``) a skipped test is a failed one, GPU tests apart: a green CI run
    means every test ran (tests/support/prerequisites.py says why)."""
    report = yield
    if report.skipped and in_ci() and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), where every test must run: {reason}"
    return report


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """One private dockerd for the whole session (started on first use)."""
    require_root()
    engine, proc = start_engine()
    try:
        yield engine
    finally:
        stop_engine(engine, proc)


@pytest.fixture(scope="session")
def sshd_server() -> Iterator[SshServer]:
    """One real OpenSSH sshd on a free loopback port, with throw-away host and user keys."""
    require_root()
    server, proc = start_sshd()
    try:
        yield server
    finally:
        stop_sshd(server, proc)


@pytest.fixture(scope="session")
def fake_driver() -> Iterator[FakeDriver]:
    """A fake 580.159.04 driver root: real small ELF libraries, binaries, an ldconfig cache."""
    require_command("gcc", "apt-get install gcc libc6-dev: the fake driver's libraries")
    driver = build_fake_driver()
    try:
        yield driver
    finally:
        remove_fake_driver(driver)


@pytest.fixture(scope="session")
def plugin_agent(docker_engine: DockerEngine, fake_driver: FakeDriver) -> Iterator[PluginAgent]:
    """A real agent (``--simulate h200``, fake driver) serving the volume plugin to the
    session's dockerd through a spec file in that engine's own /etc/docker/plugins."""
    with running_plugin_agent(docker_engine, fake_driver) as agent:
        yield agent
