"""Tokens, TLS files and the exposure warning of the REST API, on the real aiohttp app."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.config import Config, ListenAddress
from agent.edge.access import RemoteAccess
from agent.edge.loopback import is_loopback
from agent.edge.tls import ServerTls, TlsConfigError, TlsFiles
from agent.edge.tokens import TokenFileError, TokenStore, read_tokens, require_token
from agent.errors import StartupError
from tests.support.certs import Pki, make_pki
from tests.support.services import serve_on_loopback

GOOD = "t" * 24
NEXT = "n" * 24


def _config(tmp_path: Path, **fields: object) -> Config:
    return Config(
        listen=ListenAddress("127.0.0.1", 3476),
        volume_dir=tmp_path / "v",
        socket_dir=tmp_path / "s",
        simulate="h200",
        ldcache=tmp_path / "ld.so.cache",
        **fields,  # type: ignore[arg-type]
    )


# --- token file ------------------------------------------------------------------------------


def test_token_file_one_per_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# rotation in progress\n\n  {GOOD}  \n{NEXT}\n")
    assert read_tokens(path) == (GOOD.encode(), NEXT.encode())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no token in it"),
        ("# only a comment\n", "no token in it"),
        ("short\n", "line 1: the token is shorter than 16 characters"),
        (f"{GOOD}\ntwo words here-xxxxxxxxxx\n", "line 2: a token is one word"),
        (f"{GOOD}\nt\u00e9" + "x" * 20 + "\n", "line 2: a token is one word of printable ASCII"),
    ],
)
def test_bad_token_files_say_which_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(TokenFileError, match=message):
        read_tokens(path)


def test_missing_token_file(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read it: No such file or directory"):
        read_tokens(tmp_path / "none")


def test_a_token_file_every_user_can_read_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n")
    path.chmod(0o644)
    TokenStore(path)
    assert "is readable by every user (mode 0644): chmod 0600 or 0640" in caplog.text
    caplog.clear()
    path.chmod(0o640)
    TokenStore(path)
    assert caplog.text == ""


def test_every_token_is_accepted_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n{NEXT}\n")
    store = TokenStore(path)
    assert store.accepts(GOOD.encode())
    assert store.accepts(NEXT.encode())
    for wrong in (b"", GOOD[:-1].encode(), (GOOD + "x").encode(), GOOD.upper().encode()):
        assert not store.accepts(wrong)


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[int, TokenStore]]:
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n")
    store = TokenStore(path)

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="the node's secrets")

    app = web.Application()
    app.router.add_get("/gpu/info", require_token(store)(hello))
    async with serve_on_loopback(app) as port:
        yield port, store


async def _get(port: int, headers: dict[str, str]) -> tuple[int, str, str | None]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/gpu/info", headers=headers) as response,
    ):
        return response.status, await response.text(), response.headers.get("WWW-Authenticate")


async def test_middleware_answers_401_with_what_was_wrong(
    guarded: tuple[int, TokenStore], caplog: pytest.LogCaptureFixture
) -> None:
    port, _ = guarded
    assert await _get(port, {"Authorization": f"Bearer {GOOD}"}) == (
        200,
        "the node's secrets",
        None,
    )
    assert await _get(port, {"Authorization": f"bearer   {GOOD} "}) == (
        200,
        "the node's secrets",
        None,
    )
    status, text, challenge = await _get(port, {})
    assert (status, challenge) == (401, 'Bearer realm="nvidia-docker-plugin"')
    assert text.startswith("this agent needs a bearer token")
    status, text, _ = await _get(port, {"Authorization": "Bearer " + "w" * 24})
    assert (status, text) == (401, "token refused: it is not one of this agent's tokens\n")
    status, _, _ = await _get(port, {"Authorization": f"Basic {GOOD}"})
    assert status == 401
    # three refusals, one log line (rate limited)
    refusals = [r for r in caplog.records if "Refused" in r.getMessage()]
    assert len(refusals) == 1


async def test_reload_swaps_the_tokens(guarded: tuple[int, TokenStore]) -> None:
    port, store = guarded
    store.path.write_text(f"{GOOD}\n{NEXT}\n")
    await store.reload()
    assert (await _get(port, {"Authorization": f"Bearer {NEXT}"}))[0] == 200
    store.path.write_text(f"{NEXT}\n")
    await store.reload()
    assert (await _get(port, {"Authorization": f"Bearer {GOOD}"}))[0] == 401
    store.path.write_text("")
    with pytest.raises(TokenFileError):
        await store.reload()
    assert (await _get(port, {"Authorization": f"Bearer {NEXT}"}))[0] == 200  # kept


async def test_plain_loopback_without_tls_needs_no_token(tmp_path: Path) -> None:
    """Tokens without TLS, --plain-loopback: a connection to 127.0.0.1 needs none."""
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n")

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="the node's GPUs")

    app = web.Application()
    app.router.add_get("/gpu/info", require_token(TokenStore(path), plain_loopback=True)(hello))
    async with serve_on_loopback(app) as port:
        assert await _get(port, {}) == (200, "the node's GPUs", None)
        assert (await _get(port, {"Authorization": "Bearer " + "w" * 24}))[0] == 200


# --- TLS files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_context_with_client_ca_requires_certificates(pki: Pki) -> None:
    context = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"), pki.pem("ca"))).current
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    plain = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"))).current
    assert plain.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (("server", "client", None), "key values mismatch"),
        (("missing", "server", None), "--tls-cert .*missing.pem: cannot read the certificate"),
        (("server", "server", "missing"), "--tls-client-ca .*missing.pem: cannot read"),
        (("ca-as-key", "server", None), "--tls-cert"),
    ],
)
def test_unusable_tls_files_say_which(
    pki: Pki, tmp_path: Path, files: tuple[str, str, str | None], message: str
) -> None:
    (tmp_path / "ca-as-key.pem").write_text("not PEM at all\n")

    def pem(name: str) -> Path:
        return tmp_path / f"{name}.pem" if name in ("missing", "ca-as-key") else pki.pem(name)

    cert, key, ca = files
    with pytest.raises(TlsConfigError, match=message):
        ServerTls(TlsFiles(pem(cert), pki.key(key), pem(ca) if ca is not None else None))


async def test_reload_keeps_the_previous_context_when_the_new_files_are_broken(
    pki: Pki, tmp_path: Path
) -> None:
    cert = tmp_path / "server.pem"
    cert.write_bytes(pki.pem("server").read_bytes())
    tls = ServerTls(TlsFiles(cert, pki.key("server")))
    before = tls.current
    cert.write_text("garbage\n")
    with pytest.raises(TlsConfigError):
        await tls.reload()
    assert tls.current is before
    cert.write_bytes(pki.pem("server").read_bytes())
    await tls.reload()  # the same bytes as served: the same context, sessions resume
    assert tls.current is before
    cert.write_bytes(pki.pem("server").read_bytes() + b"\n")  # a byte more: a new context
    await tls.reload()
    assert tls.current is not before
    assert tls.listening is before  # what the sites hold never changes


def test_from_config_errors_are_startup_errors(pki: Pki, tmp_path: Path) -> None:
    config = _config(tmp_path, tls_cert=pki.pem("server"), tls_key=pki.key("client"))
    with pytest.raises(StartupError, match="key values mismatch"):
        RemoteAccess.from_config(config)
    access = RemoteAccess.from_config(_config(tmp_path))
    assert (access.ssl_context, access.wrappers, access.reloaders()) == (None, [], [])
    assert access.describe() == "plain HTTP"


# --- the warning -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("fe80::1%eth0", False),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), (None, False),
     ("::ffff:127.0.0.1", True), ("::ffff:10.0.0.5", False), ("localhost", False)],
)  # fmt: skip
def test_is_loopback(address: str | None, loopback: bool) -> None:
    assert is_loopback(address) is loopback


@pytest.mark.parametrize(
    ("tls", "client_ca", "token", "warning"),
    [
        (False, False, False, "without TLS or a token: anyone who can reach it"),
        (False, False, True, "the token crosses the network in clear text"),
        (True, False, False, "with TLS but no client authentication"),
        (True, True, False, None),
        (True, False, True, None),
    ],
)
def test_a_listener_beyond_loopback_warns_until_it_is_safe(
    pki: Pki,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    tls: bool,
    client_ca: bool,
    token: bool,
    warning: str | None,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(GOOD + "\n")
    tokens.chmod(0o600)
    config = _config(
        tmp_path,
        tls_cert=pki.pem("server") if tls else None,
        tls_key=pki.key("server") if tls else None,
        tls_client_ca=pki.pem("ca") if client_ca else None,
        token_file=tokens if token else None,
    )
    access = RemoteAccess.from_config(config)
    with caplog.at_level(logging.WARNING):
        access.warn_if_exposed(["127.0.0.1", "::1"], 3476)
        assert not caplog.records  # loopback only: never a warning
        access.warn_if_exposed([None], 3476)
    messages = [r.getMessage() for r in caplog.records]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1
        assert messages[0].startswith("Warning: the REST API listens on *:3476 ")
        assert warning in messages[0]
        assert "docs/remote-access.md" in messages[0]
