"""What one run of the daemon serves, as one frozen value built by the command line (``cli``).

Defaults are those of nvidia-docker-plugin 1.0 (docs/agent.md, "Flags").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_LISTEN = "localhost:3476"
DEFAULT_VOLUMES = "/var/lib/nvidia-docker/volumes"
DEFAULT_SOCKET_DIR = "/run/docker/plugins"
DEFAULT_LDCACHE = "/etc/ld.so.cache"
DEFAULT_PCIE_INTERVAL_S = 1.0
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"  # asked for GPU processes' container names
DEFAULT_PODMAN_SOCKET = "/run/podman/podman.sock"  # Podman's API service (podman.socket)
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"  # one of the two directories every CDI reader scans
SOCKET_NAME = "nvidia-docker.sock"  # in the socket directory (-s)
# Connection limits of both servers (docs/agent.md, "Limits").
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 1024  # REST API; lowered to the descriptor limit minus the reserve
DEFAULT_RESERVED_FDS = 256


class ListenAddressError(ValueError):
    """A ``-l`` value that is not ``HOST:PORT``; the message says what is expected."""


@dataclass(frozen=True, slots=True)
class Config:
    listen_host: str | None  # None: every interface
    listen_port: int
    volume_dir: Path
    socket_dir: Path
    simulate: str | None
    ldcache: Path
    pcie_interval_s: float = DEFAULT_PCIE_INTERVAL_S
    spec_file: Path | None = None
    docker_socket: Path = Path(DEFAULT_DOCKER_SOCKET)
    podman_socket: Path = Path(DEFAULT_PODMAN_SOCKET)
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    reserved_fds: int = DEFAULT_RESERVED_FDS
    cdi_spec_dir: Path | None = None  # None: no CDI spec (the command line's default is set)
    cdi_dev_root: Path = Path("/")  # where the device nodes the CDI spec names are
    # The REST API's TLS and tokens (agent.edge.access); None: not asked for.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token_file: Path | None = None
    # With TLS or tokens: plain connections to a loopback address need neither.
    plain_loopback: bool = True


def parse_listen(value: str) -> tuple[str | None, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every interface)."""
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ListenAddressError(f"{value!r}: expected HOST:PORT, e.g. localhost:3476")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None), int(port)
