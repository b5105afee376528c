"""Real data for the Mesos tests: what nvidia-docker 1.0.1 answered on an H200."""

from __future__ import annotations

from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
_CANDIDATES = [
    root / "shared" / "fixtures" / "h200" / "reference-v1.0.1" for root in (_ROOT.parent, _ROOT)
]
REFERENCE = next((path for path in _CANDIDATES if path.is_dir()), _CANDIDATES[0])


@pytest.fixture(scope="session")
def reference_info_json() -> bytes:
    """The old tool's ``/gpu/info/json`` body (trailing newline included)."""
    return (REFERENCE / "info.json").read_bytes()


@pytest.fixture(scope="session")
def reference_mesos_cli() -> str:
    """The old tool's ``/mesos/cli`` line for the same node."""
    return (REFERENCE / "mesos-cli.txt").read_text()
