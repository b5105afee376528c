"""The client's side of the agent's TLS and tokens: what to trust, what to show, what it means.

- ``TlsOptions``: the CA to trust (default: the system's store), a client certificate and key
  (mutual TLS), a token file: ``from_options`` takes them from the edge's options
  (``NV_TLS_CA``, ``NV_TLS_CERT``, ``NV_TLS_KEY``, ``NV_TOKEN_FILE``; ``nvidia-docker-ctl``'s
  ``--ca``, ``--cert``, ``--key``, ``--token-file`` win), and an inventory may set them per
  host. A file that cannot be used is a ``TlsFileError`` (a usage error: ctl exits 2).
- ``client_context(options)``: one ``SSLContext`` per distinct (CA, certificate, key), shared
  by every node that uses them (a fleet of ten thousand HTTPS nodes makes one).
- ``bearer_token(options)``: the token to send (the first of the file; the agent accepts any
  of its own list, so a rotation changes the clients' file once).
- ``tls_failure(error, ...)``: what a TLS error means for the operator, as a ``Failure`` kind
  and one line: certificate not trusted, name mismatch, client certificate refused, or the
  port not speaking TLS at all.

This module knows nothing of aiohttp (``controller.transport.client`` unwraps its errors).
It imports ``ssl`` (about 10 ms) only where a context is made or a TLS error read, so that
the wrapper's plain-HTTP run, which takes ``TlsOptions`` from here, never imports it.
"""

from __future__ import annotations

import os

from controller.errors import Failure, UsageError
from controller.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ssl
    from typing import TypeVar

    K = TypeVar("K")
    V = TypeVar("V")

    from controller.options import Options


class TlsFileError(UsageError):
    """A CA, certificate, key or token file that cannot be used; the message names it."""


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, _EMAIL_MISMATCH, _IP_ADDRESS_MISMATCH
_NAME_MISMATCH_CODES = frozenset({62, 63, 64})
# Alerts a server sends when it does not accept the client's certificate (or its absence).
_CERT_REQUIRED = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
_CLIENT_CERT_ALERTS = frozenset(
    {
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "TLSV1_ALERT_ACCESS_DENIED",
        "TLSV1_ALERT_DECRYPT_ERROR",
        _CERT_REQUIRED,
    }
)
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE"})


@record
class TlsOptions:
    """What a client trusts and shows: CA, client certificate and key, token file."""

    ca: str | None = None  # PEM bundle of the CA(s) to trust; None: the system's store
    cert: str | None = None  # client certificate (mutual TLS)
    key: str | None = None  # its key (None: in the certificate file)
    token_file: str | None = None  # bearer token, first line that is not a comment
    # the fields a host's own (inventory) settings gave (``over``): errors about their files
    # name the inventory's variables, not the edge's options
    host_fields: frozenset[str] = field(default=frozenset(), compare=False)

    def __init__(  # written out, as Endpoint's: a fleet may make one per node (node.tls.over)
        self,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token_file: str | None = None,
        host_fields: frozenset[str] = frozenset(),
    ) -> None:
        store = object.__setattr__
        store(self, "ca", ca)
        store(self, "cert", cert)
        store(self, "key", key)
        store(self, "token_file", token_file)
        store(self, "host_fields", host_fields)

    @classmethod
    def from_options(cls, options: Options) -> TlsOptions:
        """The TLS part of the edge's options."""
        return cls(options.tls_ca, options.tls_cert, options.tls_key, options.token_file)

    def over(self, base: TlsOptions) -> TlsOptions:
        """These options (a host's own, from an inventory), with what they leave unset taken
        from ``base`` (the edge's); the fields these set are ``host_fields`` of the result."""
        own = {"ca": self.ca, "cert": self.cert, "key": self.key, "token_file": self.token_file}
        return TlsOptions(
            ca=self.ca or base.ca,
            cert=self.cert or base.cert,
            key=self.key or base.key,
            token_file=self.token_file or base.token_file,
            host_fields=frozenset(name for name, value in own.items() if value),
        )

    def where(self, name: str) -> str:
        """Where field ``name`` was set, as error lines name it: the edge's option and
        variable, or the inventory's variables of the host."""
        return (_HOST_SETTING if name in self.host_fields else _EDGE_SETTING)[name]


NO_TLS_OPTIONS = TlsOptions()

_EDGE_SETTING = {
    "ca": "--ca, NV_TLS_CA",
    "cert": "--cert, NV_TLS_CERT",
    "key": "--key, NV_TLS_KEY",
    "token_file": "--token-file, NV_TOKEN_FILE",
}
_HOST_SETTING = {  # controller.fleet.nodes.TLS_VARS: the host's variable, else the role's
    "ca": "this host's nvidia_docker_tls_ca or nvidia_docker_agent_tls_ca in the inventory",
    "cert": "this host's nvidia_docker_tls_cert in the inventory",
    "key": "this host's nvidia_docker_tls_key in the inventory",
    "token_file": "this host's nvidia_docker_token_file or nvidia_docker_agent_token_file "
    "in the inventory",
}


def client_context(options: TlsOptions) -> ssl.SSLContext:
    """The context for ``options`` (made once per CA, certificate and key); raises
    ``TlsFileError`` when a file cannot be used."""
    key = (options.ca, options.cert, options.key)
    context = _CONTEXTS.get(key)
    if context is None:
        context = _remember(_CONTEXTS, 64, key, _context(options))
    return context


_CONTEXTS: dict[tuple[str | None, str | None, str | None], ssl.SSLContext] = {}
_TOKENS: dict[str, str] = {}


def _remember(cache: dict[K, V], limit: int, key: K, value: V) -> V:
    """``value`` kept in ``cache`` under ``key``, the oldest entry dropped past ``limit`` (a
    bounded cache as functools.lru_cache keeps one, without importing functools: the
    wrapper's run path imports this module, docs/nvidia-docker.md, "Speed")."""
    if len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


def _context(options: TlsOptions) -> ssl.SSLContext:
    import ssl  # noqa: PLC0415 (HTTPS only: see the module docstring)

    ca, cert, key = options.ca, options.cert, options.key
    if key is not None and cert is None:
        raise TlsFileError(f"a client key ({options.where('key')}) needs its certificate too")
    for path, what in (
        (ca, f"CA file ({options.where('ca')})"),
        (cert, f"client certificate ({options.where('cert')})"),
    ):
        if path is not None and not os.path.isfile(path):
            raise TlsFileError(f"TLS {what} {path} does not exist")
    try:
        context = ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, OSError) as err:
        raise TlsFileError(
            f"TLS CA file {ca} ({options.where('ca')}) cannot be used: {_reason(err)}: give the "
            "PEM certificate of the CA that signed the agents' certificates"
        ) from None
    if cert is not None:
        if options.host_fields & {"cert", "key"}:
            where = f"{options.where('cert')}; {options.where('key')}"
        else:
            where = "--cert/--key, NV_TLS_CERT/NV_TLS_KEY"
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except _EncryptedKeyError:
            raise TlsFileError(
                f"TLS client key {key or cert} ({where}) is encrypted (passphrase-protected) "
                "and no passphrase is asked for: give the key decrypted (openssl pkey -in KEY "
                "-out PLAIN.key), mode 0600"
            ) from None
        except (ssl.SSLError, OSError) as err:
            raise TlsFileError(
                f"TLS client certificate {cert} / key {key or cert} ({where}) cannot be used: "
                f"{_reason(err)}"
            ) from None
    return context


class _EncryptedKeyError(Exception):
    """OpenSSL asked for the client key's passphrase."""


def _no_passphrase() -> str:
    """``load_cert_chain``'s password callback: OpenSSL calls it only for an encrypted key,
    which is refused rather than prompted for (a fleet query or a cron job has no one to
    type it, and OpenSSL's own prompt reads the terminal, not the command's input)."""
    raise _EncryptedKeyError


def bearer_token(options: TlsOptions) -> str | None:
    """The token to send, or None; raises ``TlsFileError`` for a file without one."""
    if options.token_file is None:
        return None
    token = _TOKENS.get(options.token_file)
    if token is None:
        read = _read_token(options.token_file, options.where("token_file"))
        token = _remember(_TOKENS, 16, options.token_file, read)
    return token


def _read_token(path: str, where: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise TlsFileError(f"token file {path} ({where}): cannot read it: {why}") from None
    for line in text.splitlines():
        token = line.strip()
        if token and not token.startswith("#"):
            if any(ch.isspace() for ch in token) or not token.isascii():
                raise TlsFileError(
                    f"token file {path}: a token is one word of printable ASCII characters"
                )
            return token
    raise TlsFileError(f"token file {path} ({where}) holds no token")


def _reason(err: BaseException) -> str:
    import ssl  # noqa: PLC0415 (an error of ssl's: imported already)

    if isinstance(err, ssl.SSLCertVerificationError) and err.verify_message:
        return str(err.verify_message)
    reason = getattr(err, "reason", None)
    if reason:
        return str(reason).replace("_", " ").lower()
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err)


def tls_failure(error: BaseException, options: TlsOptions, host: str) -> tuple[Failure, str]:
    """The kind of a TLS error and the line that says what to do (``host`` as connected)."""
    import ssl  # noqa: PLC0415 (see _reason)

    if isinstance(error, ssl.SSLCertVerificationError):
        why = _reason(error)
        if error.verify_code in _NAME_MISMATCH_CODES:
            return Failure.TLS_NAME_MISMATCH, (
                f"the agent's certificate is not valid for {host} ({why}): connect by a name "
                "or address it lists (subjectAltName), or reissue it with this one"
            )
        trusted = f"the CA in {options.ca}" if options.ca else "the system's CAs"
        return Failure.TLS_UNTRUSTED, (
            f"the agent's certificate is not trusted ({why}; checked against {trusted}): "
            "give the CA that signed it with --ca FILE or NV_TLS_CA"
        )
    reason = str(getattr(error, "reason", "") or "")
    if reason == _CERT_REQUIRED or (reason in _CLIENT_CERT_ALERTS and options.cert is None):
        return Failure.TLS_CLIENT_CERT_REFUSED, (
            "the agent asks for a client certificate (mutual TLS) and none was given: "
            "give --cert FILE --key FILE (NV_TLS_CERT, NV_TLS_KEY)"
        )
    if reason in _CLIENT_CERT_ALERTS:
        return Failure.TLS_CLIENT_CERT_REFUSED, (
            f"the agent refused the client certificate {options.cert} ({_reason(error)}): "
            "it must be signed by the CA the agent's --tls-client-ca names, and be valid"
        )
    if reason in _NOT_TLS:
        return Failure.TLS_ERROR, (
            f"the agent does not speak TLS on this port ({_reason(error)}): is it serving "
            "plain HTTP? (then use http://)"
        )
    return Failure.TLS_ERROR, f"TLS with the agent failed: {_reason(error)}"
