"""The start-up step that makes sure /dev/nvidia-uvm exists (nvidia-modprobe -u -c=0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.node.uvm import UvmError, ensure_uvm_device


def _modprobe(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-modprobe"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def test_nothing_runs_when_the_device_exists(tmp_path: Path) -> None:
    (tmp_path / "nvidia-uvm").touch()
    assert ensure_uvm_device(str(tmp_path / "nvidia-uvm")) == f"{tmp_path}/nvidia-uvm present"


def test_nvidia_modprobe_creates_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uvm = tmp_path / "nvidia-uvm"
    args = tmp_path / "args"
    _modprobe(tmp_path / "bin", f'echo "$@" > {args}; : > {uvm}')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert ensure_uvm_device(str(uvm), str(tmp_path / "ctl")).endswith("created by nvidia-modprobe")
    assert args.read_text() == "-u -c=0\n"


def test_a_failing_nvidia_modprobe_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _modprobe(tmp_path / "bin", "echo 'FATAL: Module nvidia_uvm not found' >&2; exit 1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(UvmError, match=r"nvidia-modprobe -u -c=0.*Module nvidia_uvm not found"):
        ensure_uvm_device(str(tmp_path / "nvidia-uvm"), str(tmp_path / "ctl"))


def test_driver_loaded_but_no_nvidia_modprobe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ctl").touch()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UvmError, match="nvidia-modprobe is not installed: install it"):
        ensure_uvm_device(str(tmp_path / "nvidia-uvm"), str(tmp_path / "ctl"))


def test_no_driver_at_all_names_simulate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UvmError, match=r"NVIDIA driver not found.*--simulate FILE"):
        ensure_uvm_device(str(tmp_path / "nvidia-uvm"), str(tmp_path / "ctl"))
