"""How the end-to-end tests run ``nvidia-docker``: as a user of this install would."""

from __future__ import annotations

import sys
from pathlib import Path


def wrapper_command() -> list[str]:
    """The installed ``nvidia-docker`` script when there is one, else the module."""
    script = Path(sys.executable).with_name("nvidia-docker")
    return [str(script)] if script.exists() else [sys.executable, "-m", "controller.wrapper.cli"]
