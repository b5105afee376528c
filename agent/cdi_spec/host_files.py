"""Find on this host the files of ``cdi.host_files`` that a GPU container gets, and each
GPU's DRM nodes.

Everything but the driver's programs is looked up under the dev root (``--cdi-dev-root``,
``/`` unless the driver runs in a container, whose root then holds its files as well as its
device nodes), with symbolic links resolved inside that root (``cdi.rooted``); only what is
there goes into the spec, and each mount names the file as found (links resolved), where the
container sees it. What is used, and checked before it is named:

- the driver's programs: the driver volume's ``bin/<name>`` (the very files the volume
  plugin serves at ``/usr/local/nvidia/bin``), regular files;
- vendor files: the first of ``/etc``, ``/usr/local/share``, ``/usr/share`` that has it,
  a regular file;
- IPC sockets under ``/run`` or ``/var/run``: sockets;
- the MPS pipe directory ``/tmp/nvidia-mps``: a directory owned by root, not a link (``/tmp``
  is everybody's: a directory someone else made there is not mounted into containers);
- GSP firmware ``nvidia/<driver version>/gsp*.bin`` in the kernel's firmware directories
  (``firmware_class.path`` read from ``<root>/sys/module/firmware_class/parameters/path``);
- DRM nodes: the names under ``<root>/sys/bus/pci/devices/<bus id>/drm/`` (``card<N>``,
  ``renderD<N>``) that are character devices at ``<root>/dev/dri/<name>``.

Directory listings are bounded (``MAX_ENTRIES``); nothing is opened but the firmware class
parameter, read within a bound without blocking (``agent.files``). Blocking: run it in a
thread.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent import files
from agent.cdi_spec.inputs import ROOT, device_node
from agent.gpu.model import NodeInfo
from cdi import host_files, rooted, spec
from cdi.host_files import Access, HostMount

MAX_ENTRIES = 512  # a directory listing read in full (firmware and DRM directories hold few)
FIRMWARE_PATH_PARAMETER = "/sys/module/firmware_class/parameters/path"
_PCI_ADDRESS = re.compile(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")
_DRM_NAME = re.compile(r"(card|renderD)\d+")


@dataclass(frozen=True, slots=True)
class HostFiles:
    """What was found: mounts in the spec's order, and each GPU's DRM nodes by index."""

    mounts: tuple[HostMount, ...] = ()
    drm: Mapping[int, tuple[spec.DeviceNode, ...]] = field(default_factory=dict)


def find_host_files(node: NodeInfo, driver_volume: Path | None, dev_root: Path = ROOT) -> HostFiles:
    """Everything of the module docstring that this host has."""
    mounts = [
        *programs(driver_volume),
        *vendor_files(dev_root),
        *ipc(dev_root),
        *gsp_firmware(dev_root, node.driver_version, os.uname().release),
    ]
    drm = {}
    for device in node.devices:
        nodes = drm_nodes(dev_root, device.pci.bus_id) if device.pci.bus_id else ()
        if nodes:
            drm[device.index] = nodes
    return HostFiles(tuple(mounts), drm)


def programs(driver_volume: Path | None) -> list[HostMount]:
    """The driver's programs the volume holds, at ``/usr/bin/<name>``."""
    if driver_volume is None:
        return []
    found = []
    for name in host_files.PROGRAMS:
        path = driver_volume / "bin" / name
        if _is(path, stat.S_ISREG):
            found.append(HostMount(str(path), f"{host_files.PROGRAM_DIR}/{name}"))
    return found


def vendor_files(root: Path) -> list[HostMount]:
    """The EGL, GLX, Vulkan, OpenCL and X11 files of the driver that are here."""
    found = []
    for vendor in host_files.VENDOR_FILES:
        for directory in host_files.CONFIG_DIRS:
            host = _resolved(root, f"{directory}/{vendor.name}", stat.S_ISREG)
            if host is not None:
                found.append(HostMount(str(host), f"{vendor.container_dir}/{vendor.name}"))
                break
    return found


def ipc(root: Path) -> list[HostMount]:
    """The sockets of nvidia-persistenced and the fabric manager, and the MPS pipes."""
    found = []
    for socket in host_files.IPC_SOCKETS:
        for run in host_files.RUN_DIRS:
            where = f"{run}/{socket}"
            host = _resolved(root, where, stat.S_ISSOCK)
            if host is not None:
                found.append(HostMount(str(host), where, Access.TALK))
                break
    mps = rooted.on_host(root, host_files.MPS_PIPE_DIR)
    try:
        st = os.lstat(mps)
    except OSError:
        return found
    if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not _has_link(root, mps):
        found.append(HostMount(str(mps), host_files.MPS_PIPE_DIR, Access.TALK))
    return found


def gsp_firmware(root: Path, driver_version: str, kernel_release: str) -> list[HostMount]:
    """The GSP firmware files of ``driver_version``, where the kernel would load them."""
    found = []
    seen: set[str] = set()
    for directory in host_files.firmware_dirs(kernel_release, _custom_firmware_dir(root)):
        where = host_files.gsp_firmware_dir(directory, driver_version)
        resolved = rooted.resolve(root, where)
        if resolved is None:
            continue
        for name in sorted(_names(rooted.on_host(root, resolved))):
            if not host_files.is_gsp_firmware(name) or f"{where}/{name}" in seen:
                continue
            host = _resolved(root, f"{resolved}/{name}", stat.S_ISREG)
            if host is not None:
                seen.add(f"{where}/{name}")
                found.append(HostMount(str(host), f"{where}/{name}"))
    return found


def sysfs_address(bus_id: str) -> str | None:
    """NVML's PCI bus id (``00000000:18:00.0``) as sysfs names the device (``0000:18:00.0``)."""
    match = _PCI_ADDRESS.fullmatch(bus_id.strip())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def drm_nodes(root: Path, bus_id: str) -> tuple[spec.DeviceNode, ...]:
    """The DRM card and render nodes of the GPU at ``bus_id`` that exist as devices."""
    address = sysfs_address(bus_id)
    if address is None:
        return ()
    names = _names(rooted.on_host(root, f"/sys/bus/pci/devices/{address}/drm"))
    nodes = []
    for name in sorted(n for n in names if _DRM_NAME.fullmatch(n)):
        path = f"/dev/dri/{name}"
        if _is(rooted.on_host(root, path), stat.S_ISCHR):
            nodes.append(device_node(path, root))
    return tuple(nodes)


def _custom_firmware_dir(root: Path) -> str | None:
    try:
        text = files.read_regular(
            rooted.on_host(root, FIRMWARE_PATH_PARAMETER),
            limit=4096,
            what="firmware path",
            kernel=True,
        )
    except files.UnusableFile:
        return None
    value = text.decode(errors="replace").strip()
    return value if value.startswith("/") else None


def _resolved(root: Path, where: str, kind: Callable[[int], bool]) -> Path | None:
    """The host path of ``where`` (links resolved inside ``root``) if it is of ``kind``."""
    resolved = rooted.resolve(root, where)
    if resolved is None:
        return None
    host = rooted.on_host(root, resolved)
    return host if _is(host, kind) else None


def _is(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` (links followed) is of ``kind`` (``stat.S_ISREG``, ...)."""
    try:
        return kind(os.stat(path).st_mode)
    except OSError:
        return False


def _has_link(root: Path, path: Path) -> bool:
    """Whether a component of ``path`` below ``root`` is a symbolic link."""
    here = root
    for part in path.relative_to(root).parts:
        here = here / part
        if here.is_symlink():
            return True
    return False


def _names(directory: Path) -> Iterable[str]:
    names: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if len(names) >= MAX_ENTRIES:
                    break
                names.append(entry.name)
    except OSError:
        return []
    return names
