"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.fake_driver import FakeDriver, build_fake_driver, remove_fake_driver
from tests.support.plugin_agent import PluginAgent, running_plugin_agent
from tests.support.services import require_root
from tests.support.sshd import SshServer, start_sshd, stop_sshd

# Agents the tests start write no CDI spec unless a test asks for one (--cdi-spec-dir): the
# default, /var/run/cdi, is the machine's own, read by every CDI engine here.
os.environ["NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR"] = ""


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
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the fake driver libraries")
    driver = build_fake_driver()
    try:
        yield driver
    finally:
        remove_fake_driver(driver)


@pytest.fixture(scope="session")
def plugin_agent(docker_engine: DockerEngine, fake_driver: FakeDriver) -> Iterator[PluginAgent]:
    """A real agent (``--simulate h200``, fake driver) serving the volume plugin to the
    session's dockerd through /etc/docker/plugins/nvidia-docker.spec (under the test lock)."""
    with running_plugin_agent(docker_engine, fake_driver) as agent:
        yield agent
