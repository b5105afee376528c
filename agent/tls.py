"""TLS for the REST API: the server's certificate, and optionally mutual TLS (client certs).

``ServerTls(files)`` reads the certificate chain, its key and the client CA once at start
(any mistake is a ``TlsConfigError`` naming the file and what to do) and hands the TCP sites
one ``SSLContext`` (``listening``) that never changes. Every handshake then picks the context
built from the files as they were last read: ``reload()`` (SIGHUP) builds a new one and swaps
it in through the listening context's ``sni_callback``, which OpenSSL calls for every
ClientHello (with or without a server name). Connections already open keep the session they
negotiated, so a rotation drops no request in flight; a reload that fails (a half-copied key)
keeps the previous context.

Why the handshake failure is sent as an alert: asyncio closes a server connection whose
handshake failed without sending the TLS alert OpenSSL wrote (``sslproto`` aborts the
transport), so a client refused for its certificate would only see the connection close and
could not say why. ``_AlertingSSLObject`` (through the public ``SSLContext.sslobject_class``)
reports a refused client certificate (missing, or not from the client CA) as "want read":
asyncio then flushes what OpenSSL wrote (the alert)
and waits; the client, having read ``certificate required`` or ``unknown ca``, closes, and the
next call raises the stored error, which ends the connection. A client that never closes is
cut off by asyncio's handshake timeout.

Versions: TLS 1.2 and 1.3 only (Python's defaults for ciphers).
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("nvidia-docker-plugin")


class TlsConfigError(Exception):
    """A certificate, key or CA file that cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The files of the REST API's TLS (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``)."""

    cert: Path
    key: Path
    client_ca: Path | None = None  # set: only clients with a certificate from this CA


class _AlertingSSLObject(ssl.SSLObject):
    """Lets the TLS alert of a failed handshake reach the client (see the module docstring)."""

    _failure: ssl.SSLError | None = None

    def do_handshake(self) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as err:
            if not _refuses_client_certificate(err):
                raise  # (a plain HTTP request, a bad ClientHello): no alert to send, close now
            self._failure = err
            raise ssl.SSLWantReadError("handshake failed: sending the alert") from err


def _refuses_client_certificate(err: ssl.SSLError) -> bool:
    """The client's certificate is missing or not trusted: OpenSSL has written an alert."""
    return isinstance(err, ssl.SSLCertVerificationError) or (
        getattr(err, "reason", None) == "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    )


def _readable(path: Path, what: str, option: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise TlsConfigError(f"{option} {path}: cannot read the {what}: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        raise TlsConfigError(f"{option} {path}: the {what} is not a file")
    if not os.access(path, os.R_OK):
        raise TlsConfigError(
            f"{option} {path}: the {what} is not readable by this user (uid {os.getuid()}): "
            "make it owned by the agent's user, mode 0600 or 0640"
        )


def build_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context from ``files``, as they are now; raises ``TlsConfigError``."""
    _readable(files.cert, "certificate", "--tls-cert")
    _readable(files.key, "private key", "--tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as err:
        raise TlsConfigError(
            f"--tls-cert {files.cert} / --tls-key {files.key}: {_ssl_reason(err)}: give a PEM "
            "certificate (chain) and the PEM private key that belongs to it"
        ) from None
    except OSError as err:
        raise TlsConfigError(
            f"--tls-cert {files.cert} / --tls-key {files.key}: {err.strerror or err}"
        ) from None
    if files.client_ca is not None:
        _readable(files.client_ca, "client CA", "--tls-client-ca")
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except (ssl.SSLError, OSError) as err:
            why = _ssl_reason(err) if isinstance(err, ssl.SSLError) else err.strerror
            raise TlsConfigError(
                f"--tls-client-ca {files.client_ca}: {why}: give the PEM certificate(s) of the "
                "CA that signs the clients' certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _ssl_reason(err: ssl.SSLError) -> str:
    reason = getattr(err, "reason", None)
    return str(reason).replace("_", " ").lower() if reason else str(err)


def _warn_if_others_read(path: Path, what: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & stat.S_IROTH:
        log.warning(
            "Warning: the %s %s is readable by every user (mode %04o): chmod 0600 or 0640",
            what,
            path,
            stat.S_IMODE(mode),
        )


class ServerTls:
    """The REST API's TLS: a fixed listening context whose handshakes use the latest files."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._current = build_context(files)
        # What the TCP sites hold; never replaced. Its verify mode (client certificates or
        # not) is fixed for the life of the process, like the options that decide it.
        self.listening = build_context(files)
        self.listening.sslobject_class = _AlertingSSLObject
        self.listening.sni_callback = self._choose
        _warn_if_others_read(files.key, "TLS private key (--tls-key)")

    def _choose(
        self, ssl_object: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext
    ) -> None:
        ssl_object.context = self._current

    @property
    def mutual(self) -> bool:
        return self.files.client_ca is not None

    def describe(self) -> str:
        text = f"TLS (certificate {self.files.cert}"
        if self.files.client_ca is not None:
            text += f", client certificates from {self.files.client_ca}"
        return text + ")"

    async def reload(self) -> None:
        """Read the files again; new handshakes use them. Raises ``TlsConfigError`` (the
        previous context stays in use)."""
        self._current = build_context(self.files)
        _warn_if_others_read(self.files.key, "TLS private key (--tls-key)")
        log.info("Reload: TLS certificate and keys read again from %s", self.files.cert)
