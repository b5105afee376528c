"""Which form a GPU create gets: CDI names only where the engine reads the spec in force."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.cdi_spec.inputs import OWN_NAMING, CdiNaming
from agent.engine_socket.cdi_form import KEEP_S, CdiForm, reads_from, spec_dirs
from agent.engines.facts import EngineFacts
from agent.engines.http import EngineClient, EngineError


class Spec:
    def __init__(self, *dirs: Path) -> None:
        self.dirs_in_force = frozenset(dirs)
        self.naming: CdiNaming = OWN_NAMING


class Engine(EngineClient):
    """An engine whose /info answer the test sets (None: it cannot be asked)."""

    def __init__(self, info: object) -> None:
        super().__init__(Path("/nonexistent.sock"))
        self.info = info
        self.asked = 0

    async def get(self, path: str, about: str, **_: object) -> bytearray | None:
        assert path == "/info"
        self.asked += 1
        if self.info is None:
            raise EngineError("the Docker engine at unix:///nonexistent.sock is down")
        return bytearray(json.dumps(self.info).encode())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("info", "dirs"),
    [
        ({"CDISpecDirs": ["/etc/cdi", "/var/run/cdi"]}, ("/etc/cdi", "/var/run/cdi")),
        ({"CDISpecDirs": []}, ()),  # Docker 25-27 with CDI off
        ({"ServerVersion": "20.10.24"}, ()),  # before 25: no such field
        ({"CDISpecDirs": "/etc/cdi"}, ()),
        ({"CDISpecDirs": [7, "", "/etc/cdi"]}, ("/etc/cdi",)),
        ([], ()),
    ],
)
def test_the_engines_spec_dirs(info: object, dirs: tuple[str, ...]) -> None:
    assert spec_dirs(info) == dirs


def test_directories_compare_resolved(tmp_path: Path) -> None:
    real = tmp_path / "cdi"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert reads_from([str(tmp_path / "link")], [real])
    assert not reads_from([str(tmp_path)], [real])
    assert not reads_from([str(real)], [])


async def test_the_cdi_form_only_where_the_engine_reads_the_spec(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "nvidia-docker-plugin.engine-socket")
    ours = tmp_path / "cdi"
    engine, clock, spec = Engine({"CDISpecDirs": [str(ours)]}), Clock(), Spec(ours)
    form = CdiForm(engine, spec, clock=clock)
    assert await form.naming() is OWN_NAMING
    assert "GPU creates get CDI devices" in caplog.text
    spec.dirs_in_force = frozenset()  # the spec is not written (yet): the names would not resolve
    assert await form.naming() is None
    assert "this agent's CDI spec is not written" in caplog.text
    assert engine.asked == 1  # kept KEEP_S seconds


async def test_an_engine_that_reads_elsewhere_or_cannot_be_asked_gets_device_nodes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "nvidia-docker-plugin.engine-socket")
    engine, clock = Engine({"CDISpecDirs": ["/etc/cdi"]}), Clock()
    form = CdiForm(engine, Spec(tmp_path), clock=clock)
    assert await form.naming() is None
    assert f"reads specs from /etc/cdi, not from {tmp_path}" in caplog.text
    engine.info = None
    clock.now += KEEP_S
    assert await form.naming() is None
    engine.info = {"CDISpecDirs": [str(tmp_path)]}  # CDI turned on, the engine restarted
    clock.now += KEEP_S
    assert await form.naming() is OWN_NAMING
    assert engine.asked == 3


async def test_while_the_agent_follows_the_engine_its_word_is_taken(tmp_path: Path) -> None:
    """The dirs the events follower read (at the stream's start and each ``daemon reload``)
    decide, at once and without a question to the engine; when it stops following, the
    engine is asked again (not an answer kept from before)."""
    engine, clock = Engine({"CDISpecDirs": ["/etc/cdi"]}), Clock()
    known: list[EngineFacts | None] = [EngineFacts("26.1.5", (str(tmp_path),), 1.0)]
    form = CdiForm(engine, Spec(tmp_path), facts=lambda: known[0], clock=clock)
    assert await form.naming() is OWN_NAMING
    known[0] = EngineFacts("26.1.5", (), 2.0)  # CDI turned off, dockerd reloaded
    assert await form.naming() is None
    assert engine.asked == 0
    known[0] = None  # the engine's events stopped: it is asked itself
    assert await form.naming() is None  # it reads /etc/cdi, not ours
    assert engine.asked == 1
