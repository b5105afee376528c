"""Bearer tokens on the REST API (``--token-file``): who may ask, checked before every route.

The token file holds one token per line (``#`` comments and blank lines are skipped), so a
token can be rotated with two valid at once: add the new one, SIGHUP, move the clients, remove
the old one, SIGHUP. Clients send ``Authorization: Bearer <token>``; anything else is
answered ``401`` with ``WWW-Authenticate: Bearer`` and one line saying what was wrong (no
token, or a token that is not in the file), and nothing of the node.

Bounds: the file is read through ``agent.files.read_regular``, at most ``TOKEN_FILE_LIMIT``
bytes; it holds at most ``MAX_TOKENS`` tokens of ``MIN_TOKEN_CHARS`` to ``MAX_TOKEN_CHARS``
printable ASCII characters each. A file beyond them is refused with one line (at start the
start fails; at reload the previous tokens stay). The file is read again on SIGHUP in a
worker thread, so the event loop keeps serving.

What is kept is the SHA-256 digest of each token, in a set, not the tokens: a presented
token is hashed once and looked up, so a wrong token costs what a missing one does (one
hash), whatever the number of tokens, and the answer's timing says nothing usable about the
tokens (it depends on the digest of what was presented, which nobody can steer towards a
valid token's digest).

With ``--plain-loopback`` (the default), plain connections made on the node to a loopback
address need no token (``agent.edge.loopback``); TLS connections always do.

Refusals are logged at most once per ``REFUSAL_LOG_INTERVAL_S`` with their count, so that a
scanner cannot fill the journal.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiohttp import web

from agent.edge.loopback import is_plain_loopback
from agent.files import UnusableFile, read_regular

log = logging.getLogger("nvidia-docker-plugin")

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
MAX_TOKENS = 4096
TOKEN_FILE_LIMIT = 1 << 20  # 1 MiB
REFUSAL_LOG_INTERVAL_S = 10.0
REALM = 'Bearer realm="nvidia-docker-plugin"'
_SCHEME = "bearer "
_MAKE_ONE = "make one with: openssl rand -hex 32"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Wrapper = Callable[[Handler], Handler]


class TokenFileError(Exception):
    """The token file cannot be used; the message names the file (and line) and what to do."""


def _read_bounded(path: Path) -> bytes:
    try:
        return read_regular(path, limit=TOKEN_FILE_LIMIT, what="--token-file")
    except UnusableFile as err:
        try:
            size = path.stat().st_size
        except OSError as missing:  # the plainest words for a file that is not there
            raise TokenFileError(
                f"--token-file {path}: cannot read it: {missing.strerror}"
            ) from None
        if size > TOKEN_FILE_LIMIT:
            raise TokenFileError(
                f"{err}: a token file holds at most {MAX_TOKENS} tokens, one per line"
            ) from None
        raise TokenFileError(f"{err}: give a readable file of tokens, one per line") from None


def read_tokens(path: Path) -> tuple[bytes, ...]:
    """The tokens of ``path``, one per line, within the bounds of the module docstring;
    raises ``TokenFileError``."""
    try:
        text = _read_bounded(path).decode("utf-8")
    except UnicodeDecodeError:
        raise TokenFileError(f"--token-file {path}: not UTF-8 text") from None
    tokens: list[bytes] = []
    for number, line in enumerate(text.splitlines(), start=1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if any(ch.isspace() for ch in token) or not token.isascii() or not token.isprintable():
            raise TokenFileError(
                f"--token-file {path}, line {number}: a token is one word of printable ASCII"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenFileError(
                f"--token-file {path}, line {number}: the token is shorter than "
                f"{MIN_TOKEN_CHARS} characters; {_MAKE_ONE}"
            )
        if len(token) > MAX_TOKEN_CHARS:
            raise TokenFileError(
                f"--token-file {path}, line {number}: the token is {len(token)} characters, "
                f"more than the {MAX_TOKEN_CHARS} a token may be; {_MAKE_ONE}"
            )
        if len(tokens) == MAX_TOKENS:
            raise TokenFileError(
                f"--token-file {path}, line {number}: more than {MAX_TOKENS} tokens, the most "
                "the agent takes: retire the ones no client uses"
            )
        tokens.append(token.encode("ascii"))
    if not tokens:
        raise TokenFileError(f"--token-file {path}: no token in it (one per line; {_MAKE_ONE})")
    return tuple(tokens)


def token_digests(tokens: Iterable[bytes]) -> frozenset[bytes]:
    """The SHA-256 digests of ``tokens``: what ``TokenStore`` keeps and looks up."""
    return frozenset(hashlib.sha256(token).digest() for token in tokens)


def _others_read_warning(path: Path) -> str | None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if not mode & stat.S_IROTH:
        return None
    return (
        f"Warning: the token file {path} is readable by every user "
        f"(mode {stat.S_IMODE(mode):04o}): chmod 0600 or 0640"
    )


def _load(path: Path) -> tuple[frozenset[bytes], str | None]:
    """The digests of the tokens of ``path``, and the warning about its mode if any."""
    return token_digests(read_tokens(path)), _others_read_warning(path)


class TokenStore:
    """The valid tokens (their digests), read from the file at start and again on
    ``reload()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._digests, warning = _load(path)
        if warning is not None:
            log.warning("%s", warning)

    @property
    def count(self) -> int:
        """How many different tokens are valid."""
        return len(self._digests)

    def accepts(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the tokens: one hash and one set lookup (anything
        longer than a token may be is refused unhashed)."""
        if len(presented) > MAX_TOKEN_CHARS:
            return False
        return hashlib.sha256(presented).digest() in self._digests

    async def reload(self) -> None:
        """Read the file again (in a thread); raises ``TokenFileError`` (the previous tokens
        stay valid)."""
        digests, warning = await asyncio.to_thread(_load, self.path)
        if warning is not None:
            log.warning("%s", warning)
        self._digests = digests
        log.info("Reload: %d token(s) read again from %s", len(digests), self.path)


class _RefusalLog:
    """One log line per interval at most: how many requests were refused, the last peer."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._count = 0
        self._logged_at = -interval_s

    def refused(self, peer: str | None, why: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._logged_at >= self.interval_s:
            log.warning(
                "Refused %d request(s) without a valid token (last: %s from %s)",
                self._count,
                why,
                peer or "unknown peer",
            )
            self._count = 0
            self._logged_at = now


def _unauthorized(text: str) -> web.Response:
    return web.Response(
        status=401,
        text=text + "\n",
        content_type="text/plain",
        headers={"WWW-Authenticate": REALM},
    )


READINESS_HEADER = "X-Readiness-Check"


def require_token(
    store: TokenStore, *, plain_loopback: bool = False, unlogged: str | None = None
) -> Wrapper:
    """A wrapper of a route's handler that answers 401 unless the request carries a valid
    token; with ``plain_loopback``, plain connections to a loopback address need none. A
    refusal of a request whose ``X-Readiness-Check`` header is ``unlogged`` (the agent
    asking itself at start) is not logged; it is refused all the same."""
    refusals = _RefusalLog()

    def wrap(handler: Handler) -> Handler:
        async def checked(request: web.Request) -> web.StreamResponse:
            if plain_loopback and is_plain_loopback(request.transport):
                return await handler(request)
            header = request.headers.get("Authorization", "")
            if header[: len(_SCHEME)].lower() != _SCHEME:
                if unlogged is None or request.headers.get(READINESS_HEADER) != unlogged:
                    refusals.refused(request.remote, "no bearer token")
                return _unauthorized(
                    "this agent needs a bearer token (Authorization: Bearer <token>); "
                    "clients: --token-file FILE or NV_TOKEN_FILE"
                )
            presented = header[len(_SCHEME) :].strip().encode("utf-8", "replace")
            if not store.accepts(presented):
                refusals.refused(request.remote, "token refused")
                return _unauthorized("token refused: it is not one of this agent's tokens")
            return await handler(request)

        return checked

    return wrap
