"""scripts/min-constraints: the constraints file of the min-version run, from pyproject.toml."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "min-constraints"


def _script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("min_constraints", str(SCRIPT))
    spec = importlib.util.spec_from_loader("min_constraints", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_every_runtime_and_test_dependency_is_pinned_to_its_floor() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    pins = dict(line.split("==") for line in out.splitlines() if not line.startswith("#"))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    assert len(pins) == len(declared)
    for requirement in declared:
        name, rest = requirement.split(">=", 1)
        assert pins[name] == rest.split(",")[0], requirement


@pytest.mark.parametrize(
    ("requirement", "pin"),
    [
        ("aiohttp>=3.10.10", "aiohttp==3.10.10"),
        ("nvidia-ml-py>=11.510.69,!=12.535.77", "nvidia-ml-py==11.510.69"),
        ("ruff==0.17.6", "ruff==0.17.6"),
        ("pytest-asyncio >= 0.24.0 ; python_version >= '3.11'", "pytest-asyncio==0.24.0"),
    ],
)
def test_floor_pin(requirement: str, pin: str) -> None:
    assert _script().floor_pin(requirement) == pin


@pytest.mark.parametrize("requirement", ["types-PyYAML", "click<9", "a>=1,>=2"])
def test_a_dependency_without_one_floor_is_refused(requirement: str) -> None:
    module = _script()
    with pytest.raises(module.FloorError, match="must declare one floor"):
        module.floor_pin(requirement)
