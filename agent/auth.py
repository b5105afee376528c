"""Bearer tokens on the REST API (``--token-file``): who may ask, checked before every route.

The token file holds one token per line (``#`` comments and blank lines are skipped), so a
token can be rotated with two valid at once: add the new one, SIGHUP, move the clients, remove
the old one, SIGHUP. Clients send ``Authorization: Bearer <token>``; anything else is
answered ``401`` with ``WWW-Authenticate: Bearer`` and one line saying what was wrong (no
token, or a token that is not in the file), and nothing of the node. Every presented token is
compared with every valid one in constant time (``hmac.compare_digest``), so the answer's
timing says nothing about how much of a token was right.

With ``--plain-loopback`` (the default), plain connections made on the node to a loopback
address need no token (``agent.loopback``); TLS connections always do.

Refusals are logged at most once per ``REFUSAL_LOG_INTERVAL_S`` with their count, so that a
scanner cannot fill the journal.
"""

from __future__ import annotations

import hmac
import logging
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from agent.loopback import is_plain_loopback

log = logging.getLogger("nvidia-docker-plugin")

MIN_TOKEN_CHARS = 16
REFUSAL_LOG_INTERVAL_S = 10.0
REALM = 'Bearer realm="nvidia-docker-plugin"'
_SCHEME = "bearer "


class TokenFileError(Exception):
    """The token file cannot be used; the message names the file (and line) and what to do."""


def read_tokens(path: Path) -> tuple[bytes, ...]:
    """The tokens of ``path``, one per line; raises ``TokenFileError``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TokenFileError(f"--token-file {path}: cannot read it: {err.strerror}") from None
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
                f"{MIN_TOKEN_CHARS} characters; make one with: openssl rand -hex 32"
            )
        tokens.append(token.encode("ascii"))
    if not tokens:
        raise TokenFileError(
            f"--token-file {path}: no token in it (one per line; openssl rand -hex 32 makes one)"
        )
    return tuple(tokens)


class TokenStore:
    """The valid tokens, read from the file at start and again on ``reload()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokens = read_tokens(path)
        self._warn_if_others_read()

    @property
    def count(self) -> int:
        return len(self._tokens)

    def accepts(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the tokens (every one compared, constant time)."""
        found = False
        for token in self._tokens:
            found |= hmac.compare_digest(presented, token)
        return found

    async def reload(self) -> None:
        """Read the file again; raises ``TokenFileError`` (the previous tokens stay valid)."""
        self._tokens = read_tokens(self.path)
        self._warn_if_others_read()
        log.info("Reload: %d token(s) read again from %s", len(self._tokens), self.path)

    def _warn_if_others_read(self) -> None:
        try:
            mode = self.path.stat().st_mode
        except OSError:
            return
        if mode & stat.S_IROTH:
            log.warning(
                "Warning: the token file %s is readable by every user (mode %04o): "
                "chmod 0600 or 0640",
                self.path,
                stat.S_IMODE(mode),
            )


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


def token_middleware(store: TokenStore, *, plain_loopback: bool = False) -> Middleware:
    """An aiohttp middleware that answers 401 unless the request carries a valid token;
    with ``plain_loopback``, plain connections to a loopback address need none."""
    refusals = _RefusalLog()

    @web.middleware
    async def require_token(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if plain_loopback and is_plain_loopback(request.transport):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if header[: len(_SCHEME)].lower() != _SCHEME:
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

    return require_token
