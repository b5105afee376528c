"""The CDI options of the command line: the flag, the environment, and "empty: off"."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import command


def cdi_spec_dir(args: list[str]) -> Path | None:
    ctx = command.make_context("nvidia-docker-plugin", ["--simulate", "h200", *args])
    value: Path | None = ctx.params["cdi_spec_dir"]
    return value


def test_the_default_is_var_run_cdi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR", raising=False)
    assert cdi_spec_dir([]) == Path("/var/run/cdi")


@pytest.mark.parametrize(("env", "args"), [("", []), ("/x", ["--cdi-spec-dir", ""])])
def test_empty_turns_the_spec_off(
    monkeypatch: pytest.MonkeyPatch, env: str, args: list[str]
) -> None:
    # An empty variable (what /etc/default/nvidia-docker writes to turn CDI off) must not
    # fall back to the default, as click would by itself.
    monkeypatch.setenv("NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR", env)
    assert cdi_spec_dir(args) is None


def test_the_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR", "")
    assert cdi_spec_dir(["--cdi-spec-dir", "/srv/cdi"]) == Path("/srv/cdi")
    monkeypatch.setenv("NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR", "/etc/cdi")
    assert cdi_spec_dir([]) == Path("/etc/cdi")
