"""The REST API's TLS files (``agent.edge.tls``): read once within bounds, loaded from what was
read, never a passphrase prompt, reloads in a thread, a new context (and no resumption of older
sessions) when the files change, expiry warnings and the expiry metric."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import ssl
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web

from agent.config import Config, ListenAddress
from agent.edge.access import RemoteAccess
from agent.edge.listen import listen
from agent.edge.tls import TLS_FILE_LIMIT, ServerTls, TlsConfigError, TlsFiles
from agent.edge.tls_or_plain import ReloadableContext, TlsOrPlainServer, bind
from agent.files import read_regular
from agent.metrics.agent_metrics import AgentMetrics
from tests.support.certs import Pki, dated_server, encrypt_key, make_pki, not_after

REQUEST = b"GET /gpu/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _own_files(pki: Pki, root: Path, *, client_ca: str | None = None) -> TlsFiles:
    """Copies of the server's files (and of a CA as the client CA), for a test to change."""
    cert, key = root / "server.pem", root / "server.key"
    shutil.copyfile(pki.pem("server"), cert)
    shutil.copyfile(pki.key("server"), key)
    key.chmod(0o600)
    ca = None
    if client_ca is not None:
        ca = root / "client-ca.pem"
        shutil.copyfile(pki.pem(client_ca), ca)
    return TlsFiles(cert, key, ca)


# --- reading and loading -----------------------------------------------------------------


def test_an_encrypted_key_is_refused_without_a_prompt(pki: Pki, tmp_path: Path) -> None:
    key = encrypt_key(pki.key("server"), tmp_path / "encrypted.key", "secret passphrase")
    with pytest.raises(TlsConfigError) as refused:
        ServerTls(TlsFiles(pki.pem("server"), key))
    message = str(refused.value)
    assert message.startswith(f"--tls-key {key}: the private key is encrypted")
    assert "never asks for a passphrase" in message
    assert "\n" not in message


@pytest.mark.parametrize("which", ["cert", "key", "client_ca"])
def test_files_beyond_the_bound_are_refused_with_one_line(
    pki: Pki, tmp_path: Path, which: str
) -> None:
    files = _own_files(pki, tmp_path, client_ca="ca")
    path: Path = getattr(files, which)
    with path.open("ab") as grow:
        grow.write(b"#" * TLS_FILE_LIMIT)
    option = {"cert": "--tls-cert", "key": "--tls-key", "client_ca": "--tls-client-ca"}[which]
    with pytest.raises(TlsConfigError) as refused:
        ServerTls(files)
    message = str(refused.value)
    assert message.startswith(f"{option} {path} is 1.0 MiB, more than the 1.0 MiB it may be")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("cert", "key", "message"),
    [
        ("server.pem", "server.pem", "--tls-key {key}: no PEM private key in it"),
        ("server.key", "server.key", "--tls-cert {cert}: no PEM certificate in it"),
        ("server.key", "server.pem", "--tls-cert {cert}: no PEM certificate in it"),
    ],
)
def test_a_file_without_its_pem_block_is_named(
    pki: Pki, tmp_path: Path, cert: str, key: str, message: str
) -> None:
    """The certificate given as the key (or the other way round): the line names the file
    (OpenSSL says only "PEM lib")."""
    given = {"server.pem": pki.pem("server"), "server.key": pki.key("server")}
    files = TlsFiles(given[cert], given[key])
    with pytest.raises(TlsConfigError) as refused:
        ServerTls(files)
    assert str(refused.value).startswith(message.format(cert=files.cert, key=files.key))


def test_a_fifo_is_refused_at_once(pki: Pki, tmp_path: Path) -> None:
    files = _own_files(pki, tmp_path)
    files.cert.unlink()
    os.mkfifo(files.cert)  # no writer: an open that blocked would hang the test
    with pytest.raises(TlsConfigError, match=r"--tls-cert .*: the certificate is not a file"):
        ServerTls(files)


def test_what_was_read_is_what_is_loaded(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files on disk are garbage; the bounded reads return the good bytes: the context
    is built from those (memory files and cadata), never from the paths again."""
    files = _own_files(pki, tmp_path, client_ca="ca")
    good = {
        files.cert: pki.pem("server").read_bytes(),
        files.key: pki.key("server").read_bytes(),
        files.client_ca: pki.pem("ca").read_bytes(),
    }
    reads: list[Path] = []

    def checked_read(path: Path, *, limit: int, what: str, follow: bool = True) -> bytes:
        read_regular(path, limit=limit, what=what, follow=follow)
        reads.append(path)
        return good[path]

    for path in good:
        assert path is not None
        path.write_text("swapped after the check\n")
    monkeypatch.setattr("agent.edge.tls.read_regular", checked_read)
    context = ServerTls(files).current
    assert reads == [files.cert, files.key, files.client_ca]
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert len(context.get_ca_certs()) == 1


def test_a_client_ca_bundle_with_text_between_its_certificates(pki: Pki, tmp_path: Path) -> None:
    """Comments in another language than ASCII (as some bundles have) do not stop it."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(
        "# Fő CA\n".encode()
        + pki.pem("ca").read_bytes()
        + b"\nsubject=other\n"
        + pki.pem("other-ca").read_bytes()
    )
    context = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"), bundle)).current
    assert len(context.get_ca_certs()) == 2
    empty = tmp_path / "empty.pem"
    empty.write_text("no certificate here\n")
    with pytest.raises(TlsConfigError, match=r"--tls-client-ca .*empty.pem: no PEM certificate"):
        ServerTls(TlsFiles(pki.pem("server"), pki.key("server"), empty))


# --- reloads -----------------------------------------------------------------------------


async def test_reload_reads_in_a_thread_and_builds_only_for_new_bytes(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _own_files(pki, tmp_path, client_ca="ca")
    tls = ServerTls(files)
    first = tls.current
    assert first is tls.listening

    threads: list[int] = []
    real_read = read_regular

    def recording_read(path: Path, *, limit: int, what: str, follow: bool = True) -> bytes:
        threads.append(threading.get_ident())
        return real_read(path, limit=limit, what=what, follow=follow)

    monkeypatch.setattr("agent.edge.tls.read_regular", recording_read)
    await tls.reload()  # the same bytes: the same context, sessions resume
    assert tls.current is first
    assert threads
    assert threading.get_ident() not in threads

    shutil.copyfile(pki.pem("other-ca"), files.client_ca or tmp_path)
    await tls.reload()
    second = tls.current
    assert second is not first
    assert tls.listening is first  # what the sites hold never changes
    assert isinstance(first, ReloadableContext)

    files.key.write_text("half a key\n")
    with pytest.raises(TlsConfigError, match=r"--tls-key .*: no PEM private key in it"):
        await tls.reload()
    assert tls.current is second  # the previous one stays


async def test_an_encrypted_key_at_reload_keeps_the_previous_context(
    pki: Pki, tmp_path: Path
) -> None:
    files = _own_files(pki, tmp_path)
    tls = ServerTls(files)
    before = tls.current
    encrypt_key(pki.key("server"), files.key, "secret passphrase")
    with pytest.raises(
        TlsConfigError, match=f"--tls-key {files.key}: the private key is encrypted"
    ):
        await tls.reload()
    assert tls.current is before


@pytest.fixture
async def tls_port(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[ServerTls, int]]:
    """A TlsOrPlainServer (TLS from "the network" only) with mutual TLS, behind aiohttp."""

    async def info(_request: web.Request) -> web.Response:
        return web.Response(text="the node's GPUs")

    app = web.Application()
    app.router.add_get("/gpu/info", info)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    assert runner.server is not None
    tls = ServerTls(_own_files(pki, tmp_path, client_ca="ca"))
    server = TlsOrPlainServer(
        runner.server,
        bind("127.0.0.1", 0),
        tls.listening,
        first_byte_timeout_s=10.0,
        plain_allowed=lambda _address: False,
    )
    server.start()
    try:
        yield tls, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await runner.cleanup()


def _client(pki: Pki, name: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.pem("ca")))
    context.load_cert_chain(str(pki.pem(name)), str(pki.key(name)))
    return context


def _request(
    port: int, context: ssl.SSLContext, session: ssl.SSLSession | None
) -> tuple[bool, bytes, ssl.SSLSession | None]:
    """One request on a new TLS 1.3 connection (resuming ``session`` if given): whether it
    was resumed, the answer, the session to resume next time."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
    ):
        tls.sendall(REQUEST)
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        return bool(tls.session_reused), answer, tls.session


async def test_a_changed_client_ca_or_certificate_ends_resumption(
    pki: Pki, tls_port: tuple[ServerTls, int]
) -> None:
    tls, port = tls_port
    client = _client(pki, "client")
    reused, answer, session = await asyncio.to_thread(_request, port, client, None)
    assert (reused, answer.split(b"\r\n")[0]) == (False, b"HTTP/1.1 200 OK")
    reused, answer, session = await asyncio.to_thread(_request, port, client, session)
    assert reused  # resumption works: the checks below can fail
    await tls.reload()  # the same files
    reused, answer, session = await asyncio.to_thread(_request, port, client, session)
    assert reused
    assert answer.endswith(b"the node's GPUs")

    # a new certificate (same CA): served at once, older sessions make a full handshake
    files = tls.files
    shutil.copyfile(pki.pem("node"), files.cert)
    shutil.copyfile(pki.key("node"), files.key)
    await tls.reload()
    reused, answer, session = await asyncio.to_thread(_request, port, client, session)
    assert (reused, answer.split(b"\r\n")[0]) == (False, b"HTTP/1.1 200 OK")
    reused, _, session = await asyncio.to_thread(_request, port, client, session)
    assert reused

    # a new client CA: the client of the old one cannot resume its way in
    assert files.client_ca is not None
    shutil.copyfile(pki.pem("other-ca"), files.client_ca)
    await tls.reload()
    with pytest.raises(ssl.SSLError, match=r"UNKNOWN_CA|unknown ca"):
        await asyncio.to_thread(_request, port, client, session)
    reused, answer, _ = await asyncio.to_thread(_request, port, _client(pki, "other-client"), None)
    assert answer.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"


# --- expiry ------------------------------------------------------------------------------


def _gauge(metrics: AgentMetrics, name: str) -> float:
    (line,) = [x for x in metrics.render().decode().splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


async def test_expiry_warnings_at_start_and_reload_and_the_metric(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    soon_cert, soon_key = dated_server(
        pki, "soon", now - timedelta(days=1), now + timedelta(days=10, hours=-1)
    )
    old_cert, old_key = dated_server(
        pki, "old", datetime(2019, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC)
    )
    files = _own_files(pki, tmp_path)
    shutil.copyfile(soon_cert, files.cert)
    shutil.copyfile(soon_key, files.key)
    with caplog.at_level(logging.WARNING):
        tls = ServerTls(files)
    expires = now + timedelta(days=10, hours=-1)
    day = expires.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert [r.getMessage() for r in caplog.records] == [
        f"Warning: --tls-cert {files.cert} expires on {day} (in 9 days): "
        "put a new one in its place and reload (SIGHUP)"
    ]
    assert tls.not_after == expires.timestamp() == not_after(soon_cert).timestamp()

    counters = AgentMetrics()
    access = RemoteAccess(tls=tls)
    counters.follow_certificate(access.certificate_expiry)
    gauge = "nvidia_docker_tls_certificate_expiry_timestamp_seconds"
    assert _gauge(counters, gauge) == expires.timestamp()

    caplog.clear()
    shutil.copyfile(old_cert, files.cert)
    shutil.copyfile(old_key, files.key)
    with caplog.at_level(logging.WARNING):
        await tls.reload()
    assert [r.getMessage() for r in caplog.records] == [
        f"Warning: --tls-cert {files.cert} expired on 2020-01-02 00:00:00 UTC: clients refuse "
        "it; put a valid one in its place and reload (SIGHUP)"
    ]
    assert _gauge(counters, gauge) == datetime(2020, 1, 2, tzinfo=UTC).timestamp()

    plain = AgentMetrics()
    plain.follow_certificate(RemoteAccess().certificate_expiry)  # no TLS: no series
    assert gauge not in plain.render().decode()


def test_a_client_ca_near_expiry_warns(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    near, _ = dated_server(pki, "near-ca", now - timedelta(days=1), now + timedelta(days=3))
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pki.pem("ca").read_bytes() + near.read_bytes())
    with caplog.at_level(logging.WARNING):
        ServerTls(TlsFiles(pki.pem("server"), pki.key("server"), bundle))
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"Warning: --tls-client-ca {bundle} expires on ")
    assert "(in 2 days)" in message


def _config(tmp_path: Path, **fields: object) -> Config:
    return Config(
        listen=ListenAddress("127.0.0.1", 3476),
        volume_dir=tmp_path / "v",
        socket_dir=tmp_path / "s",
        simulate="h200",
        ldcache=tmp_path / "ld.so.cache",
        **fields,  # type: ignore[arg-type]
    )


def test_remote_access_without_tls_has_no_expiry(tmp_path: Path) -> None:
    assert RemoteAccess.from_config(_config(tmp_path)).certificate_expiry() is None


async def test_tls_is_only_served_through_a_guard(pki: Pki) -> None:
    """A TCPSite would hold the first context for ever: reloads would never reach it."""
    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    try:
        context = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"))).listening
        with pytest.raises(ValueError, match="TLS is served through a ConnectionGuard"):
            await listen(runner, "127.0.0.1", 0, ssl_context=context)
    finally:
        await runner.cleanup()
