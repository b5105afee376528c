"""Real data for the Mesos tests: what nvidia-docker 1.0.1 answered on an H200."""

from __future__ import annotations

import pytest

from tests.support.fixture_files import REFERENCE_V101 as REFERENCE


@pytest.fixture(scope="session")
def reference_info_json() -> bytes:
    """The old tool's ``/gpu/info/json`` body (trailing newline included)."""
    return (REFERENCE / "info.json").read_bytes()


@pytest.fixture(scope="session")
def reference_mesos_cli() -> str:
    """The old tool's ``/mesos/cli`` line for the same node."""
    return (REFERENCE / "mesos-cli.txt").read_text()
