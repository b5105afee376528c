"""One SSH connection to a node, carrying TCP connections to the agent on its localhost.

``SshTunnel(endpoint, options)`` logs in once (``connect()``); every ``open_socket(port)``
then opens a ``direct-tcpip`` channel to ``localhost:port`` *on the node* and hands back one
end of a local socket pair, whose other end a small thread copies to and from the channel.
The caller (``controller.transport.client``) gives that socket to aiohttp, so HTTP over SSH is the
same HTTP client as plain HTTP; many requests (and keep-alive connections) share the one SSH
connection. The agent therefore can keep listening on the node's localhost only.

Authentication, in order: the SSH agent (``SSH_AUTH_SOCK``), the key files named in
``NV_SSH_IDENTITY`` (colon separated), the default keys ``~/.ssh/id_*``, and last a password
prompt, only when standard input is a terminal (never under Mesos or in a fleet query).

Host keys are checked against ``~/.ssh/known_hosts`` and ``/etc/ssh/ssh_known_hosts`` (or the
files named in ``NV_SSH_KNOWN_HOSTS``, colon separated). An unknown or changed key stops the
connection with the fingerprint and what to do. The opt-out, for throw-away test nodes only,
is ``NV_SSH_STRICT_HOST_KEY_CHECKING=no``: every key is then accepted and nothing is written.

Connecting, logging in and opening a channel each time out after ``timeout_s`` (10 s).
Blocking paramiko calls run in a dedicated thread pool, so that a fleet query can log in to a
hundred nodes at once without starving the event loop's default executor.

Only this module imports paramiko.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import select
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import paramiko

from controller.errors import Failure, NodeError
from controller.transport.endpoint import Endpoint

DEFAULT_KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
DEFAULT_TIMEOUT_S = 10.0
_FALSE = frozenset({"no", "false", "0", "off"})

# paramiko logs channel failures as warnings; our errors say it in one line instead
if not os.environ.get("NV_DEBUG"):
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    logging.getLogger("paramiko").propagate = False

_T = TypeVar("_T")
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 (one pool per process, made on first use)
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=128, thread_name_prefix="nv-ssh"
            )
        return _pool


async def _in_thread(call: Callable[[], _T]) -> _T:
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)


@dataclass(frozen=True, slots=True)
class SshOptions:
    """How to log in and what to trust; ``from_environ`` reads the ``NV_SSH_*`` variables."""

    strict_host_key_checking: bool = True
    known_hosts: tuple[str, ...] = DEFAULT_KNOWN_HOSTS
    identity_files: tuple[str, ...] = ()
    allow_password_prompt: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, compare=False)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, allow_password_prompt: bool = True
    ) -> SshOptions:
        env = os.environ if environ is None else environ
        strict = env.get("NV_SSH_STRICT_HOST_KEY_CHECKING", "yes").strip().lower() not in _FALSE
        known = tuple(p for p in env.get("NV_SSH_KNOWN_HOSTS", "").split(":") if p)
        identities = tuple(p for p in env.get("NV_SSH_IDENTITY", "").split(":") if p)
        return cls(
            strict_host_key_checking=strict,
            known_hosts=known or DEFAULT_KNOWN_HOSTS,
            identity_files=identities,
            allow_password_prompt=allow_password_prompt,
            environ=env,
        )


class _UnknownHostKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey) -> None:
        super().__init__(name)
        self.name = name
        self.key = key


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        raise _UnknownHostKey(hostname, key)


class _AcceptAny(paramiko.MissingHostKeyPolicy):
    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        return None


def fingerprint(key: paramiko.PKey) -> str:
    """``SHA256:...`` as OpenSSH prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class SshTunnel:
    """One logged-in SSH connection to ``endpoint`` (transport ``ssh``); thread safe."""

    def __init__(self, endpoint: Endpoint, options: SshOptions | None = None) -> None:
        if endpoint.transport != "ssh":
            raise ValueError(f"not an ssh endpoint: {endpoint.uri()}")
        self.endpoint = endpoint
        self.options = options or SshOptions.from_environ()
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    # --- life cycle -------------------------------------------------------------------------

    async def connect(self) -> None:
        """Log in (in a worker thread); raises ``NodeError`` with what to do."""
        await _in_thread(self._connect_blocking)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _in_thread(client.close)

    @property
    def connected(self) -> bool:
        client = self._client
        if client is None:
            return False
        transport = client.get_transport()
        return transport is not None and transport.is_active()

    def _connect_blocking(self) -> None:
        with self._lock:
            if self.connected:
                return
            self._client = self._login()

    def _new_client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if self.options.strict_host_key_checking:
            for path in self.options.known_hosts:
                full = Path(os.path.expanduser(path))
                if full.is_file():
                    try:
                        client.load_system_host_keys(str(full))
                    except (OSError, paramiko.SSHException) as exc:
                        raise self._error(f"cannot read known_hosts file {full}: {exc}") from exc
            client.set_missing_host_key_policy(_RejectUnknown())
        else:
            client.set_missing_host_key_policy(_AcceptAny())
        return client

    def _login(self) -> paramiko.SSHClient:
        ep, opts = self.endpoint, self.options
        client = self._new_client()
        try:
            self._connect(client, password=None)
            return client
        except (paramiko.AuthenticationException, paramiko.SSHException) as exc:
            client.close()
            if not _is_auth_failure(exc):
                raise self._translate(exc) from exc
            if not (opts.allow_password_prompt and _stdin_is_terminal()):
                raise self._error(
                    "SSH login failed (tried the SSH agent and the key files, and there is "
                    "no terminal to ask for a password): load a key into ssh-agent (ssh-add) "
                    f"or install your public key in ~{ep.user}/.ssh/authorized_keys on the node",
                    Failure.SSH_LOGIN_FAILED,
                ) from exc
        except Exception as exc:
            client.close()
            raise self._translate(exc) from exc
        import getpass  # noqa: PLC0415 (only when a person is asked)

        password = getpass.getpass(f"{ep.user}@{ep.host}'s password: ")
        client = self._new_client()
        try:
            self._connect(client, password=password)
        except Exception as exc:
            client.close()
            if isinstance(exc, paramiko.SSHException) and _is_auth_failure(exc):
                raise self._error(
                    "SSH login failed: wrong password (or the node refuses passwords); "
                    "try again, or log in with a key (ssh-add, ~/.ssh/authorized_keys)",
                    Failure.SSH_LOGIN_FAILED,
                ) from exc
            raise self._translate(exc) from exc
        return client

    def _connect(self, client: paramiko.SSHClient, *, password: str | None) -> None:
        ep, opts = self.endpoint, self.options
        keys = [os.path.expanduser(p) for p in opts.identity_files]
        missing = [k for k in keys if not os.path.isfile(k)]
        if missing:
            raise self._error(f"SSH identity file {missing[0]} (NV_SSH_IDENTITY) does not exist")
        key_files: Any = keys or None  # paramiko takes a list; its stubs say one str
        client.connect(
            ep.host,
            port=ep.ssh_port,
            username=ep.user,
            password=password,
            key_filename=key_files,
            allow_agent=password is None,
            look_for_keys=password is None,
            timeout=opts.timeout_s,
            banner_timeout=opts.timeout_s,
            auth_timeout=opts.timeout_s,
            channel_timeout=opts.timeout_s,
        )

    # --- channels ---------------------------------------------------------------------------

    async def open_socket(self, port: int) -> socket.socket:
        """A socket connected, through the SSH connection, to ``localhost:port`` on the node.

        The socket is non-blocking and ready for ``loop.create_connection(sock=...)``.
        """
        if not self.connected:
            await self.connect()
        return await _in_thread(lambda: self._open_socket_blocking(port))

    def _open_socket_blocking(self, port: int) -> socket.socket:
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            raise self._error("the SSH connection was closed; try again")
        try:
            channel = transport.open_channel(
                "direct-tcpip",
                dest_addr=("localhost", port),
                src_addr=("127.0.0.1", 0),
                timeout=self.options.timeout_s,
            )
        except paramiko.ChannelException as exc:
            raise self._error(
                f"the agent does not answer on localhost:{port} of the node "
                f"(SSH tunnel: {exc.text or exc}): is nvidia-docker-plugin running there "
                f"with -l localhost:{port}, and does sshd allow TCP forwarding?",
                Failure.SSH_NO_AGENT,
            ) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._error(f"cannot open an SSH channel to localhost:{port}: {exc}") from exc
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        threading.Thread(
            target=_pump, args=(theirs, channel), name="nv-ssh-pump", daemon=True
        ).start()
        return ours

    # --- errors -----------------------------------------------------------------------------

    def _error(self, message: str, failure: Failure = Failure.SSH_ERROR) -> NodeError:
        return NodeError(f"ssh://{self.endpoint.node}", message, failure)

    def _translate(self, exc: BaseException) -> NodeError:
        ep, timeout_s = self.endpoint, self.options.timeout_s
        where = f"{ep.url_host}:{ep.ssh_port}"
        if isinstance(exc, NodeError):
            return exc
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError) and exc.errors:
            exc = next(iter(exc.errors.values()))
        if isinstance(exc, _UnknownHostKey):
            files = ", ".join(self.options.known_hosts)
            return self._error(
                f"unknown SSH host key {exc.key.get_name()} {fingerprint(exc.key)} for "
                f"{exc.name} (not in {files}): check the fingerprint on the node "
                f"(ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) and add it "
                f"(ssh-keyscan -p {ep.ssh_port} {ep.host} >> ~/.ssh/known_hosts), or set "
                "NV_SSH_STRICT_HOST_KEY_CHECKING=no to skip the check (test nodes only)",
                Failure.SSH_HOST_KEY_UNKNOWN,
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            return self._error(
                f"the SSH host key of {where} has CHANGED ({exc.key.get_name()} "
                f"{fingerprint(exc.key)}, known_hosts has {fingerprint(exc.expected_key)}): "
                "someone may be intercepting the connection; if the node was reinstalled, "
                f"remove the old key with: ssh-keygen -R '[{ep.host}]:{ep.ssh_port}'",
                Failure.SSH_HOST_KEY_CHANGED,
            )
        if isinstance(exc, socket.gaierror):
            return self._error(
                f"cannot resolve the host name {ep.host!r}: {exc.strerror}", Failure.UNKNOWN_HOST
            )
        if isinstance(exc, TimeoutError):
            return self._error(
                f"no SSH answer from {where} within {timeout_s:g} s: is the node up, "
                "and is the port right (ssh://user@host:SSH_PORT:HTTP_PORT)?",
                Failure.TIMEOUT,
            )
        if isinstance(exc, ConnectionError):
            return self._error(
                f"SSH connection to {where} refused: is sshd running on the node, and is the "
                "port right (ssh://user@host:SSH_PORT:HTTP_PORT)?",
                Failure.SSH_REFUSED,
            )
        if isinstance(exc, OSError):
            return self._error(
                f"cannot connect to {where}: {exc.strerror or exc}", Failure.CANNOT_CONNECT
            )
        return self._error(f"SSH to {where} failed: {exc}")


def _is_auth_failure(exc: BaseException) -> bool:
    return isinstance(exc, paramiko.AuthenticationException) or (
        "No authentication methods available" in str(exc)
    )


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # closed
        return False


def _pump(sock: socket.socket, channel: paramiko.Channel) -> None:
    """Copy bytes both ways between a local socket and an SSH channel until either closes."""
    sock_fd, channel_fd = sock.fileno(), channel.fileno()
    try:
        while True:
            readable, _, _ = select.select([sock_fd, channel_fd], [], [])
            if sock_fd in readable:
                data = sock.recv(65536)
                if not data:
                    break
                channel.sendall(data)
            if channel_fd in readable:
                data = channel.recv(65536)
                if not data:
                    break
                sock.sendall(data)
    except (OSError, EOFError, paramiko.SSHException):
        pass
    finally:
        with contextlib.suppress(Exception):
            channel.close()
        with contextlib.suppress(OSError):
            sock.close()
