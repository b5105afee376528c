"""``nvidia-docker-cdi-hook``: the createContainer hook of our CDI spec (docs/cdi.md).

    nvidia-docker-cdi-hook update-ldcache --ldconfig /sbin/ldconfig \\
        --folder /usr/local/nvidia/lib64 --folder /usr/local/nvidia/lib \\
        --host-driver-version 580.159.04

The OCI runtime runs it after the container's mounts are made (the driver volume at
``/usr/local/nvidia`` among them) and before the container's process starts, with the
container's state on standard input. It makes the driver's libraries loadable by their
sonames (``ctypes.CDLL("libcuda.so.1")``) in images that do not set ``LD_LIBRARY_PATH``:

1. reads the bundle's ``config.json`` for the container's root filesystem;
2. writes ``/etc/ld.so.conf.d/00-nvidia-docker.conf`` naming the folders, when the image
   has that directory, so that an ``ldconfig`` run later inside the container (a package
   install) keeps them;
3. runs the *host's* ``ldconfig -r <root> <folders>``: ldconfig chroots into the root
   before it reads or writes anything, and the host's binary runs, never one of the image.

With ``--host-driver-version``, an image whose CUDA forward compatibility libraries are
newer than the host's driver (``cdi.cuda_compat``) gets their directory as the first folder:
ldconfig puts the libraries of its first folder first in the cache, and the dynamic linker
takes the first ``libcuda.so.1`` it finds there.

No path of the image is followed out of its root: the conf file is opened one directory at
a time without following symbolic links, and ldconfig works inside its chroot.

A failure of steps 2 and 3 (an image without ``/etc``, a read-only root) is reported on
standard error and the hook still exits 0: the container starts, with the driver at
``/usr/local/nvidia`` as the volume plugin gives it. Only a call that is not a runtime's
(bad arguments, no state on standard input) exits non-zero.

The runtime runs hooks with an empty environment, so every program is named by its path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from cdi import cuda_compat

PROG = "nvidia-docker-cdi-hook"
CONF_DIR = ("etc", "ld.so.conf.d")
CONF_NAME = "00-nvidia-docker.conf"
LDCONFIG_TIMEOUT_S = 20


class HookError(Exception):
    """The hook was not called as a runtime calls it: one line, exit status 1."""


def _say(message: str) -> None:
    sys.stderr.write(f"{PROG}: {message}\n")


def container_root(state_text: str) -> Path:
    """The container's root filesystem, from the OCI state (``bundle``) and the bundle's
    ``config.json`` (``root.path``, relative to the bundle unless absolute)."""
    try:
        state = json.loads(state_text)
        bundle = Path(state["bundle"])
    except (ValueError, KeyError, TypeError):
        raise HookError("no OCI container state with a 'bundle' on standard input") from None
    try:
        config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
        root = Path(config["root"]["path"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HookError(f"cannot read root.path of {bundle / 'config.json'}: {err}") from None
    return root if root.is_absolute() else bundle / root


def write_conf(root: Path, folders: Sequence[str]) -> bool:
    """Write the conf file under ``root`` without following any symbolic link; False when
    it cannot be opened there (no real ``/etc/ld.so.conf.d`` in the image, a read-only
    root), which is not reported."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fds: list[int] = []
    try:
        fds.append(os.open(root, flags))
        for part in CONF_DIR:
            fds.append(os.open(part, flags, dir_fd=fds[-1]))
        fd = os.open(
            CONF_NAME,
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=fds[-1],
        )
    except OSError:
        return False
    finally:
        for opened in fds:
            os.close(opened)
    with os.fdopen(fd, "w", encoding="utf-8") as conf:
        conf.write("# The NVIDIA driver, mounted by the nvidia.com/gpu CDI spec\n")
        conf.writelines(f"{folder}\n" for folder in folders)
    return True


def update_ldcache(root: Path, ldconfig: str, folders: Sequence[str]) -> bool:
    """Rebuild the container's linker cache with the host's ldconfig; False (and a line on
    standard error) when that failed."""
    try:
        write_conf(root, folders)
    except OSError as err:
        _say(f"cannot write /{'/'.join(CONF_DIR)}/{CONF_NAME}: {err.strerror or err}")
    try:
        done = subprocess.run(
            [ldconfig, "-r", str(root), *folders],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=LDCONFIG_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        _say(f"{ldconfig} failed: {err}; libraries load only through LD_LIBRARY_PATH")
        return False
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        _say(f"{ldconfig} -r {root} failed: {detail}; libraries load only through LD_LIBRARY_PATH")
        return False
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="The createContainer hook of the nvidia.com/gpu CDI spec."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    update = commands.add_parser(
        "update-ldcache", help="add folders to the container's linker cache"
    )
    update.add_argument("--ldconfig", required=True, help="the host's ldconfig (a path)")
    update.add_argument(
        "--folder", action="append", required=True, help="a library directory in the container"
    )
    update.add_argument(
        "--host-driver-version",
        help="the host driver's version: an image's newer CUDA compat libraries go first",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``nvidia-docker-cdi-hook``."""
    args = _parser().parse_args(argv)
    try:
        root = container_root(sys.stdin.read())
    except HookError as err:
        _say(str(err))
        return 1
    folders = list(args.folder)
    if args.host_driver_version:
        compat = cuda_compat.compat_dir(root, args.host_driver_version)
        if compat is not None:
            folders.insert(0, compat)
    update_ldcache(root, args.ldconfig, folders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
