"""What a test needs from the machine, and what happens when the machine lacks it.

On a developer's machine a test whose prerequisite is missing (root, gcc, a command, a kernel
feature) is skipped, with the reason. In CI (``CI=true``, which ``.ci/run`` exports) it fails
instead: ``scripts/test-all`` installs everything the tests need, so there a missing
prerequisite is a broken setup, and a green run must mean that every test ran. GPU tests
(marker ``gpu``) are left out of CI's run, so they may keep skipping. ``tests/conftest.py``
turns any other skip into a failure in CI too, so that a new ``pytest.skip`` cannot slip by.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when the suite runs as CI (``CI=true``): every test must then run."""
    return os.environ.get("CI") == "true"


def unavailable(reason: str) -> NoReturn:
    """This test cannot run on this machine: skip it, or fail it in CI."""
    if in_ci():
        pytest.fail(
            f"{reason} (CI=true: every test must run here; scripts/test-all installs what the "
            "tests need)",
            pytrace=False,
        )
    pytest.skip(reason)


def require_root() -> None:
    """The real services (dockerd, sshd, device nodes) need root."""
    if os.geteuid() != 0:
        unavailable("needs root (real services: dockerd, sshd)")


def require_command(name: str, install: str) -> str:
    """The path of command ``name``: beside this Python first (the tools of its virtual
    environment, whether or not it is on PATH), then on PATH. ``install`` says how to get it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        unavailable(f"needs {name} ({install})")
    return found
