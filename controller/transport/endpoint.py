"""Which node's agent to ask for GPU facts: the ``NV_HOST`` grammar, as one pure function.

``parse_endpoint(value)`` turns one address into a frozen ``Endpoint``; ``resolve(options)``
applies the environment rules of ``nvidia-docker`` (docs/nvidia-docker.md, ``NV_HOST``) on
top of it, from the options the command's edge built (``controller.options``). The fleet
tool and the Mesos launch helper parse node names with the same function,
so a node name means the same thing everywhere.

Grammar::

    [scheme://][user@][host][:port_1][:port_2]

    scheme   ssh | http | https | tcp (no scheme: tcp) | unix (local node; the rest is ignored)
    path     none, or a single / after the host or port (a pasted URL's root: the same
             node); any other path is refused
    host     a name, an IPv4 address or an [IPv6] address in brackets; default localhost.
             A link-local address takes its zone (the interface) after %, as ip and ssh
             write it ([fe80::1%eth0]) or as RFC 6874 writes it in URLs ([fe80::1%25eth0]):
             both are the zone eth0. A zone is letters, digits and -._~; one that starts
             with 25 is read as RFC 6874's (%251 is the zone 1; the zone 25 alone: %25)
    ports    ssh:       port_1 is the SSH port (default 22), port_2 the agent's HTTP port
                        (default 3476) on the node's localhost
             http, https, tcp: the HTTP port is the last port given (default 3476); the
                        SSH port means nothing there and is ignored. https: the agent
                        serves TLS (its --tls-cert); the client checks its certificate
    user     ssh only; default the ``user`` given (the edge's $USER)

Rules on top (``resolve``): ``NV_HOST`` wins over the docker address (``--context``, ``-H``/
``--host`` on the command line, ``DOCKER_HOST``, ``DOCKER_CONTEXT``, ``docker context use``,
in docker's order); neither set means the local node; ``NV_HOST`` set while
docker has no address gets a warning (docker would run the container on the local daemon).
When the address came from docker rather than ``NV_HOST``, its port is docker's, so the agent's
HTTP port is always 3476.

Examples (``parse_endpoint``)::

    "10.0.0.1:"                  http  10.0.0.1   http 3476       (tcp:// assumed)
    "http://127.0.0.1:8080"      http  127.0.0.1  http 8080
    "http://127.0.0.1:8080:"     http  127.0.0.1  http 8080
    "http://127.0.0.1:8080/"     http  127.0.0.1  http 8080
    "https://node3:3476"         http  node3      https 3476 (TLS)
    "tcp://node1:22:80"          http  node1      http 80
    "ssh://10.0.0.1:"            ssh   10.0.0.1   ssh 22, tunnel to localhost:3476, user $USER
    "ssh://admin@node2:2222"     ssh   node2      ssh 2222, localhost:3476, user admin
    "ssh://admin@[fd00::5]:22:80" ssh  fd00::5    ssh 22, localhost:80
    "http://[fe80::1%25eth0]:3476" http fe80::1%eth0  http 3476, on the link of eth0
    "unix:///run/docker.sock"    local
    "ftp://x"                    EndpointError: invalid remote host URI ...

Compared with nvidia-docker 1.0: the bare host (``10.0.0.1``) is accepted as well as the
trailing colon form (``10.0.0.1:``), and a lone port after an ``http``/``tcp`` host is the HTTP
port (1.0 read ``host:N:`` as an SSH port and ignored it). 1.0 ignored any path after the
host; here only a trailing ``/`` is, and another path (``tcp://host:2375/v1``) is refused.
"""

from __future__ import annotations

from controller.errors import EndpointError
from controller.record import field, record

TYPE_CHECKING = False  # typing, ipaddress: not imported on the wrapper's run path
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Literal

    from controller.options import Options

    Transport = Literal["local", "http", "ssh"]
    _Invalid = Callable[[str], EndpointError]

DEFAULT_HOST = "localhost"
DEFAULT_SSH_PORT = 22
DEFAULT_HTTP_PORT = 3476

_SCHEMES: dict[str, Transport] = {"tcp": "http", "http": "http", "https": "http", "ssh": "ssh"}
# What may be written where, checked without re (the wrapper's run path imports no re:
# docs/nvidia-docker.md, "Speed"): a scheme ([A-Za-z][A-Za-z0-9+.-]*), a user
# ([A-Za-z0-9._][A-Za-z0-9._-]*, an optional final $), a host name ([A-Za-z0-9_.-]+), a
# port (one to five digits).
_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_DIGITS = frozenset("0123456789")
_SCHEME_CHARACTERS = _LETTERS | _DIGITS | frozenset("+.-")
_NAME_CHARACTERS = _LETTERS | _DIGITS | frozenset("_.-")
_ZONE_CHARACTERS = _LETTERS | _DIGITS | frozenset("-._~")  # RFC 6874's unreserved

SYNTAX_HINT = (
    "use [ssh://|http://|https://|tcp://][user@][host][:ssh_port][:http_port], "
    "e.g. ssh://admin@10.0.0.1: or https://10.0.0.1:3476"
)


@record
class Endpoint:
    """Where a node's agent answers, and how to get there.

    ``transport`` is ``local`` (this machine: agent on localhost, else NVML), ``http``
    (``http://host:http_port``) or ``ssh`` (SSH to ``host:ssh_port`` as ``user``, then
    ``localhost:http_port`` on that node). ``host`` is what sockets and SSH take: an IPv6
    address without brackets, its zone after ``%`` (``fe80::1%eth0``). ``source`` says where
    the value came from;
    ``tls``: HTTPS to the agent (``https://``). ``ssh_defaults`` names the SSH settings that
    were not written (``user``, ``ssh_port``): ``~/.ssh/config`` may then supply them, as
    OpenSSH lets a value on the command line win over the file.
    """

    transport: Transport
    host: str = DEFAULT_HOST
    ssh_port: int = DEFAULT_SSH_PORT
    http_port: int = DEFAULT_HTTP_PORT
    user: str | None = None
    source: str = "default"
    tls: bool = False
    ssh_defaults: frozenset[str] = field(default=frozenset(), compare=False)

    def __init__(  # written out: a fleet parses thousands (record's own takes twice as long)
        self,
        transport: Transport,
        host: str = DEFAULT_HOST,
        ssh_port: int = DEFAULT_SSH_PORT,
        http_port: int = DEFAULT_HTTP_PORT,
        user: str | None = None,
        source: str = "default",
        tls: bool = False,
        ssh_defaults: frozenset[str] = frozenset(),
    ) -> None:
        store = object.__setattr__
        store(self, "transport", transport)
        store(self, "host", host)
        store(self, "ssh_port", ssh_port)
        store(self, "http_port", http_port)
        store(self, "user", user)
        store(self, "source", source)
        store(self, "tls", tls)
        store(self, "ssh_defaults", ssh_defaults)

    @property
    def scheme(self) -> str:
        """``http`` or ``https``: how the agent is spoken to. Over SSH, TLS inside the tunnel
        only when ``tls`` is set (an inventory whose agents serve TLS on their loopback)."""
        return "https" if self.tls and self.transport != "local" else "http"

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @property
    def url_host(self) -> str:
        """The host as written in a URL and in messages: IPv6 addresses in brackets, a zone
        as ``%eth0`` (the form aiohttp connects to, and curl takes as well as ``%25eth0``)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def server_name(self) -> str:
        """The host as the agent's TLS certificate must name it: ``host`` without an IPv6
        zone (``fe80::1%eth0`` -> ``fe80::1``), which means something on this machine only."""
        return self.host.partition("%")[0]

    @property
    def host_header(self) -> str:
        """The ``Host`` header of a request to the agent over ``http``: ``server_name`` (in
        brackets for IPv6) and the HTTP port, the zone left out as curl and Go leave it out."""
        name = self.server_name
        return f"[{name}]:{self.http_port}" if ":" in name else f"{name}:{self.http_port}"

    @property
    def agent_url(self) -> str:
        """The agent's base URL as the node itself sees it (ssh: the node's localhost)."""
        if self.transport == "http":
            return f"{self.scheme}://{self.url_host}:{self.http_port}"
        return f"{self.scheme}://localhost:{self.http_port}"

    @property
    def node(self) -> str:
        """A short name of the node for messages: ``10.0.0.1:3476``, ``admin@node2:2222``."""
        if self.transport == "ssh":
            return f"{self.user}@{self.url_host}:{self.ssh_port}"
        if self.transport == "http":
            return f"{self.url_host}:{self.http_port}"
        return "local node"

    def uri(self) -> str:
        """The canonical spelling, which ``parse_endpoint`` reads back to the same endpoint;
        a zone as RFC 6874 writes it in a URL (``[fe80::1%25eth0]``)."""
        host = self.url_host.replace("%", "%25", 1)
        if self.transport == "ssh":
            return f"ssh://{self.user}@{host}:{self.ssh_port}:{self.http_port}"
        if self.transport == "http":
            return f"{self.scheme}://{host}:{self.http_port}"
        return "unix://"

    def describe(self) -> str:
        """Lines for an operator (``nvidia-docker-ctl endpoint``)."""
        if self.transport == "ssh":
            route = (
                f"SSH to {self.url_host}:{self.ssh_port} as {self.user}, "
                f"then {self.agent_url} on that node"
            )
        elif self.transport == "http":
            route = f"{self.scheme.upper()} to {self.agent_url}"
        else:
            route = (
                f"this machine: the agent on {self.agent_url} if it answers, else NVML; "
                "docker volume inspect for the driver volume"
            )
        rows = [
            ("transport", self.transport),
            ("host", self.host),
            ("ssh_port", str(self.ssh_port) if self.transport == "ssh" else "-"),
            ("http_port", str(self.http_port)),
            ("tls", "yes" if self.scheme == "https" else "no"),
            ("user", self.user or "-"),
            ("source", self.source),
            ("uri", self.uri()),
            ("route", route),
        ]
        return "\n".join(f"{key:<10} {value}" for key, value in rows)

    def as_dict(self) -> dict[str, str | int | None]:
        return {
            "transport": self.transport,
            "host": self.host,
            "ssh_port": self.ssh_port,
            "http_port": self.http_port,
            "tls": self.scheme == "https",
            "user": self.user,
            "source": self.source,
            "uri": self.uri(),
        }


LOCAL = Endpoint(transport="local")


def parse_endpoint(
    value: str,
    *,
    source: str = "argument",
    docker_address: bool = False,
    user: str | None = None,
    http_port: int = DEFAULT_HTTP_PORT,
) -> Endpoint:
    """Parse one address (see the module docstring); raises ``EndpointError``.
    ``http_port``: the port where the value names none (the agent's, 3476, unless given).

    ``docker_address``: the value is docker's daemon address (``DOCKER_HOST``, ``-H``), whose
    port is docker's; the agent's HTTP port is then always 3476. ``user`` is the SSH user when
    the value names none (``Options.user``: ``$USER``); an ``ssh://`` value without a user
    needs it.
    """

    def invalid(why: str) -> EndpointError:
        where = f" ({source})" if source != "argument" else ""
        return EndpointError(f"invalid remote host URI {value!r}{where}: {why}; {SYNTAX_HINT}")

    text = value.strip()
    named, separator, after = text.partition("://")
    if separator and _is_scheme(named):
        scheme, rest = named.lower(), after
    else:
        scheme, rest = "tcp", text
    if scheme == "unix":
        return Endpoint(transport="local", source=source)
    transport = _SCHEMES.get(scheme)
    if transport is None:
        raise invalid(f"unknown scheme {scheme}://")
    if rest.endswith("/") and len(rest) > 1:  # a pasted URL's root path: the same node
        rest = rest[:-1]
    if "/" in rest:
        raise invalid("a path is not allowed after the host")

    login, at, address = rest.rpartition("@")
    if at and not _is_user(login):
        raise invalid(f"bad user name {login!r}")
    if at and transport != "ssh":
        raise invalid("a user name only makes sense with ssh://")
    written = set()
    if at:
        written.add("user")

    host, ports = _split_host(address, invalid)
    numbers = [_port(field, invalid) for field in ports]
    ssh_port = DEFAULT_SSH_PORT
    if transport == "ssh":
        if numbers and numbers[0] is not None:
            ssh_port = numbers[0]
            written.add("ssh_port")
        if len(numbers) == 2 and numbers[1] is not None:
            http_port = numbers[1]
    else:
        given = [n for n in numbers if n is not None]
        if given:
            http_port = given[-1]
    if docker_address:
        http_port = DEFAULT_HTTP_PORT
    if transport == "ssh" and not login and user is None:
        raise ValueError(f"parse_endpoint({value!r}): an ssh:// address needs the default user")
    return Endpoint(
        transport=transport,
        host=host or DEFAULT_HOST,
        ssh_port=ssh_port,
        http_port=http_port,
        user=(login or user) if transport == "ssh" else None,
        source=source,
        tls=scheme == "https",
        ssh_defaults=frozenset({"user", "ssh_port"} - written)
        if transport == "ssh"
        else frozenset(),
    )


def _is_scheme(text: str) -> bool:
    return text[:1] in _LETTERS and set(text) <= _SCHEME_CHARACTERS


def _is_user(text: str) -> bool:
    name = text.removesuffix("$")
    return _is_name(name) and name[0] != "-"


def _is_name(text: str) -> bool:
    return bool(text) and set(text) <= _NAME_CHARACTERS


def _is_port(text: str) -> bool:
    return 0 < len(text) <= 5 and set(text) <= _DIGITS


def _split_host(address: str, invalid: _Invalid) -> tuple[str, list[str]]:
    """``host[:a][:b]`` -> (host, ["a", "b"]); brackets removed from an IPv6 host."""
    if address.startswith("["):
        end = address.find("]")
        if end < 0:
            raise invalid("missing ] after the IPv6 address")
        host, rest = _zone_unescaped(address[1:end], invalid), address[end + 1 :]
        if not is_ipv6(host):
            raise invalid(f"{host!r} is not an IPv6 address")
        if rest and not rest.startswith(":"):
            raise invalid("expected : after the ] of the IPv6 address")
        ports = rest[1:].split(":") if rest else []
    else:
        if address.count(":") >= 2 and (is_ipv6(address) or is_ipv6(address.rstrip(":"))):
            raise invalid("write an IPv6 address in brackets, e.g. [fd00::1]:")
        host, sep, tail = address.partition(":")
        if host and not _is_name(host):
            raise invalid(f"bad host {host!r}")
        ports = tail.split(":") if sep else []
    if len(ports) > 2:
        raise invalid("at most two ports (ssh_port and http_port)")
    return host, ports


def _zone_unescaped(text: str, invalid: _Invalid) -> str:
    """``fe80::1%25eth0`` (RFC 6874, in URLs) and ``fe80::1%eth0`` -> ``fe80::1%eth0``; a
    zone of other characters than ``_ZONE_CHARACTERS`` is refused."""
    address, percent, zone = text.partition("%")
    if not percent:
        return text
    if zone.startswith("25") and len(zone) > 2:
        zone = zone[2:]
    if not zone or not set(zone) <= _ZONE_CHARACTERS:
        raise invalid(
            f"bad zone {zone!r} after the % of {address}: give the interface, e.g. "
            "[fe80::1%eth0] or [fe80::1%25eth0]"
        )
    return f"{address}%{zone}"


def is_ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address, without brackets; a zone (``%eth0``) may follow,
    as ``ipaddress`` reads it."""
    import ipaddress  # noqa: PLC0415 (IPv6 only)

    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _port(field: str, invalid: _Invalid) -> int | None:
    if field == "":
        return None
    if not _is_port(field) or not 0 < int(field) < 65536:
        raise invalid(f"bad port {field!r} (1 to 65535)")
    return int(field)


def resolve(
    options: Options,
    *,
    docker_host_option: str | None = None,
    docker_context_option: str | None = None,
    docker_reads_docker_host: bool = True,
) -> tuple[Endpoint, str | None]:
    """The node ``nvidia-docker`` asks, from ``NV_HOST``, else the daemon docker would use.

    Returns the endpoint and a warning to print (or None). ``docker_host_option`` is the value
    of ``-H``/``--host`` on docker's command line, ``docker_context_option`` that of
    ``--context``/``-c``; docker's own order then applies (``--context``, ``-H``,
    ``DOCKER_HOST``, ``DOCKER_CONTEXT``, ``docker context use``:
    ``controller.transport.docker_context``). ``docker_reads_docker_host``: False for an
    engine that does not take its daemon from docker's settings (Podman): docker's address
    then chooses nothing (the node is ``NV_HOST``'s, else the local one, where Podman runs
    the container) and ``NV_HOST`` gets no warning about ``DOCKER_HOST``.
    """
    from controller.transport.docker_context import docker_address  # noqa: PLC0415

    nv_host = (options.nv_host or "").strip()
    if nv_host:
        endpoint = parse_endpoint(nv_host, source="NV_HOST", user=options.user)
        warning = None
        if (
            docker_reads_docker_host
            and not endpoint.is_local
            and docker_address(options, docker_host_option, docker_context_option) is None
        ):
            warning = (
                "NV_HOST is set but DOCKER_HOST is not: docker will use the local daemon "
                "while the GPUs come from " + endpoint.node + "; set DOCKER_HOST or -H too"
            )
        return endpoint, warning
    if not docker_reads_docker_host:
        return LOCAL, None
    docker = docker_address(options, docker_host_option, docker_context_option)
    if docker is not None:
        address, source = docker
        endpoint = parse_endpoint(address, source=source, docker_address=True, user=options.user)
        return endpoint, None
    return LOCAL, None
