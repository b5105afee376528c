"""The spec writer beside another producer's spec of its kind: it steps aside where engines
would drop both, says so once, names the other spec's devices, and comes back; elsewhere it
only warns. Private directories stand for /etc/cdi and /var/run/cdi."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from agent.api.cdi_cli import cdi_cli
from agent.cdi_spec.inputs import CdiNaming
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter
from agent.gpu import nodefile
from agent.node.facts import NodeFacts
from agent.node.selection import InvalidParameter
from tests.support.cdi_node import place_spec

NODE = nodefile.load("h200x2-mig").info
GPU0, GPU1 = NODE.devices
CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm")
ASIDE = "in the directory engines read ours from"


def toolkit(*names: str) -> str:
    devices = [
        {"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names
    ]
    return json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices})


class Dirs:
    def __init__(self, tmp_path: Path) -> None:
        self.etc, self.run, self.volumes = (tmp_path / n for n in ("etc", "run", "volumes"))
        for directory in (self.etc, self.run):
            directory.mkdir()

    def volume(self, version: str) -> Path:
        path = self.volumes / version
        path.mkdir(parents=True, exist_ok=True)
        return path

    def writer(self, kind: str = "nvidia.com/gpu") -> CdiSpecWriter:
        settings = CdiSettings(
            self.run, kind=kind, scanned_dirs=(self.etc, self.run), watch_interval_s=0.02
        )
        return CdiSpecWriter(settings, self.volume)


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    return Dirs(tmp_path)


def facts() -> NodeFacts:
    return NodeFacts(NODE, CONTROL)


async def eventually(condition: object, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not (callable(condition) and condition()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        await asyncio.sleep(0.02)


async def test_beside_a_toolkit_spec_in_its_directory_it_writes_none(
    dirs: Dirs, caplog: pytest.LogCaptureFixture
) -> None:
    place_spec(dirs.run / "nvidia.yaml", toolkit("0", "1", str(GPU1.uuid), "all"))
    writer = dirs.writer()
    assert await writer.write(facts())
    assert not writer.path.exists()
    assert writer.current is None
    assert writer.aside is not None
    assert f"{dirs.run / 'nvidia.yaml'} defines nvidia.com/gpu devices" in writer.aside
    naming = writer.naming
    assert naming.names == frozenset({"0", "1", str(GPU1.uuid), "all"})
    assert naming.source == str(dirs.run / "nvidia.yaml")
    (warning,) = [r for r in caplog.records if ASIDE in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "(0, 1, all, ...)" in warning.getMessage()
    assert await writer.write(facts())  # again: nothing new is said
    assert len([r for r in caplog.records if ASIDE in r.getMessage()]) == 1


async def test_it_steps_aside_when_the_other_appears_and_comes_back_when_it_goes(
    dirs: Dirs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvidia-docker-plugin.cdi")
    writer = dirs.writer()
    writer.start(facts())
    try:
        await writer.settled()
        assert writer.path.exists()
        other = dirs.run / "nvidia.yaml"
        place_spec(other, toolkit("0", "all"))
        # the spec is removed (in a thread), then the writer says why: wait for both
        await eventually(
            lambda: not writer.path.exists() and writer.aside is not None, "stepping aside"
        )
        other.unlink()
        await eventually(writer.path.exists, "the spec back")
        await writer.settled()
        assert writer.aside is None
        assert writer.naming == CdiNaming()
        assert "no longer defines nvidia.com/gpu devices beside ours" in caplog.text
    finally:
        await writer.close()


async def test_a_link_to_ours_puts_ours_in_that_directory_too(dirs: Dirs, tmp_path: Path) -> None:
    """The packaged unit's way: the spec in a state directory, a link in /run/cdi."""
    state = tmp_path / "state"
    state.mkdir()
    (dirs.run / "nvidia-docker.json").symlink_to(state / "nvidia-docker.json")
    place_spec(dirs.run / "nvidia.yaml", toolkit("all"))
    settings = CdiSettings(state, scanned_dirs=(dirs.etc, dirs.run))
    writer = CdiSpecWriter(settings, dirs.volume)
    assert await writer.write(facts())
    assert writer.aside is not None
    assert not (state / "nvidia-docker.json").exists()


async def test_a_spec_elsewhere_is_warned_about_once_and_ours_stays(
    dirs: Dirs, caplog: pytest.LogCaptureFixture
) -> None:
    place_spec(dirs.etc / "nvidia.yaml", toolkit("0", "all"))
    writer = dirs.writer()
    assert await writer.write(facts())
    assert await writer.write(facts())
    assert writer.path.exists()
    assert writer.aside is None
    (line,) = [r.getMessage() for r in caplog.records if "also defines" in r.getMessage()]
    assert f"CDI spec {dirs.etc / 'nvidia.yaml'} also defines nvidia.com/gpu devices" in line
    assert f"ours ({dirs.run} comes after {dirs.etc} in Podman's and Docker's order)" in line


async def test_a_spec_without_our_names_or_of_another_kind_is_left_alone(
    dirs: Dirs, caplog: pytest.LogCaptureFixture
) -> None:
    place_spec(dirs.run / "other.json", toolkit("gpu-extra"))
    writer = dirs.writer(kind="nvidia-docker.com/gpu")
    place_spec(dirs.run / "nvidia.yaml", toolkit("0", "all"))
    assert await writer.write(facts())
    assert json.loads(writer.path.read_text())["kind"] == "nvidia-docker.com/gpu"
    assert writer.aside is None
    assert writer.naming == CdiNaming("nvidia-docker.com/gpu")
    assert "also defines" not in caplog.text


def test_the_cdi_form_names_devices_of_the_spec_in_force() -> None:
    node = facts()
    targets = node.usable("0:1,1")
    assert cdi_cli(targets).devices == (
        f"nvidia.com/gpu={GPU0.mig_devices[1].uuid}",
        f"nvidia.com/gpu={GPU1.uuid}",
    )
    kind = CdiNaming("nvidia-docker.com/gpu")
    assert cdi_cli(node.usable("1"), kind).text() == f"--device=nvidia-docker.com/gpu={GPU1.uuid}\n"
    by_index = CdiNaming(names=frozenset({"0", "1", "all"}), source="/run/cdi/nvidia.yaml")
    assert cdi_cli(node.usable("1"), by_index).devices == ("nvidia.com/gpu=1",)
    with pytest.raises(InvalidParameter, match=r"nvidia\.yaml, has no device for it"):
        cdi_cli(targets, by_index)
    assert node.docker_cli_cdi("1", None, False, by_index) == b"--device=nvidia.com/gpu=1\n"
    assert (
        node.docker_cli_cdi("1", None, False) == f"--device=nvidia.com/gpu={GPU1.uuid}\n".encode()
    )
