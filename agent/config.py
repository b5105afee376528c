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
SOCKET_NAME = "nvidia-docker.sock"  # in the socket directory (-s)


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
    # The REST API's TLS and tokens (agent.remote_access); None: not asked for.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token_file: Path | None = None


def parse_listen(value: str) -> tuple[str | None, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every interface)."""
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ListenAddressError(f"{value!r}: expected HOST:PORT, e.g. localhost:3476")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None), int(port)
