"""sd_notify without a library (one datagram to $NOTIFY_SOCKET, a path or an abstract name), and
the daemon's first import of aiohttp (no CA store for a client the daemon never is)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import process
from agent.process import notify
from tests.support.certs import make_pki


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


# What a fresh daemon process reports about its TLS trust after its entry module is imported:
# the number of CA certificates in aiohttp's default verifying client context, in a context
# made afterwards by ``ssl.create_default_context()``, and ``$SSL_CERT_FILE`` as it is then.
_TRUST_PROBE = """
import json, os, ssl, sys
import {entry}
import aiohttp.connector
print(json.dumps({{
    "aiohttp_client_cas": aiohttp.connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
    "later_context_cas": ssl.create_default_context().cert_store_stats()["x509_ca"],
    "SSL_CERT_FILE": os.environ.get("SSL_CERT_FILE"),
}}))
"""


def _trust_after_import(entry: str, cert_file: Path | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    env["SSL_CERT_DIR"] = "/nonexistent"  # only the file counts: OpenSSL reads a dir lazily
    if cert_file is not None:
        env["SSL_CERT_FILE"] = str(cert_file)
    done = subprocess.run(
        [sys.executable, "-c", _TRUST_PROBE.format(entry=entry)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def test_the_daemon_holds_no_ca_store_for_a_client_it_never_is(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    # aiohttp imported as any program imports it loads $SSL_CERT_FILE: the probe can see it
    plain = _trust_after_import("aiohttp", pki.pem("ca"))
    assert plain["aiohttp_client_cas"] == 1
    # the daemon's entry point imports it without: the memory of the system's CA file saved
    daemon = _trust_after_import("agent.daemon", pki.pem("ca"))
    assert daemon["aiohttp_client_cas"] == 0
    # and puts the variable back: later contexts and child processes trust what was given
    assert daemon["SSL_CERT_FILE"] == str(pki.pem("ca"))
    assert daemon["later_context_cas"] == 1


def test_the_daemon_leaves_an_unset_ssl_cert_file_unset() -> None:
    daemon = _trust_after_import("agent.daemon", None)
    assert daemon["aiohttp_client_cas"] == 0
    assert daemon["SSL_CERT_FILE"] is None
