"""One SSH connection to a node, carrying TCP connections to the agent on its localhost.

``SshTunnel(endpoint, options)`` logs in once (``connect()``), then ``serve(port)`` listens
on a private unix socket (in a fresh 0700 directory) and returns its path: every connection
made to it becomes a ``direct-tcpip`` channel to ``localhost:port`` *on the node*. The callers
give that path to their HTTP client (``controller.transport.client``: aiohttp's public
``UnixConnector``; ``controller.fleet.query``: ``fleet_http``), so HTTP over SSH is the same
HTTP client as plain HTTP; many requests (and keep-alive
connections) share the one SSH connection, and the agent can keep listening on the node's
localhost only.

At scale (a fleet query over thousands of nodes):

- Bytes are pumped by the event loop, not by threads: each channel's readiness pipe
  (``Channel.fileno()``) is watched with ``loop.add_reader`` (epoll underneath, so there is
  no descriptor ceiling like ``select``'s 1,024), and the unix side is an asyncio protocol.
  paramiko keeps its one thread per SSH connection (its transport); nothing is started per
  channel.
- Logins are bounded: at most ``SshOptions.max_handshakes`` (``NV_SSH_MAX_HANDSHAKES``,
  default 32, through the edge's ``Options``) are in progress at once in a process, so a
  query of 4,096 nodes in parallel does not start 4,096 key exchanges on two cores (or
  beyond a jump host's ``MaxStartups``).
- Blocking paramiko calls (connect, log in, open a channel, close) run in a dedicated thread
  pool, so that a fleet query does not starve the event loop's default executor.

What to trust and how to log in come from the edge's options (``SshOptions.from_options``:
the ``NV_SSH_*`` variables there); this module reads no environment and configures no
logging (the edges silence paramiko's warnings unless ``NV_DEBUG``: ``controller.logs``).

Where the node is: ``~/.ssh/config`` is honoured (``controller.transport.ssh_config``:
``Host`` aliases, ``HostName``, ``User``, ``Port``, ``IdentityFile``, ``ProxyJump``,
``ProxyCommand``, ``UserKnownHostsFile``). Jump hosts are logged in to once per process and
shared by every node behind them, each node one more channel of that connection.

Authentication, in paramiko's order: the key files named in ``NV_SSH_IDENTITY`` (colon
separated) or by ``IdentityFile``, the SSH agent (``SSH_AUTH_SOCK``), the default keys
``~/.ssh/id_*``, and last a password prompt, only when standard input is a terminal (never
under Mesos or in a fleet query, never for a jump host).

Host keys are checked against ``~/.ssh/known_hosts`` and ``/etc/ssh/ssh_known_hosts`` (or the
files named in ``NV_SSH_KNOWN_HOSTS``, colon separated, plus ``UserKnownHostsFile``): hashed
and ``[host]:port`` entries; a key on a ``@revoked`` line is refused for every host;
``@cert-authority`` lines and lines without a key are skipped. An unknown, changed or revoked
key stops the connection with the fingerprint and what to do. The opt-out,
for throw-away test nodes only, is ``NV_SSH_STRICT_HOST_KEY_CHECKING=no``: every key is then
accepted and nothing is written.

Connecting, logging in and opening a channel each time out after ``timeout_s`` (10 s).

Only this module and ``ssh_config`` import paramiko.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import paramiko

from controller.errors import EndpointError, Failure, NodeError
from controller.transport.endpoint import DEFAULT_SSH_PORT, Endpoint
from controller.transport.ssh_config import SshHop, SshRoute, resolve_route

if TYPE_CHECKING:
    from controller.options import Options

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_HANDSHAKES = 32
_READS_PER_WAKEUP = 16  # channel reads per readiness callback, so one node cannot hog the loop
_RECV_BYTES = 65536
_WINDOW_RETRY_S = 0.005  # the channel's send window is full: try again this much later
_SOCKET_NAME = "agent.sock"

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


_handshake_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _handshake_slot(limit: int) -> asyncio.Semaphore:
    """The process's bound on logins in progress (one semaphore per event loop)."""
    loop = asyncio.get_running_loop()
    slots = _handshake_slots.get(loop)
    if slots is None:
        slots = _handshake_slots[loop] = asyncio.Semaphore(limit)
    return slots


@dataclass(frozen=True, slots=True)
class SshOptions:
    """How to log in and what to trust (``from_options``: the edge's ``NV_SSH_*``).

    Paths are as the edge expanded them (``~`` is its ``HOME``); ``user`` is the login of
    hops that name none, ``home`` what ``~`` means in ``~/.ssh/config``.
    """

    user: str
    home: str
    strict_host_key_checking: bool = True
    known_hosts: tuple[str, ...] = ()
    identity_files: tuple[str, ...] = ()
    allow_password_prompt: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    config_file: str | None = None  # ~/.ssh/config, resolved; None: read none
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES

    @classmethod
    def from_options(
        cls, options: Options, *, timeout_s: float = DEFAULT_TIMEOUT_S, prompt: bool = False
    ) -> SshOptions:
        """The SSH part of the edge's options; ``prompt``: a password may be asked for (only
        when the edge found a terminal on standard input, never in a fleet query)."""
        return cls(
            user=options.user,
            home=options.home,
            strict_host_key_checking=options.ssh_strict_host_key_checking,
            known_hosts=options.ssh_known_hosts,
            identity_files=options.ssh_identity,
            allow_password_prompt=prompt and options.password_prompt,
            timeout_s=timeout_s,
            config_file=options.ssh_config,
            max_handshakes=options.ssh_max_handshakes,
        )


class _UnknownHostKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey) -> None:
        super().__init__(name)
        self.name = name
        self.key = key


class _RevokedHostKey(_UnknownHostKey):
    pass


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, revoked: frozenset[bytes] = frozenset()) -> None:
        self.revoked = revoked  # key blobs of known_hosts' @revoked lines

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if key.asbytes() in self.revoked:
            raise _RevokedHostKey(hostname, key)
        raise _UnknownHostKey(hostname, key)


def _read_known_hosts(
    path: Path, entries: list[paramiko.hostkeys.HostKeyEntry], revoked: set[bytes]
) -> None:
    """The host keys of one known_hosts file, as OpenSSH reads it: entries (hashed names and
    ``[host]:port`` included) go to ``entries``, the keys of ``@revoked`` lines to
    ``revoked``; ``@cert-authority`` lines (paramiko cannot check host certificates) and lines
    that hold no host key are skipped. Raises ``OSError`` when the file cannot be read."""
    with path.open(encoding="utf-8", errors="replace") as file:
        for line in file:
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if text.startswith("@"):
                fields = text.split()
                if fields[0] == "@revoked" and len(fields) >= 4:
                    with contextlib.suppress(ValueError):
                        revoked.add(base64.b64decode(fields[3], validate=True))
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(text)
            except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
                continue
            if entry is not None:
                entries.append(entry)


class _AcceptAny(paramiko.MissingHostKeyPolicy):
    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        return None


def fingerprint(key: paramiko.PKey) -> str:
    """``SHA256:...`` as OpenSSH prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# --- jump hosts, shared ---------------------------------------------------------------------


@dataclass
class _Jump:
    lock: threading.Lock = field(default_factory=threading.Lock)
    clients: list[paramiko.SSHClient] = field(default_factory=list)
    users: int = 0

    @property
    def transport(self) -> paramiko.Transport | None:
        if not self.clients:
            return None
        transport = self.clients[-1].get_transport()
        return transport if transport is not None and transport.is_active() else None


class _JumpHosts:
    """Logged-in chains of jump hosts, each shared by every node behind it (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chains: dict[tuple[str, ...], _Jump] = {}

    def acquire(
        self, key: tuple[str, ...], login: Callable[[], list[paramiko.SSHClient]]
    ) -> paramiko.Transport:
        with self._lock:
            jump = self._chains.setdefault(key, _Jump())
            jump.users += 1
        try:
            with jump.lock:
                transport = jump.transport
                if transport is None:
                    _close_all(jump.clients)
                    jump.clients = login()
                    transport = jump.transport
                if transport is None:
                    raise EOFError("the jump host closed the connection")
                return transport
        except BaseException:
            self.release(key)
            raise

    def release(self, key: tuple[str, ...]) -> None:
        with self._lock:
            jump = self._chains.get(key)
            if jump is None:
                return
            jump.users -= 1
            if jump.users > 0:
                return
            del self._chains[key]
        with jump.lock:
            _close_all(jump.clients)
            jump.clients = []


def _close_all(clients: list[paramiko.SSHClient]) -> None:
    for client in reversed(clients):
        with contextlib.suppress(Exception):
            client.close()


_JUMPS = _JumpHosts()


# --- the tunnel -----------------------------------------------------------------------------


class SshTunnel:
    """One logged-in SSH connection to ``endpoint`` (transport ``ssh``)."""

    def __init__(self, endpoint: Endpoint, options: SshOptions) -> None:
        if endpoint.transport != "ssh":
            raise ValueError(f"not an ssh endpoint: {endpoint.uri()}")
        self.endpoint = endpoint
        self.options = options
        self.route: SshRoute | None = None
        self.channel_error: NodeError | None = None  # why the last channel could not open
        self._client: paramiko.SSHClient | None = None
        self._jump_key: tuple[str, ...] | None = None
        self._lock = threading.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._socket_dir: str | None = None
        self._bridges: set[_ChannelBridge] = set()

    @property
    def name(self) -> str:
        return f"ssh://{self.endpoint.node}"

    # --- life cycle -------------------------------------------------------------------------

    async def connect(self, on_start: Callable[[], None] | None = None) -> None:
        """Log in (in a worker thread, bounded in number); raises ``NodeError``.

        ``on_start`` is called when the login really starts, after waiting for a free slot
        (a fleet query starts the node's clock then: waiting in line is not the node's fault).
        """
        async with _handshake_slot(self.options.max_handshakes):
            if on_start is not None:
                on_start()
            await _in_thread(self._connect_blocking)

    async def serve(self, port: int) -> str:
        """Listen on a private unix socket whose connections reach ``localhost:port`` on the
        node; returns its path (the same one when called again)."""
        if self._server is not None and self._socket_dir is not None:
            return os.path.join(self._socket_dir, _SOCKET_NAME)
        self._socket_dir = tempfile.mkdtemp(prefix="nv-ssh-", dir=_short_tmp())
        path = os.path.join(self._socket_dir, _SOCKET_NAME)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ChannelBridge(self, port), path=path, backlog=128
        )
        return path

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for bridge in list(self._bridges):
            bridge.abort()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        client, self._client = self._client, None
        jump_key, self._jump_key = self._jump_key, None
        if client is not None or jump_key is not None:
            await _in_thread(lambda: self._close_blocking(client, jump_key))

    @staticmethod
    def _close_blocking(
        client: paramiko.SSHClient | None, jump_key: tuple[str, ...] | None
    ) -> None:
        if client is not None:
            client.close()
        if jump_key is not None:
            _JUMPS.release(jump_key)

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
            if self.route is None:
                try:
                    self.route = resolve_route(
                        self.endpoint,
                        self.options.config_file,
                        self.options.user,
                        self.options.home,
                    )
                except EndpointError as exc:
                    raise self._error(str(exc)) from None
            self._client = self._login_target(self.route)

    # --- logging in -------------------------------------------------------------------------

    def _known_hosts(self, route: SshRoute | None) -> tuple[str, ...]:
        """The known_hosts files a login checks: ``NV_SSH_KNOWN_HOSTS``'s (or the
        defaults), then the route's ``UserKnownHostsFile``, each once."""
        route_files = route.known_hosts if route is not None else ()
        return tuple(dict.fromkeys((*self.options.known_hosts, *route_files)))

    def _new_client(self, route: SshRoute) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if self.options.strict_host_key_checking:
            entries: list[paramiko.hostkeys.HostKeyEntry] = []
            revoked: set[bytes] = set()
            for path in self._known_hosts(route):
                full = Path(path)
                if full.is_file():
                    try:
                        _read_known_hosts(full, entries, revoked)
                    except OSError as exc:
                        raise self._error(
                            f"cannot read known_hosts file {full}: {exc.strerror or exc}"
                        ) from exc
            known = client.get_host_keys()
            for entry in entries:
                if entry.key.asbytes() not in revoked:  # a revoked key is never known
                    for name in entry.hostnames:
                        known.add(name, entry.key.get_name(), entry.key)
            client.set_missing_host_key_policy(_RejectUnknown(frozenset(revoked)))
        else:
            client.set_missing_host_key_policy(_AcceptAny())
        return client

    def _login_target(self, route: SshRoute) -> paramiko.SSHClient:
        if not route.jumps:
            sock: Any = None
            if route.proxy_command:
                try:
                    sock = paramiko.ProxyCommand(route.proxy_command)
                except Exception as exc:
                    raise self._error(
                        f"ProxyCommand {route.proxy_command!r} failed: {exc}"
                    ) from exc
            prompt = self.options.allow_password_prompt
            return self._login(route, route.target, sock, prompt=prompt)
        key = (*(h.where for h in route.jumps), *self.options.known_hosts)
        try:
            jump = _JUMPS.acquire(key, lambda: self._login_jumps(route))
        except NodeError:
            raise
        except Exception as exc:
            raise self._translate(exc, route.jumps[-1], jump=True) from exc
        try:
            channel = self._open_forward(jump, route.target, route.jumps[-1])
            client = self._login(route, route.target, channel, prompt=False)
        except BaseException:
            _JUMPS.release(key)
            raise
        self._jump_key = key
        return client

    def _login_jumps(self, route: SshRoute) -> list[paramiko.SSHClient]:
        clients: list[paramiko.SSHClient] = []
        try:
            for index, hop in enumerate(route.jumps):
                sock: Any = None
                if clients:
                    previous = clients[-1].get_transport()
                    if previous is None:
                        raise EOFError("the jump host closed the connection")
                    sock = self._open_forward(previous, hop, route.jumps[index - 1])
                clients.append(self._login(route, hop, sock, prompt=False, jump=True))
        except BaseException:
            _close_all(clients)
            raise
        return clients

    def _open_forward(self, transport: paramiko.Transport, hop: SshHop, via: SshHop) -> Any:
        try:
            return transport.open_channel(
                "direct-tcpip",
                dest_addr=(hop.hostname, hop.port),
                src_addr=("127.0.0.1", 0),
                timeout=self.options.timeout_s,
            )
        except paramiko.ChannelException as exc:
            raise self._error(
                f"the jump host {via.alias} ({via.where}) cannot reach {hop.hostname}:"
                f"{hop.port} ({exc.text or exc}): check HostName and Port, and that its sshd "
                "allows TCP forwarding",
                Failure.SSH_REFUSED,
            ) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._error(f"jump host {via.alias} ({via.where}): {exc}") from exc

    def _login(
        self, route: SshRoute, hop: SshHop, sock: Any, *, prompt: bool, jump: bool = False
    ) -> paramiko.SSHClient:
        client = self._new_client(route)
        try:
            self._connect(client, hop, sock, password=None)
            return client
        except (paramiko.AuthenticationException, paramiko.SSHException) as exc:
            client.close()
            if not _is_auth_failure(exc):
                raise self._translate(exc, hop, jump=jump) from exc
            if not (prompt and _stdin_is_terminal()):
                who = f"the jump host {hop.alias} ({hop.where})" if jump else "the node"
                raise self._error(
                    f"SSH login to {who} failed (tried the SSH agent and the key files, and "
                    "there is no terminal to ask for a password): load a key into ssh-agent "
                    f"(ssh-add) or install your public key in ~{hop.user}/.ssh/authorized_keys"
                    + ("" if jump else " on the node"),
                    Failure.SSH_LOGIN_FAILED,
                ) from exc
        except NodeError:
            client.close()
            raise
        except Exception as exc:
            client.close()
            raise self._translate(exc, hop, jump=jump) from exc
        import getpass  # noqa: PLC0415 (only when a person is asked)

        password = getpass.getpass(f"{hop.user}@{hop.hostname}'s password: ")
        client = self._new_client(route)
        try:
            self._connect(client, hop, sock, password=password)
        except Exception as exc:
            client.close()
            if isinstance(exc, paramiko.SSHException) and _is_auth_failure(exc):
                raise self._error(
                    "SSH login failed: wrong password (or the node refuses passwords); "
                    "try again, or log in with a key (ssh-add, ~/.ssh/authorized_keys)",
                    Failure.SSH_LOGIN_FAILED,
                ) from exc
            raise self._translate(exc, hop) from exc
        return client

    def _connect(
        self, client: paramiko.SSHClient, hop: SshHop, sock: Any, *, password: str | None
    ) -> None:
        opts = self.options
        keys = list(opts.identity_files)
        missing = [k for k in keys if not os.path.isfile(k)]
        if missing:
            raise self._error(f"SSH identity file {missing[0]} (NV_SSH_IDENTITY) does not exist")
        keys += [k for k in hop.identity_files if k not in keys]
        key_files: Any = keys or None  # paramiko takes a list; its stubs say one str
        client.connect(
            hop.hostname,
            port=hop.port,
            username=hop.user,
            password=password,
            key_filename=key_files,
            allow_agent=password is None,
            look_for_keys=password is None,
            timeout=opts.timeout_s,
            banner_timeout=opts.timeout_s,
            auth_timeout=opts.timeout_s,
            channel_timeout=opts.timeout_s,
            sock=sock,
        )

    # --- channels ---------------------------------------------------------------------------

    def _open_channel(self, port: int) -> paramiko.Channel:
        """A ``direct-tcpip`` channel to ``localhost:port`` on the node (blocking)."""
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            raise self._error("the SSH connection was closed; try again", Failure.DISCONNECTED)
        try:
            return transport.open_channel(
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

    # --- errors -----------------------------------------------------------------------------

    def _error(self, message: str, failure: Failure = Failure.SSH_ERROR) -> NodeError:
        return NodeError(self.name, message, failure)

    def _translate(self, exc: BaseException, hop: SshHop, *, jump: bool = False) -> NodeError:
        timeout_s = self.options.timeout_s
        where = f"{hop.hostname}:{hop.port}"
        if isinstance(exc, NodeError):
            return exc
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError) and exc.errors:
            exc = next(iter(exc.errors.values()))
        error = self._describe(exc, hop, where, timeout_s)
        if jump:
            return self._error(f"jump host {hop.alias}: {error.reason}", error.failure)
        return error

    def _describe(self, exc: BaseException, hop: SshHop, where: str, timeout_s: float) -> NodeError:
        if isinstance(exc, _RevokedHostKey):
            return self._error(
                f"the SSH host key {exc.key.get_name()} {fingerprint(exc.key)} of {exc.name} "
                "is marked @revoked in known_hosts: it is refused; if the node has a new key, "
                "check its fingerprint on the node and add it to ~/.ssh/known_hosts"
            )
        if isinstance(exc, _UnknownHostKey):
            files = ", ".join(self._known_hosts(self.route))
            return self._error(
                f"unknown SSH host key {exc.key.get_name()} {fingerprint(exc.key)} for "
                f"{exc.name} (not in {files}): check the fingerprint on the node "
                f"(ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) and add it "
                f"(ssh-keyscan -p {hop.port} {hop.hostname} >> ~/.ssh/known_hosts), or set "
                "NV_SSH_STRICT_HOST_KEY_CHECKING=no to skip the check (test nodes only)",
                Failure.SSH_HOST_KEY_UNKNOWN,
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            return self._error(
                f"the SSH host key of {where} has CHANGED ({exc.key.get_name()} "
                f"{fingerprint(exc.key)}, known_hosts has {fingerprint(exc.expected_key)}): "
                "someone may be intercepting the connection; if the node was reinstalled, "
                f"remove the old key with: ssh-keygen -R '{_known_hosts_name(hop)}'",
                Failure.SSH_HOST_KEY_CHANGED,
            )
        if isinstance(exc, socket.gaierror):
            return self._error(
                f"cannot resolve the host name {hop.hostname!r}: {exc.strerror}",
                Failure.UNKNOWN_HOST,
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
        if isinstance(exc, paramiko.SSHException) and (
            "SSH protocol banner" in str(exc) or "Indecipherable protocol version" in str(exc)
        ):
            return self._error(
                f"{where} does not speak SSH (no SSH greeting within {timeout_s:g} s): is "
                f"{hop.port} the node's SSH port? ssh:// takes the SSH port first and the "
                "agent's HTTP port second (ssh://user@host:SSH_PORT:HTTP_PORT)"
            )
        return self._error(f"SSH to {where} failed: {exc}")


def _known_hosts_name(hop: SshHop) -> str:
    """The name known_hosts files hold the hop's key under: ``host``, or ``[host]:port``
    for a port other than 22 (as ``ssh`` writes it, and as ``ssh-keygen -R`` finds it)."""
    return hop.hostname if hop.port == DEFAULT_SSH_PORT else f"[{hop.hostname}]:{hop.port}"


def _short_tmp() -> str | None:
    """A temporary directory whose socket paths fit a unix address (108 bytes)."""
    base = tempfile.gettempdir()
    return base if len(base) < 60 else "/tmp"


def _is_auth_failure(exc: BaseException) -> bool:
    return isinstance(exc, paramiko.AuthenticationException) or (
        "No authentication methods available" in str(exc)
    )


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # closed
        return False


# --- one HTTP connection = one channel, pumped by the event loop ---------------------------


class _ChannelBridge(asyncio.Protocol):
    """A unix connection (aiohttp's end) joined to a ``direct-tcpip`` channel.

    Channel -> unix: the channel's readiness pipe is watched by the event loop; each wake-up
    reads what is buffered (non-blocking) and writes it to the unix transport, pausing when
    that transport's buffer is full. Unix -> channel: non-blocking ``send``; when the SSH
    window is full the rest waits (the unix side paused) and is retried shortly after.
    """

    def __init__(self, tunnel: SshTunnel, port: int) -> None:
        self._tunnel = tunnel
        self._port = port
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._channel: paramiko.Channel | None = None
        self._fd: int | None = None
        self._pending = b""  # unix -> channel bytes not yet accepted by the channel
        self._reading = False  # watching the channel's pipe
        self._closed = False
        self._opening: asyncio.Task[None] | None = None

    # unix side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._tunnel._bridges.add(self)
        transport.pause_reading()  # nothing to send to until the channel is open
        self._opening = self._loop.create_task(self._open())

    async def _open(self) -> None:
        try:
            channel = await _in_thread(lambda: self._tunnel._open_channel(self._port))
        except NodeError as err:
            self._tunnel.channel_error = err
            self.abort()
            return
        if self._closed:
            _close_later(channel)
            return
        channel.settimeout(0.0)
        self._channel = channel
        self._fd = channel.fileno()
        self._watch(True)
        if self._transport is not None:
            self._transport.resume_reading()
        self._from_channel()  # anything that arrived before the pipe existed

    def data_received(self, data: bytes) -> None:
        self._pending += data
        self._to_channel()

    def eof_received(self) -> bool:
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.shutdown_write()
        return True  # keep the other direction open until the agent has answered

    def pause_writing(self) -> None:
        self._watch(False)

    def resume_writing(self) -> None:
        self._watch(True)
        self._from_channel()

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    # channel side

    def _watch(self, on: bool) -> None:
        if self._fd is None or self._closed or on == self._reading:
            return
        if on:
            self._loop.add_reader(self._fd, self._from_channel)
        else:
            self._loop.remove_reader(self._fd)
        self._reading = on

    def _from_channel(self) -> None:
        channel, transport = self._channel, self._transport
        if channel is None or transport is None or self._closed:
            return
        for _ in range(_READS_PER_WAKEUP):
            try:
                data = channel.recv(_RECV_BYTES)
            except TimeoutError:  # socket.timeout: nothing buffered now
                return
            except (OSError, EOFError, paramiko.SSHException):
                data = b""
            if not data:  # the agent closed its side
                self._watch(False)
                transport.close()
                return
            transport.write(data)
            if not self._reading:
                return  # the unix side is full: pause_writing stopped the watch

    def _to_channel(self) -> None:
        channel, transport = self._channel, self._transport
        if channel is None or transport is None or self._closed:
            return
        while self._pending:
            try:
                sent = channel.send(self._pending)
            except TimeoutError:  # the SSH window is full: the agent reads slowly
                transport.pause_reading()
                self._loop.call_later(_WINDOW_RETRY_S, self._retry_send)
                return
            except (OSError, EOFError, paramiko.SSHException):
                sent = 0
            if sent == 0:
                self.abort()
                return
            self._pending = self._pending[sent:]

    def _retry_send(self) -> None:
        self._to_channel()
        if not self._pending and self._transport is not None and not self._closed:
            self._transport.resume_reading()

    # end

    def abort(self) -> None:
        transport = self._transport
        if transport is not None:
            transport.abort()
        self._finish()

    def _finish(self) -> None:
        if self._closed:
            return
        self._watch(False)
        self._closed = True
        self._tunnel._bridges.discard(self)
        channel, self._channel = self._channel, None
        if channel is not None:
            _close_later(channel)


def _close_later(channel: paramiko.Channel) -> None:
    """Close a channel off the event loop (paramiko may wait for the transport's lock)."""
    with contextlib.suppress(RuntimeError):  # the pool is gone at interpreter exit
        _executor().submit(channel.close)
