"""The daemon's two calls into the volume plugin: find the driver files, serve the socket.

The plugin app is served on ``<socket dir>/nvidia-docker.sock`` only, never on TCP: it builds
and deletes files as root and has no authentication. The socket is bound under a temporary
name, given mode 0660, then renamed into place, so it never exists with looser permissions.
Its group is left as the daemon's: the only client is dockerd, which runs as root, and the
``docker`` group needs no access to build volumes (its members reach them through dockerd).

dockerd finds ``.sock`` files only in ``/run/docker/plugins``; for a socket elsewhere it
reads a spec file (``/etc/docker/plugins/nvidia-docker.spec`` containing
``unix://<socket dir>/nvidia-docker.sock``). ``start_plugin_site(..., spec_file=PATH)``
writes one and removes it on cleanup (``--spec-file`` of the daemon; packaging such as the
Ansible role may write it instead).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from pathlib import Path

from aiohttp import web

from agent.config import SOCKET_NAME
from plugin.discovery import DriverFiles, find_driver_files
from plugin.protocol import create_app
from plugin.volumes import VolumeStore

DOCKER_SOCKET_DIR = Path("/run/docker/plugins")
DEFAULT_SPEC_FILE = Path("/etc/docker/plugins/nvidia-docker.spec")
SOCKET_MODE = 0o660
SHUTDOWN_TIMEOUT_S = 5.0

log = logging.getLogger("nvidia-docker-plugin.plugin")


class PluginSiteError(OSError):
    """The socket cannot be served; the message says why and what to do."""


def prepare_volumes(
    volume_dir: Path,
    driver_version: str,
    *,
    ldcache: Path = Path("/etc/ld.so.cache"),
    search_path: str | None = None,
) -> VolumeStore:
    """Find the driver files and open the volume directory. Blocking: run in a thread."""
    store = VolumeStore(volume_dir, _driver_files(driver_version, ldcache, search_path))
    store.clean_stale()
    return store


def refresh_volumes(
    store: VolumeStore,
    driver_version: str,
    *,
    ldcache: Path = Path("/etc/ld.so.cache"),
    search_path: str | None = None,
) -> None:
    """After a driver upgrade: find the new driver's files and serve them from now on (the
    new volume can be created; old names mount it). Blocking: run in a thread."""
    store.use_files(_driver_files(driver_version, ldcache, search_path))


def _driver_files(driver_version: str, ldcache: Path, search_path: str | None) -> DriverFiles:
    files = find_driver_files(driver_version, ldcache=ldcache, search_path=search_path)
    log.info("Driver files found: %s", files.summary())
    if not any(f.component == "libcuda" for f in files.libraries_64):
        log.warning(
            "No libcuda.so.%s in %s: the volume will lack CUDA (run ldconfig?)",
            driver_version,
            ldcache,
        )
    return files


async def start_plugin_site(
    store: VolumeStore, socket_dir: Path, *, spec_file: Path | None = None
) -> web.AppRunner:
    """Serve the plugin on ``<socket_dir>/nvidia-docker.sock``; cleanup removes the socket
    (and ``spec_file``, when one was asked for)."""
    path = socket_dir / SOCKET_NAME
    sock = _bind(path)
    inode = _inode(path)
    app = create_app(store)
    app.on_cleanup.append(lambda _app: _cleanup(path, inode, spec_file))
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
    except BaseException:
        sock.close()
        _remove_own_socket(path, inode)
        raise
    if spec_file is not None:
        write_spec_file(spec_file, path)
    return runner


async def _cleanup(path: Path, inode: int | None, spec_file: Path | None) -> None:
    _remove_own_socket(path, inode)
    if spec_file is not None:
        remove_spec_file(spec_file, path)


def _bind(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(temporary))
        os.chmod(temporary, SOCKET_MODE)
        sock.listen(128)
        os.rename(temporary, path)
    except BaseException:
        sock.close()
        temporary.unlink(missing_ok=True)
        raise
    return sock


def _clear_stale(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse to take over a live one."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise PluginSiteError(
            errno.EEXIST, f"{path} exists and is not a socket: remove it or choose another -s"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("Removing the stale socket %s", path)
        path.unlink(missing_ok=True)
        return
    except OSError:
        pass  # cannot tell: treat as live
    finally:
        probe.close()
    raise PluginSiteError(
        errno.EADDRINUSE,
        f"another process is serving {path} (another agent?): stop it or choose another -s",
    )


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


def _remove_own_socket(path: Path, inode: int | None) -> None:
    """Remove the socket file unless someone else has put theirs there meanwhile."""
    if inode is not None and _inode(path) == inode:
        path.unlink(missing_ok=True)


def spec_file_needed(socket_dir: Path) -> bool:
    """dockerd only scans /run/docker/plugins for sockets; elsewhere it needs a spec file."""
    return os.path.realpath(socket_dir) != os.path.realpath(DOCKER_SOCKET_DIR)


def write_spec_file(spec_file: Path, socket_path: Path) -> None:
    """Write ``unix://<socket>`` atomically (temporary file, then rename)."""
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    temporary = spec_file.with_name(f".{spec_file.name}.{os.getpid()}")
    temporary.write_text(f"unix://{os.path.abspath(socket_path)}\n", encoding="utf-8")
    temporary.chmod(0o644)
    temporary.rename(spec_file)
    log.info("Wrote the plugin spec file %s", spec_file)


def remove_spec_file(spec_file: Path, socket_path: Path) -> None:
    """Remove the spec file if it still points at our socket."""
    with contextlib.suppress(OSError):
        if spec_file.read_text(encoding="utf-8").strip() == f"unix://{socket_path.absolute()}":
            spec_file.unlink()
