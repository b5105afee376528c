"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.services import require_root
from tests.support.sshd import SshServer, start_sshd, stop_sshd


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
