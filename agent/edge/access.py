"""Who may use the REST API from afar: TLS, client certificates, bearer tokens, one warning.

``RemoteAccess.from_config(config)`` reads ``--tls-cert``/``--tls-key``/``--tls-client-ca``
(``agent.edge.tls``) and ``--token-file`` (``agent.edge.tokens``) at start, before anything
is served; a file that cannot be used stops the start with one line. The daemon then gives
its TCP sites ``ssl_context``, its routes' ``wrappers``, and its SIGHUP
``reloaders`` (certificates and tokens read again, each keeping the previous one when the
new file is broken), and
``/metrics`` the served certificate's expiry (``certificate_expiry``).

``warn_if_exposed(addresses)`` logs one warning per start when a listener is not on loopback
and lacks TLS or client authentication, naming what to add. Old deployments listening on
``0.0.0.0`` without either keep working; the warning says what anyone who can reach the port
gets (the node's GPUs, and ``docker run`` arguments). Loopback listeners may stay plain:
launch scripts on the node use ``curl localhost:3476`` and SSH tunnels end there.
The plugin's unix socket is not concerned (file permissions guard it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from agent.config import Config
from agent.edge.loopback import is_loopback, is_plain_loopback
from agent.edge.tls import ServerTls, TlsConfigError, TlsFiles
from agent.edge.tokens import TokenFileError, TokenStore, Wrapper, require_token
from agent.errors import StartupError

log = logging.getLogger("nvidia-docker-plugin")

DOCS = "docs/remote-access.md"


@dataclass(frozen=True, slots=True)
class RemoteAccess:
    """The REST API's TLS and tokens, as the options asked (both may be absent)."""

    tls: ServerTls | None = None
    tokens: TokenStore | None = None
    # Plain connections to a loopback address need neither (agent.edge.loopback).
    plain_loopback: bool = True
    # Sent by the agent's own readiness check (agent.edge.readiness): its 401 is no refusal
    # worth a log line. Random per start, and it opens nothing.
    readiness_mark: str = field(default_factory=lambda: secrets.token_hex(16))

    @classmethod
    def from_config(cls, config: Config) -> RemoteAccess:
        """Read the files the options name; raises ``StartupError`` (one line)."""
        tls = tokens = None
        try:
            if config.tls_cert is not None and config.tls_key is not None:
                tls = ServerTls(TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca))
            if config.token_file is not None:
                tokens = TokenStore(config.token_file)
        except (TlsConfigError, TokenFileError) as err:
            raise StartupError(str(err)) from None
        return cls(tls, tokens, config.plain_loopback)

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.listening

    def certificate_expiry(self) -> float | None:
        """When the served TLS certificate expires (Unix time); None without TLS, or when
        its date cannot be read."""
        return None if self.tls is None else self.tls.not_after

    def token_free(self, transport: asyncio.BaseTransport) -> bool:
        """Whether requests on this connection need no token (no tokens, or a plain
        connection to loopback where that is allowed)."""
        if self.tokens is None:
            return True
        return self.plain_loopback and is_plain_loopback(transport)

    @property
    def wrappers(self) -> list[Wrapper]:
        """What wraps every REST route: the token check, when there are tokens."""
        if self.tokens is None:
            return []
        return [
            require_token(
                self.tokens, plain_loopback=self.plain_loopback, unlogged=self.readiness_mark
            )
        ]

    @property
    def authenticated(self) -> bool:
        """Whether clients beyond loopback must prove who they are (a token or a client
        certificate): then they may change what the API lets change (leases)."""
        return self.tokens is not None or (self.tls is not None and self.tls.mutual)

    def describe(self) -> str:
        """``plain HTTP`` or ``TLS (...), bearer tokens``, for the start-up log line."""
        parts = ["plain HTTP" if self.tls is None else self.tls.describe()]
        if self.tokens is not None:
            parts.append(f"bearer tokens from {self.tokens.path} ({self.tokens.count})")
        if self.plain_loopback and (self.tls is not None or self.tokens is not None):
            parts.append("plain HTTP without a token on loopback")
        return ", ".join(parts)

    def reloaders(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """What SIGHUP re-reads: (name for the log, coroutine function)."""
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if self.tls is not None:
            steps.append(("TLS certificate", self.tls.reload))
        if self.tokens is not None:
            steps.append(("token file", self.tokens.reload))
        return steps

    def warn_if_exposed(self, addresses: Sequence[str | None], port: int) -> None:
        """One warning if a listener beyond loopback lacks TLS or client authentication."""
        exposed = [a for a in addresses if not is_loopback(a)]
        if not exposed:
            return
        where = ", ".join(
            f"[{a}]:{port}" if a and ":" in a else f"{a or '*'}:{port}" for a in exposed
        )
        authenticated = self.authenticated
        if self.tls is None and self.tokens is None:
            why = (
                "without TLS or a token: anyone who can reach it reads this node's GPUs and "
                "gets docker run arguments; add --tls-cert/--tls-key and --token-file "
                "(or --tls-client-ca), or listen on localhost and reach it over SSH"
            )
        elif self.tls is None:
            why = (
                "with a token but without TLS: the token crosses the network in clear text; "
                "add --tls-cert/--tls-key"
            )
        elif not authenticated:
            why = (
                "with TLS but no client authentication: anyone who can reach it may ask; "
                "add --token-file or --tls-client-ca"
            )
        else:
            return
        log.warning("Warning: the REST API listens on %s %s (see %s)", where, why, DOCS)
