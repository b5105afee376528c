"""A CDI spec of kind ``nvidia.com/gpu`` from a node's facts, as plain values.

The document, for a node with GPUs 0 and 1 (GPU 0 in MIG mode with one MIG device)::

    cdiVersion      the lowest version whose features it uses (``minimum_version``)
    kind            nvidia.com/gpu (``SpecInputs.kind``: another with --cdi-kind)
    devices         "0", "GPU-<uuid>"           /dev/nvidia0 + the capability nodes of its MIG
                                                devices + its DRM nodes (/dev/dri/card1, ...)
                    "0:0", "MIG-<uuid>"         /dev/nvidia0 + that MIG device's two nodes
                    "1", "GPU-<uuid>"           /dev/nvidia1 + its DRM nodes
                    "all"                       every healthy GPU, as above
    containerEdits  env (NVIDIA_VISIBLE_DEVICES=void: a legacy runtime adds nothing more),
                    the control nodes (/dev/nvidiactl, /dev/nvidia-uvm[, -tools, -modeset]),
                    the driver volume mounted read-only at /usr/local/nvidia, then the host
                    files of ``cdi.host_files`` that were found (programs at /usr/bin,
                    vendor files, IPC sockets, GSP firmware), and a createContainer hook
                    that adds the volume's library directories (and an image's newer CUDA
                    forward compatibility libraries) to the container's linker cache
                    (``cdi.hook``), so that ``libcuda.so.1`` loads by its soname without
                    LD_LIBRARY_PATH

Only fields of CDI 0.3.0 to 0.5.0 are used, so that old parsers (Podman 4.3 of Debian 12
reads up to 0.5.0 and refuses unknown fields) accept it: names starting with a digit and
``hostPath`` of device nodes are 0.5.0; no annotations (0.6.0), no mount ``type`` (0.4.0,
not needed: ``bind`` in the options makes a bind mount); ``env`` is 0.3.0. A ``--cdi-kind``
whose class has a ``.`` (``example.com/gpu.v2``) is 0.6.0, and the spec then says so.

A device that cannot be named (no device node, a UUID CDI does not allow as a name) is left
out and said so in ``BuiltSpec.left_out``; nothing is dropped silently.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cdi.host_files import HostMount

KIND = "nvidia.com/gpu"
ALL = "all"
MOUNTPOINT = "/usr/local/nvidia"  # where containers see the driver volume
LIBRARY_DIRS = ("lib64", "lib")  # of the driver volume: 64-bit, then 32-bit
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
HOOK_NAME = "createContainer"
HOOK_TIMEOUT_S = 30
HOOK_COMMAND = "update-ldcache"
# Images that set NVIDIA_VISIBLE_DEVICES=all (nvidia/cuda) would make a default
# nvidia-container-runtime add every GPU again; "void" tells it to add nothing.
VOID_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES=void"

# The released spec versions whose features a document of ours may need, oldest first.
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0")

# CDI device names (every version since 0.5.0: a digit may start them).
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")
# A kind, vendor/class: each starts with a letter, ends with a letter or digit.
_KIND_PART = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_KIND = re.compile(f"{_KIND_PART}/{_KIND_PART}")


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node for the container at ``path``; ``host_path`` where it is on the host
    when that differs (a driver container's dev root)."""

    path: str
    host_path: str | None = None


@dataclass(frozen=True, slots=True)
class MigInstance:
    index: int  # NVML's MIG device index on its GPU
    uuid: str | None
    nodes: tuple[DeviceNode, ...]  # its capability nodes; empty: it cannot be given
    healthy: bool = True  # withdrawn on its own (its GPU healthy): it keeps its names, leaves "all"


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str | None
    node: DeviceNode | None  # None: the device node is unknown (NVML could not open it)
    healthy: bool = True  # an unhealthy GPU keeps its names but leaves "all"
    mig: tuple[MigInstance, ...] = ()
    drm: tuple[DeviceNode, ...] = ()  # its DRM card and render nodes (whole GPU only)


@dataclass(frozen=True, slots=True)
class LinkerCacheHook:
    """The hook program (absolute path on the host) and the host's ``ldconfig``."""

    program: str
    ldconfig: str


@dataclass(frozen=True, slots=True)
class SpecInputs:
    gpus: tuple[Gpu, ...]
    control_nodes: tuple[DeviceNode, ...]
    driver_volume: str | None  # host directory of the driver volume; None: no driver files
    hook: LinkerCacheHook | None = None  # None: no linker cache update
    kind: str = KIND
    env: tuple[str, ...] = ()  # NAME=value for every container
    host_files: tuple[HostMount, ...] = ()  # mounted after the driver volume, in order
    # the host driver's version, for the hook's CUDA forward compatibility check
    driver_version: str | None = None


@dataclass(frozen=True, slots=True)
class BuiltSpec:
    document: dict[str, Any]
    left_out: tuple[str, ...]  # one line per device left out, saying why

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(device["name"] for device in self.document["devices"])


def valid_name(name: str) -> bool:
    """Whether CDI accepts ``name`` as a device name."""
    return bool(_NAME.fullmatch(name))


def valid_kind(kind: str) -> bool:
    """Whether CDI accepts ``kind`` (``vendor/class``, e.g. ``nvidia.com/gpu``)."""
    return bool(_KIND.fullmatch(kind))


def qualified(name: str, kind: str = KIND) -> str:
    """``nvidia.com/gpu=<name>``, what ``--device`` takes."""
    return f"{kind}={name}"


def gpu_name(gpu: Gpu) -> str | None:
    """The name a GPU is best asked for by: its UUID (stable across reboots and index
    changes), else its index; None when the spec has no device for it."""
    if gpu.node is None:
        return None
    return gpu.uuid if gpu.uuid and valid_name(gpu.uuid) else str(gpu.index)


def mig_name(gpu: Gpu, mig: MigInstance) -> str | None:
    """The name a MIG device is best asked for by: its UUID, else ``<gpu>:<mig>``."""
    if gpu.node is None or not mig.nodes:
        return None
    return mig.uuid if mig.uuid and valid_name(mig.uuid) else f"{gpu.index}:{mig.index}"


def build_spec(inputs: SpecInputs) -> BuiltSpec:
    """The CDI document for ``inputs`` (see the module docstring)."""
    devices: list[dict[str, Any]] = []
    left_out: list[str] = []
    everything: list[DeviceNode] = []
    for gpu in inputs.gpus:
        if gpu.node is None:
            left_out.append(f"GPU {gpu.index}: its device node is unknown (NVML cannot open it)")
            continue
        nodes = [gpu.node, *(node for mig in gpu.mig for node in mig.nodes), *gpu.drm]
        devices += _named(_names(str(gpu.index), gpu.uuid, f"GPU {gpu.index}", left_out), nodes)
        if gpu.healthy:
            everything += [
                node for node in nodes
                if not any(node in mig.nodes for mig in gpu.mig if not mig.healthy)
            ]  # fmt: skip
            left_out += [
                f"GPU {gpu.index} MIG device {mig.index}: unhealthy, not in {ALL!r}"
                for mig in gpu.mig
                if not mig.healthy
            ]
        else:
            left_out.append(f"GPU {gpu.index}: unhealthy, not in {ALL!r}")
        for mig in gpu.mig:
            where = f"GPU {gpu.index} MIG device {mig.index}"
            if not mig.nodes:
                left_out.append(f"{where}: its capability nodes are unknown")
                continue
            names = _names(f"{gpu.index}:{mig.index}", mig.uuid, where, left_out)
            devices += _named(names, [gpu.node, *mig.nodes])
    if everything:
        devices += _named([ALL], everything)
    document: dict[str, Any] = {"cdiVersion": "", "kind": inputs.kind, "devices": devices}
    edits = _common_edits(inputs)
    if edits:
        document["containerEdits"] = edits
    document["cdiVersion"] = minimum_version(document)
    return BuiltSpec(document, tuple(left_out))


def _names(index_name: str, uuid: str | None, where: str, left_out: list[str]) -> list[str]:
    names = [index_name]
    if uuid and valid_name(uuid):
        names.append(uuid)
    elif uuid:
        left_out.append(f"{where}: UUID {uuid!r} is not a CDI device name; use {index_name!r}")
    return names


def _named(names: Iterable[str], nodes: Sequence[DeviceNode]) -> list[dict[str, Any]]:
    unique = _unique(nodes)
    return [
        {"name": name, "containerEdits": {"deviceNodes": [_node(node) for node in unique]}}
        for name in names
    ]


def _unique(nodes: Iterable[DeviceNode]) -> list[DeviceNode]:
    seen: set[str] = set()
    unique = []
    for node in nodes:
        if node.path not in seen:
            seen.add(node.path)
            unique.append(node)
    return unique


def _node(node: DeviceNode) -> dict[str, str]:
    entry = {"path": node.path}
    if node.host_path and node.host_path != node.path:
        entry["hostPath"] = node.host_path
    return entry


def _common_edits(inputs: SpecInputs) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    if inputs.env:
        edits["env"] = list(dict.fromkeys(inputs.env))
    if inputs.control_nodes:
        edits["deviceNodes"] = [_node(node) for node in _unique(inputs.control_nodes)]
    mounts = []
    if inputs.driver_volume is not None:
        mounts.append(_mount(inputs.driver_volume, MOUNTPOINT, MOUNT_OPTIONS))
    seen = {MOUNTPOINT}
    for file in inputs.host_files:
        if file.container_path not in seen:
            seen.add(file.container_path)
            mounts.append(_mount(file.host_path, file.container_path, file.access.value))
    if mounts:
        edits["mounts"] = mounts
    if inputs.driver_volume is not None and inputs.hook is not None:
        edits["hooks"] = [_hook(inputs.hook, inputs.driver_version)]
    return edits


def _mount(host_path: str, container_path: str, options: Sequence[str]) -> dict[str, Any]:
    return {"hostPath": host_path, "containerPath": container_path, "options": list(options)}


def _hook(hook: LinkerCacheHook, driver_version: str | None) -> dict[str, Any]:
    args = [posixpath.basename(hook.program), HOOK_COMMAND, "--ldconfig", hook.ldconfig]
    for sub in LIBRARY_DIRS:
        args += ["--folder", f"{MOUNTPOINT}/{sub}"]
    if driver_version:
        args += ["--host-driver-version", driver_version]
    return {"hookName": HOOK_NAME, "path": hook.program, "args": args, "timeout": HOOK_TIMEOUT_S}


def minimum_version(document: Mapping[str, Any]) -> str:
    """The lowest CDI version whose features ``document`` uses (the CDI project's version
    table: ``type`` of mounts 0.4.0; device names starting with a digit and ``hostPath`` of
    device nodes 0.5.0; annotations, and a ``.`` in the kind's class, 0.6.0)."""
    devices = document.get("devices") or []
    all_edits = [document.get("containerEdits") or {}]
    all_edits += [device.get("containerEdits") or {} for device in devices]
    if document.get("annotations") or any(device.get("annotations") for device in devices):
        return "0.6.0"
    if "." in str(document.get("kind", "")).partition("/")[2]:
        return "0.6.0"
    if any(str(device.get("name", ""))[:1].isdigit() for device in devices) or any(
        node.get("hostPath") for edits in all_edits for node in edits.get("deviceNodes") or []
    ):
        return "0.5.0"
    if any(mount.get("type") for edits in all_edits for mount in edits.get("mounts") or []):
        return "0.4.0"
    return VERSIONS[0]


def encode(document: Mapping[str, Any]) -> bytes:
    """The file's bytes: indented JSON (people read these files), a final newline."""
    return json.dumps(document, indent=2, ensure_ascii=False).encode() + b"\n"
