"""What one run of the daemon serves: every setting declared once, as a field of ``Config``.

Each field carries its default and, in its metadata, an ``Option``: the flags, the help, the
kind of value and how text becomes it. ``agent.cli`` builds the command line from these
declarations (every option also reads ``NVIDIA_DOCKER_PLUGIN_<LONG FLAG>`` from the
environment; the flag wins), so a setting's name, default, help, type and field are written
in one place. The defaults are those of nvidia-docker-plugin 1.0 where it had the setting
(docs/agent.md, "Flags").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.health.policy import DEFAULT_POLICY, HealthPolicy, parse_health_checks
from cdi.spec import KIND as CDI_KIND
from cdi.spec import valid_kind

SOCKET_NAME = "nvidia-docker.sock"  # in the socket directory (-s)
ENV_PREFIX = "NVIDIA_DOCKER_PLUGIN_"
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
# One of the two directories every CDI reader scans; also where an engine's spec lands.
CDI_SPEC_DIR = "/var/run/cdi"


class ListenAddressError(ValueError):
    """A ``-l`` value that is not ``HOST:PORT``; the message says what is expected."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    host: str | None  # None: every interface
    port: int

    def __str__(self) -> str:
        host = self.host or "*"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def parse_engine_socket(text: str) -> Path:
    """An engine's API socket, as a path or in the ``unix://PATH`` form of ``DOCKER_HOST``
    (click has made ``unix:///x`` the path ``unix:/x`` by then); ``ValueError`` for another
    scheme (``tcp://``, ``ssh://``): the agent asks the engines of its own node, over their
    unix sockets."""
    scheme, colon, rest = text.partition(":")
    if colon and "/" not in scheme and scheme:
        if scheme != "unix":
            raise ValueError(
                f"{text!r}: give the engine's unix socket, as a path or unix://PATH (the "
                "agent asks the engines of its own node, not over TCP or SSH)"
            )
        return Path("/" + rest.lstrip("/"))
    return Path(text)


def parse_listen(value: str) -> ListenAddress:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every interface); an IPv6 address
    without brackets (``::1:3476``) or with unmatched ones is refused."""
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ListenAddressError(f"{value!r}: expected HOST:PORT, e.g. localhost:3476")
    if not 0 < int(port) < 65536:
        raise ListenAddressError(f"{value!r}: port {int(port)} is out of range (1 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or "[" in host or "]" in host:
            raise ListenAddressError(f"{value!r}: expected [IPv6]:PORT, e.g. [::1]:3476")
    elif "[" in host or "]" in host:
        raise ListenAddressError(f"{value!r}: expected [IPv6]:PORT, e.g. [::1]:3476")
    elif ":" in host:  # ::1:3476 is ambiguous; nvidia-docker-plugin 1.0 refused it too
        raise ListenAddressError(
            f"{value!r}: an IPv6 address goes in brackets, with the port after them: "
            "[IPv6]:PORT, e.g. [::1]:3476"
        )
    return ListenAddress(host or None, int(port))


@dataclass(frozen=True, slots=True)
class Option:
    """How a ``Config`` field is given on the command line.

    ``kind``: ``text``, ``dir`` or ``file`` (a path), ``float`` or ``int`` (at least
    ``minimum``), ``choice`` (one of ``choices``), ``switch`` (``--x/--no-x``). ``parse``
    turns the text into the field's value (a ``ValueError``'s message is the one line shown
    for a bad value). ``empty_is_none``: an empty value, on the command line or in the
    environment, turns the setting off (``None``).
    """

    flags: tuple[str, ...]
    help: str
    kind: str = "text"
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    empty_is_none: bool = False

    @property
    def long_flag(self) -> str:
        return next(f for f in self.flags if f.startswith("--")).partition("/")[0]

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.long_flag.removeprefix("--").upper().replace("-", "_")


@dataclass(frozen=True, slots=True)
class LabelKeys:
    """``--usage-labels``: label keys, shown comma separated."""

    keys: tuple[str, ...]

    def __str__(self) -> str:
        return ",".join(self.keys)


def parse_label_keys(text: str) -> LabelKeys:
    """Label keys, comma separated (letters, digits, ``_./-``; at most 16)."""
    keys = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    for key in keys:
        if len(key) > 128 or not all(c.isascii() and (c.isalnum() or c in "_./-") for c in key):
            raise ValueError(f"{key[:40]!r}: a label key is letters, digits and _./- only")
    if len(keys) > 16:
        raise ValueError("at most 16 label keys")
    return LabelKeys(keys)


def parse_idle_after(text: str) -> float:
    """``--idle-after``: finite seconds (click's range lets ``nan`` and ``inf`` through; with
    ``nan`` every held GPU would be idle at its first sweep)."""
    seconds = float(text)
    if not math.isfinite(seconds):
        raise ValueError(f"{text[:20]!r}: give seconds as a finite number, 1 or more (3600)")
    return seconds


def parse_cdi_kind(text: str) -> str:
    """A CDI kind, ``vendor/class``: letters, digits and ``_.-``, each part starting with a
    letter and ending with a letter or digit (the CDI project's rule)."""
    if not valid_kind(text):
        raise ValueError(f"{text[:60]!r}: a CDI kind is vendor/class, e.g. nvidia-docker.com/gpu")
    return text


def _setting(default: Any, *flags: str, help: str, **option: Any) -> Any:
    return field(default=default, metadata={"option": Option(flags, help, **option)})


@dataclass(frozen=True, slots=True)
class Config:
    listen: ListenAddress = _setting(
        ListenAddress("localhost", 3476),
        "-l",
        "--listen",
        help="Address of the REST API (HOST:PORT, [IPv6]:PORT, or :PORT for every interface).",
        parse=parse_listen,
    )
    volume_dir: Path = _setting(
        Path("/var/lib/nvidia-docker/volumes"),
        "-d",
        "--volumes",
        help="Directory where the driver volumes are stored.",
        kind="dir",
    )
    socket_dir: Path = _setting(
        Path("/run/docker/plugins"),
        "-s",
        "--socket-dir",
        help=f"Directory of the plugin socket {SOCKET_NAME}.",
        kind="dir",
    )
    simulate: str | None = _setting(
        None,
        "--simulate",
        help="Serve a simulated node from a node file (or a built-in: h200, h200x2, "
        "hgx-h200-8, h200x2-mig) instead of the GPUs NVML finds. Never used unless given.",
        metavar="FILE",
    )
    ldcache: Path | None = _setting(
        Path("/etc/ld.so.cache"),
        "--ldcache",
        help="The dynamic linker cache that locates the driver's libraries (with --simulate: "
        "only when given, else the simulated node's volume is empty).",
        kind="file",
    )
    spec_file: Path | None = _setting(
        None,
        "--spec-file",
        help="Write this Docker plugin spec file (unix://<socket>) while serving, for a socket "
        "outside /run/docker/plugins; e.g. /etc/docker/plugins/nvidia-docker.spec.",
        kind="file",
    )
    cdi_spec_dir: Path | None = _setting(
        Path(CDI_SPEC_DIR),
        "--cdi-spec-dir",
        help="Write the CDI spec of --cdi-kind's kind (nvidia-docker.json) into this "
        "directory and keep it current, for Podman and Docker 25+; empty: no spec.",
        parse=Path,
        empty_is_none=True,
    )
    cdi_dev_root: Path = _setting(
        Path("/"),
        "--cdi-dev-root",
        help="Where the device nodes and the driver's host files (vendor files, IPC sockets, "
        "firmware) the CDI spec names are on this host (a driver container that makes them "
        "under its own root, e.g. /run/nvidia/driver).",
        kind="dir",
    )
    cdi_kind: str = _setting(
        CDI_KIND,
        "--cdi-kind",
        help="The CDI kind (vendor/class) of the spec's devices. Another than nvidia.com/gpu, "
        "e.g. nvidia-docker.com/gpu, keeps the spec beside NVIDIA's toolkit's (docs/cdi.md).",
        parse=parse_cdi_kind,
        metavar="VENDOR/CLASS",
    )
    pcie_interval_s: float = _setting(
        1.0,
        "--pcie-interval",
        help="Seconds between two samples of the slow counters (PCIe throughput, BAR1 usage).",
        kind="float",
        minimum=0.05,
    )
    health_checks: HealthPolicy = _setting(
        DEFAULT_POLICY,
        "--health-checks",
        help="What makes a GPU (or a MIG device) unhealthy, as NVIDIA's device plugin has it: "
        "all (critical XIDs, double-bit ECC, lost GPUs, row remapping, the driver's "
        "recovery action), xids (XIDs only) or none; then -XID to ignore one, +XID to count "
        "one (e.g. xids,-48,+13). Application XIDs (13, 31, 43, 45, 68, 109) are ignored "
        "unless given with +.",
        parse=parse_health_checks,
        metavar="CHECKS",
    )
    docker_socket: Path = _setting(
        Path("/var/run/docker.sock"),
        "--docker-socket",
        help="The Docker engine's API socket, asked for the name and image of containers "
        "using GPUs (/metrics, /gpu/processes/json). If it does not answer, containers are "
        "shown by id.",
        kind="file",
        parse=parse_engine_socket,
    )
    podman_socket: Path = _setting(
        Path("/run/podman/podman.sock"),
        "--podman-socket",
        help="Podman's API socket (podman system service, the podman.socket unit), asked the "
        "same for Podman containers using GPUs. Without it, they are shown by id.",
        kind="file",
        parse=parse_engine_socket,
    )
    engine_socket: Path | None = _setting(
        None,
        "--engine-socket",
        help="Also serve the Docker Engine API on this unix socket (e.g. "
        "/run/nvidia-docker/docker.sock), forwarded to --docker-socket, where container "
        "creates asking for GPUs (docker run --gpus, Compose) get the node's leases "
        "(docs/engine-socket.md). Root-equivalent, like the engine's socket, whose owner and "
        "mode it takes. Off unless given; empty: off.",
        parse=Path,
        empty_is_none=True,
        metavar="PATH",
    )
    podman_engine_socket: Path | None = _setting(
        None,
        "--podman-engine-socket",
        help="Also serve the Docker Engine API on this unix socket (e.g. "
        "/run/nvidia-docker/podman.sock), forwarded to --podman-socket (Podman's "
        "Docker-compatible service, which ignores GPU requests itself): container creates "
        "asking for GPUs (docker run --gpus, Compose) get the node's leases, as device nodes "
        "and the driver's files (docs/engine-socket.md). Root-equivalent, like Podman's "
        "socket, whose owner and mode it takes. Off unless given; empty: off.",
        parse=Path,
        empty_is_none=True,
        metavar="PATH",
    )
    engine_connections: int = _setting(
        256,
        "--engine-connections",
        help="Most client connections to each engine socket (--engine-socket, "
        "--podman-engine-socket) open at once (each also holds one to the engine); beyond it "
        "a client gets one 503 answer. Their descriptors are kept from REST connections.",
        kind="int",
        minimum=1,
    )
    event_loop: str = _setting(
        "auto",
        "--event-loop",
        help="auto: uvloop when it is installed (faster), else asyncio's own.",
        kind="choice",
        choices=EVENT_LOOPS,
    )
    header_timeout_s: float = _setting(
        10.0,
        "--header-timeout",
        help="Seconds a client has to send a request's header (both servers), from the "
        "connection's opening or the first byte of its next request.",
        kind="float",
        minimum=0.1,
    )
    idle_timeout_s: float = _setting(
        60.0,
        "--idle-timeout",
        help="Seconds a kept-alive connection may wait for its next request (both servers).",
        kind="float",
        minimum=0.1,
    )
    max_connections: int = _setting(
        1024,
        "--max-connections",
        help="Most REST connections open at once (at most the descriptor limit minus "
        "--reserved-fds); beyond it, the one longest without a request is dropped.",
        kind="int",
        minimum=1,
    )
    reserved_fds: int = _setting(
        256,
        "--reserved-fds",
        help="File descriptors kept from REST connections, for the plugin socket, volume "
        "builds and the daemon itself.",
        kind="int",
        minimum=0,
    )
    tls_cert: Path | None = _setting(
        None,
        "--tls-cert",
        help="Serve the REST API over TLS with this PEM certificate (chain); needs "
        "--tls-key. Re-read on SIGHUP.",
        kind="file",
        metavar="FILE",
    )
    tls_key: Path | None = _setting(
        None,
        "--tls-key",
        help="The PEM private key of --tls-cert (mode 0600 or 0640, without a passphrase).",
        kind="file",
        metavar="FILE",
    )
    tls_client_ca: Path | None = _setting(
        None,
        "--tls-client-ca",
        help="Mutual TLS: only clients with a certificate signed by this CA (PEM) get an answer.",
        kind="file",
        metavar="FILE",
    )
    token_file: Path | None = _setting(
        None,
        "--token-file",
        help="Bearer tokens, one per line (two during a rotation): every request must send "
        "one (Authorization: Bearer TOKEN). Re-read on SIGHUP.",
        kind="file",
        metavar="FILE",
    )
    state_dir: Path = _setting(
        Path("/var/lib/nvidia-docker/state"),
        "--state-dir",
        help="Where the agent keeps what must survive a restart: the lease table's state "
        "(leases.json, docs/leases.md) and the usage ledger (usage.db). Made if missing; "
        "one the agent cannot write stops its start.",
        kind="dir",
    )
    lease_pending_s: float = _setting(
        60.0,
        "--lease-pending",
        help="Seconds a granted lease waits for its container to be created before it ends.",
        kind="float",
        minimum=1.0,
    )
    lease_grace_s: float = _setting(
        600.0,
        "--lease-grace",
        help="Seconds a stopped container keeps its lease (its GPUs) before it loses it.",
        kind="float",
        minimum=0.0,
    )
    gpu_sharing: int = _setting(
        1,
        "--gpu-sharing",
        help="How many shared leases one GPU takes at once (1: even a shared ask gets a GPU "
        "alone); an exclusive lease always takes a GPU alone.",
        kind="int",
        minimum=1,
    )
    usage_ledger: bool = _setting(
        True,
        "--usage-ledger/--no-usage-ledger",
        help="Keep the usage ledger (usage.db in --state-dir, docs/usage.md): who held "
        "which GPU, how long and how busy, and which GPUs sit idle.",
        kind="switch",
    )
    usage_db: Path | None = _setting(
        None,
        "--usage-db",
        help="The usage ledger's database file (default: usage.db in --state-dir).",
        kind="file",
        metavar="FILE",
    )
    usage_interval_s: float = _setting(
        10.0,
        "--usage-interval",
        help="Seconds between two sweeps the usage ledger accounts (its figures are within "
        "one interval of the truth).",
        kind="float",
        minimum=0.2,
    )
    usage_retention_days: float = _setting(
        90.0,
        "--usage-retention",
        help="Days the usage ledger keeps a hold after it ended.",
        kind="float",
        minimum=1.0,
    )
    usage_max_mib: int = _setting(
        1024,
        "--usage-max-size",
        help="MiB the usage ledger may take on disk; beyond, its oldest holds go first.",
        kind="int",
        minimum=16,
    )
    usage_labels: LabelKeys = _setting(
        LabelKeys(("com.docker.compose.project", "com.docker.compose.service", "team", "user")),
        "--usage-labels",
        help="The container and lease owner labels the usage ledger records and groups by "
        "(comma separated).",
        parse=parse_label_keys,
        metavar="KEY,KEY",
    )
    idle_after_s: float = _setting(
        3600.0,
        "--idle-after",
        help="Seconds a held GPU may go without utilisation and without a process before "
        "it is idle (docs/usage.md, 'Idle GPUs').",
        kind="float",
        minimum=1.0,
        parse=parse_idle_after,
    )
    idle_policy: str = _setting(
        "notify",
        "--idle-policy",
        help="What happens to an idle GPU's holder: notify (a log line and a metric), "
        "release (a stopped container's lease ends at once) or stop (the container is "
        "stopped); a container's nvidia-docker.idle label overrides it (off: never).",
        kind="choice",
        choices=("notify", "release", "stop"),
    )
    plain_loopback: bool = _setting(
        True,
        "--plain-loopback/--no-plain-loopback",
        help="With TLS or tokens on: connections to a loopback address (curl localhost:3476 "
        "on the node, SSH tunnels) may still use plain HTTP without a token, on the same "
        "port.",
        kind="switch",
    )

    @property
    def listen_host(self) -> str | None:
        return self.listen.host

    @property
    def listen_port(self) -> int:
        return self.listen.port

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / SOCKET_NAME

    @property
    def engine_sockets(self) -> int:
        """How many GPU-aware engine sockets are asked for (``--engine-socket``,
        ``--podman-engine-socket``)."""
        return (self.engine_socket is not None) + (self.podman_engine_socket is not None)


def options() -> list[tuple[str, Option, Any]]:
    """Every setting: (field name, how it is given, its default), in declaration order."""
    return [(f.name, f.metadata["option"], f.default) for f in fields(Config)]


def default(name: str) -> Any:
    """The default of setting ``name`` (for parts that may run outside the daemon)."""
    return next(f.default for f in fields(Config) if f.name == name)
