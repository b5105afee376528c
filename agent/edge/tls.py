"""TLS for the REST API: the server's certificate, and optionally mutual TLS (client certs).

``ServerTls(files)`` reads the certificate chain, its key and the client CA once at start
(any mistake is a ``TlsConfigError`` naming the file and what to do) and hands the TCP sites
one listening context, a ``ReloadableContext`` (``agent.edge.tls_or_plain``): each new
connection gets the context built from the files as last read (``newest``). ``reload()``
(SIGHUP) reads the files again in a worker thread, so the event loop keeps serving. When
they differ from what is served, a new context is built and new connections get it: it has
its own session cache and ticket keys, so no session made under the previous certificate or
client CA is resumed (a client of a retired CA cannot skip the new CA's check by resuming).
When every byte is the same, the context in use stays and sessions resume as before.
Connections already open keep the session they negotiated, so a rotation drops no request
in flight; a reload that fails (a half-copied key) keeps the previous context.

Every file is read once, through ``agent.files.read_regular`` (a regular file of at most
``TLS_FILE_LIMIT`` bytes), and what was read is what is loaded: the client CA from memory
(``cadata``), the certificate chain and key through ``memfd_create`` files that only this
process can reach, by their ``/proc/self/fd`` name (``load_cert_chain`` takes names only).
The key is never written to disk. OpenSSL is never allowed to ask for a passphrase: an
encrypted key would have it prompt on the terminal and block every listener, so it is
refused with one line instead.

Expiry: a certificate (the server's, or one of the client CA file) that has expired or
expires within ``agent.edge.certificates.EXPIRY_WARNING_DAYS`` days is logged at start and at
every reload, one line per file; ``not_after`` is the served certificate's expiry, for
``/metrics``.

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

import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from agent.edge.certificates import (
    CertificateFormatError,
    earliest_expiry,
    expiry_warning,
    not_after,
    pem_certificates,
)
from agent.edge.tls_or_plain import ReloadableContext
from agent.files import UnusableFile, read_regular

log = logging.getLogger("nvidia-docker-plugin")

TLS_FILE_LIMIT = 1 << 20  # 1 MiB for each of the certificate chain, the key, the client CA


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


# --- reading ---------------------------------------------------------------------------------


def _explain(path: Path, what: str, option: str) -> None:
    """Raise the plainest message for a file that cannot be opened (missing, not a file, not
    readable by this user); return if it can be."""
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


def _read(path: Path, what: str, option: str) -> bytes:
    try:
        return read_regular(path, limit=TLS_FILE_LIMIT, what=option)
    except UnusableFile as err:
        _explain(path, what, option)
        raise TlsConfigError(f"{err}: give the PEM {what}") from None


@dataclass(frozen=True, slots=True)
class _Read:
    """The bytes of the files, as read once."""

    cert: bytes
    key: bytes
    client_ca: bytes | None

    @property
    def digest(self) -> bytes:
        """Equal for two reads of byte-identical files (and only for those)."""
        digest = hashlib.sha256()
        for part in (self.cert, self.key, self.client_ca):
            if part is None:
                digest.update(b"-")
            else:
                digest.update(len(part).to_bytes(8, "big") + part)
        return digest.digest()


def _read_files(files: TlsFiles) -> _Read:
    cert = _read(files.cert, "certificate", "--tls-cert")
    key = _read(files.key, "private key", "--tls-key")
    client_ca = None
    if files.client_ca is not None:
        client_ca = _read(files.client_ca, "client CA", "--tls-client-ca")
    return _Read(cert, key, client_ca)


# --- building --------------------------------------------------------------------------------


class _PassphraseAsked(Exception):
    """OpenSSL asked for the key's passphrase: the key is encrypted."""


def _refuse_passphrase() -> bytes:
    """OpenSSL's passphrase callback: never a prompt, never a guess."""
    raise _PassphraseAsked


@contextlib.contextmanager
def _in_memory(data: bytes, name: str) -> Iterator[str]:
    """A name OpenSSL can open for ``data``: an anonymous memory file of this process."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _build(files: TlsFiles, read: _Read) -> ReloadableContext:
    context = ReloadableContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.sslobject_class = _AlertingSSLObject
    pair = f"--tls-cert {files.cert} / --tls-key {files.key}"
    # OpenSSL names neither file when one holds no PEM block of its kind ("PEM lib")
    if b"-----BEGIN CERTIFICATE-----" not in read.cert:
        raise TlsConfigError(
            f"--tls-cert {files.cert}: no PEM certificate in it: give the PEM certificate "
            "(chain) of the REST API"
        )
    if b"PRIVATE KEY-----" not in read.key:
        raise TlsConfigError(
            f"--tls-key {files.key}: no PEM private key in it: give the PEM private key that "
            "belongs to --tls-cert"
        )
    try:
        with (
            _in_memory(read.cert, "tls-cert") as cert,
            _in_memory(read.key, "tls-key") as key,
        ):
            context.load_cert_chain(cert, key, password=_refuse_passphrase)
    except _PassphraseAsked:
        raise TlsConfigError(
            f"--tls-key {files.key}: the private key is encrypted (passphrase-protected) and "
            "the agent never asks for a passphrase: give it the key decrypted "
            "(openssl pkey -in KEY -out PLAIN.key), mode 0600"
        ) from None
    except ssl.SSLError as err:
        raise TlsConfigError(
            f"{pair}: {_ssl_reason(err)}: give a PEM certificate (chain) and the PEM private "
            "key that belongs to it"
        ) from None
    except OSError as err:  # memfd_create, or the /proc/self/fd name OpenSSL opens
        raise TlsConfigError(
            f"{pair}: cannot load them from memory ({err.strerror or err}): the agent needs "
            "memfd_create (Linux 3.17+) and /proc mounted"
        ) from None
    if files.client_ca is not None and read.client_ca is not None:
        hint = "give the PEM certificate(s) of the CA that signs the clients' certificates"
        try:
            authorities = pem_certificates(read.client_ca)
        except CertificateFormatError as err:
            raise TlsConfigError(f"--tls-client-ca {files.client_ca}: {err}: {hint}") from None
        if not authorities:
            raise TlsConfigError(
                f"--tls-client-ca {files.client_ca}: no PEM certificate in it: {hint}"
            )
        try:
            context.load_verify_locations(cadata=b"".join(authorities))
        except ssl.SSLError as err:
            raise TlsConfigError(
                f"--tls-client-ca {files.client_ca}: {_ssl_reason(err)}: {hint}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _ssl_reason(err: ssl.SSLError) -> str:
    reason = getattr(err, "reason", None)
    return str(reason).replace("_", " ").lower() if reason else str(err)


# --- what to warn about ----------------------------------------------------------------------


def _served_expiry(files: TlsFiles, read: _Read) -> tuple[datetime | None, list[str]]:
    """The served certificate's expiry (the first of the chain), and the warnings about the
    files as read: expired or expiring certificates, a key every user can read."""
    warnings: list[str] = []
    served: datetime | None = None
    now = datetime.now(UTC)
    try:
        chain = pem_certificates(read.cert)
        if chain:
            served = not_after(chain[0])
    except CertificateFormatError as err:
        warnings.append(f"Warning: --tls-cert {files.cert}: cannot read its expiry date: {err}")
    if served is not None:
        earliest = earliest_expiry(chain)
        warning = expiry_warning("--tls-cert", files.cert, earliest or served, now)
        if warning is not None:
            warnings.append(warning)
    if files.client_ca is not None and read.client_ca is not None:
        with contextlib.suppress(CertificateFormatError):  # refused by _build already
            earliest = earliest_expiry(pem_certificates(read.client_ca))
            if earliest is not None:
                warning = expiry_warning("--tls-client-ca", files.client_ca, earliest, now)
                if warning is not None:
                    warnings.append(warning)
    try:
        mode = files.key.stat().st_mode
    except OSError:
        mode = 0
    if mode & stat.S_IROTH:
        warnings.append(
            f"Warning: the TLS private key (--tls-key) {files.key} is readable by every user "
            f"(mode {stat.S_IMODE(mode):04o}): chmod 0600 or 0640"
        )
    return served, warnings


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One read of the files: the context built from them (None: the same bytes as what is
    served, nothing was built), the served certificate's expiry, what to warn about."""

    read: _Read
    context: ReloadableContext | None
    not_after: datetime | None
    warnings: list[str]


def _load(files: TlsFiles, serving: bytes | None) -> _Loaded:
    """Read ``files`` and build their context unless their digest is ``serving``."""
    read = _read_files(files)
    context = None if read.digest == serving else _build(files, read)
    served, warnings = _served_expiry(files, read)
    return _Loaded(read, context, served, warnings)


class ServerTls:
    """The REST API's TLS: a listening context whose new connections use the latest files."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        loaded = _load(files, None)
        assert loaded.context is not None
        # What the TCP sites hold; never replaced. Its verify mode (client certificates or
        # not) is that of every context after it, like the options that decide it.
        self.listening: ReloadableContext = loaded.context
        self._loaded = loaded
        for warning in loaded.warnings:
            log.warning("%s", warning)

    @property
    def current(self) -> ssl.SSLContext:
        """The context new connections get now."""
        return self.listening.newest

    @property
    def not_after(self) -> float | None:
        """When the served certificate expires (Unix time), None if it cannot be read."""
        expires = self._loaded.not_after
        return None if expires is None else expires.timestamp()

    @property
    def mutual(self) -> bool:
        return self.files.client_ca is not None

    def describe(self) -> str:
        text = f"TLS (certificate {self.files.cert}"
        if self.files.client_ca is not None:
            text += f", client certificates from {self.files.client_ca}"
        return text + ")"

    async def reload(self) -> None:
        """Read the files again (in a thread); new connections use them, and sessions of the
        previous ones are not resumed (unless every byte is the same). Raises
        ``TlsConfigError``: the previous context stays in use."""
        loaded = await asyncio.to_thread(_load, self.files, self._loaded.read.digest)
        for warning in loaded.warnings:
            log.warning("%s", warning)
        if loaded.context is None:
            self._loaded = loaded
            log.info(
                "Reload: TLS certificate and keys read again from %s: unchanged, TLS sessions "
                "resume as before",
                self.files.cert,
            )
            return
        self.listening.supersede(loaded.context)
        self._loaded = loaded
        log.info(
            "Reload: TLS certificate and keys read again from %s: new connections use them, "
            "and no earlier TLS session is resumed",
            self.files.cert,
        )
