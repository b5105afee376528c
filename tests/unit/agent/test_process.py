"""sd_notify without a library: one datagram to $NOTIFY_SOCKET, a path or an abstract name."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import process
from agent.process import notify


@pytest.fixture
def receiver() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    yield sock
    sock.close()


def test_ready_reaches_a_socket_path(receiver: socket.socket, tmp_path: Path) -> None:
    path = tmp_path / "notify"
    receiver.bind(str(path))
    assert notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": str(path)})
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"


def test_ready_reaches_an_abstract_socket(receiver: socket.socket) -> None:
    name = f"nvd-test-{secrets.token_hex(4)}"
    receiver.bind("\0" + name)
    assert notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
    assert receiver.recv(4096) == b"READY=1"


def test_without_systemd_nothing_is_sent() -> None:
    assert notify("READY=1", {}) is False


def test_a_socket_that_cannot_be_reached_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "_failed_logged", set())
    env = {"NOTIFY_SOCKET": str(tmp_path / "nobody")}
    assert notify("READY=1", env) is False
    assert notify("STOPPING=1", env) is False
    warnings = [r.getMessage() for r in caplog.records if "Cannot tell systemd" in r.getMessage()]
    assert len(warnings) == 1
    assert notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False
