"""Node files: a node's GPU facts as JSON, read by the simulated backend, made by --dump-node.

The schema is documented in ``docs/node-file.md``. Field names are those of the model
(``agent.gpu.model``), read and written by ``codec`` from the model's own declarations, so
a node file reads like the model it describes and a new model field needs no change here.

The file is whatever is at its path when it is read, and a node file is read by the GPU
worker and by the daemon (its ``driver_version``, ``agent.node.drivers``), at start and
at every new version. So ``read_json`` reads it within bounds, each failure one line naming
the file (``NodeFileError``):

- only a regular file, opened without blocking (``agent.files.read_regular``): a FIFO, a
  directory, a device (``/dev/zero`` behind a link) is refused at once, never read;
- at most ``MAX_BYTES``: the built-in nodes are 2 to 20 KB, a 64-GPU node in MIG mode with
  every pair of GPUs linked would be about 600 KB; and parsed JSON costs Python up to about
  25 times its size (a list of ``{}``), in each of the two processes, so that at 1 MiB the
  agent stays well within 256 MB whatever the file holds;
- nested at most ``MAX_DEPTH`` levels, checked before parsing by a linear scan that never
  recurses (the idea of ``plugin.json_body``): Python's parser recurses once a level and
  fails with ``RecursionError`` at about 1,000;
- UTF-8 (no other encoding guessed), and JSON as RFC 8259 has it: no ``NaN`` or
  ``Infinity``, no number of more digits than Python converts;
- at most ``MAX_DEVICES`` devices (``parse``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from agent.files import UnusableFile, read_regular
from agent.gpu import codec
from agent.gpu.codec import CodecError
from agent.gpu.model import DeviceInfo, DeviceStatus, NodeInfo, PcieThroughput

SCHEMA = "nvidia-docker-node/1"
BUILTIN_NODES = ("h200", "h200x2", "hgx-h200-8", "h200x2-mig")

MAX_BYTES = 1024 * 1024  # a node file's size bound (the module docstring says why)
# How deep a node file may nest: its own structure goes 8 levels deep (the top object >
# devices > a device > status > telemetry > mig_devices > a MIG device > profiling); the
# rest is room for notes.
MAX_DEPTH = 32
# How many GPUs a node file may describe: the largest machines have 16 (DGX-2, HGX-2); the
# agent keeps a thread per GPU in the worker's pools and a block per GPU in every answer.
MAX_DEVICES = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes and all
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_OPENING = frozenset(b"[{")


class NodeFileError(ValueError):
    """A node file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class SimulatedDevice:
    status: DeviceStatus
    throughput: PcieThroughput
    lost: bool  # every live call fails, as for a GPU that fell off the bus
    # What the health sweep's checks find (docs/node-file.md, "Events and health").
    row_remap_failure: bool = False
    row_remap_pending: bool = False
    retired_pages_pending: bool = False
    recovery_action: int | None = None  # what the driver asks for (DeviceCheck's); None: not said


# The kinds of simulated events: two NVML delivers, and the GPU coming back after a reset.
SIMULATED_EVENT_KINDS = ("xid", "double_bit_ecc", "answers_again")


@dataclass(frozen=True, slots=True)
class SimulatedEvent:
    """One entry of a node file's ``events``: delivered once, by ``id``; ``mig``: the MIG
    device of ``gpu`` the driver attributes it to (its GPU and compute instance)."""

    id: str
    gpu: int
    kind: str  # one of SIMULATED_EVENT_KINDS
    xid: int | None = None
    mig: int | None = None


@dataclass(frozen=True, slots=True)
class NodeFile:
    """A parsed node file: static info, the status each device reports, simulated call costs."""

    info: NodeInfo
    devices: tuple[SimulatedDevice, ...]
    status_call_s: float  # time one device_status() takes, to mimic NVML
    pcie_sample_s: float  # time one pcie_throughput() takes (NVML: about 2 x 20 ms)
    events: tuple[SimulatedEvent, ...] = ()


def resolve(name_or_path: str) -> Path:
    """A built-in node name (``h200``) or a path to a node file."""
    if name_or_path in BUILTIN_NODES:
        ref = resources.files("agent.gpu") / "nodes" / f"{name_or_path}.json"
        return Path(str(ref))
    return Path(name_or_path)


def load(name_or_path: str) -> NodeFile:
    """The node file ``name_or_path`` (a built-in name or a path), read within the bounds
    (``read_json``) and parsed; ``NodeFileError``, one line naming the file, otherwise."""
    path = resolve(name_or_path)
    raw = read_json(path)
    try:
        return parse(raw)
    except NodeFileError as err:
        raise NodeFileError(f"node file {path}: {err}") from None


def read_json(path: Path) -> object:
    """The JSON value of the node file at ``path``, read within the bounds of the module
    docstring; ``NodeFileError`` (one line naming the file and what is wrong) otherwise."""
    try:
        data = read_regular(path, limit=MAX_BYTES, what="node file")
    except UnusableFile as err:
        if not os.path.lexists(path):
            raise NodeFileError(
                f"node file {path} not found (built-in nodes: {', '.join(BUILTIN_NODES)})"
            ) from None
        raise NodeFileError(str(err)) from None
    try:
        return decode_json(data)
    except NodeFileError as err:
        raise NodeFileError(f"node file {path}: {err}") from None


def decode_json(data: bytes) -> object:
    """The JSON value of a node file's bytes; ``NodeFileError`` for bytes that nest deeper
    than ``MAX_DEPTH``, are not UTF-8, or are not JSON (RFC 8259: no ``NaN``)."""
    _check_depth(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NodeFileError(f"not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise NodeFileError(
            f"not JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    except NodeFileError:
        raise
    except ValueError:  # int() refuses the digits of a number too long
        raise NodeFileError(
            f"not JSON (a number of more than {sys.get_int_max_str_digits()} digits)"
        ) from None
    except RecursionError:  # not within MAX_DEPTH, so not here; but never a traceback
        raise NodeFileError(f"nested deeper than {MAX_DEPTH} levels") from None


def _refuse_constant(name: str) -> NoReturn:
    raise NodeFileError(f"not JSON ({name} is not a JSON number)")


def _check_depth(data: bytes) -> None:
    """Refuse bytes whose arrays and objects nest deeper than ``MAX_DEPTH``, counting the
    brackets outside strings, in one pass that never recurses. A string that does not end
    leaves its brackets counted: such bytes are no JSON anyway."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return
    depth = 0
    for byte in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if byte in _OPENING:
            depth += 1
            if depth > MAX_DEPTH:
                raise NodeFileError(f"nested deeper than {MAX_DEPTH} levels")
        else:
            depth -= 1


@dataclass(frozen=True, slots=True)
class Timing:
    """What the simulated calls cost, to mimic NVML (``timing`` in the file)."""

    status_call_s: float = 0.0
    pcie_sample_s: float = 0.0


def parse(raw: object) -> NodeFile:
    """A node file's JSON as a ``NodeFile``; ``NodeFileError`` names the field at fault."""
    try:
        return _parse(raw)
    except CodecError as err:
        raise NodeFileError(str(err)) from None


def _parse(raw: object) -> NodeFile:
    if not isinstance(raw, Mapping):
        raise NodeFileError("top level: expected an object")
    schema = raw.get("schema")
    if schema not in (None, SCHEMA):
        raise NodeFileError(f"schema: {_show(schema)} is not supported (expected {SCHEMA!r})")
    timing = codec.from_json(Timing, raw.get("timing"), "timing")
    for name in ("status_call_s", "pcie_sample_s"):
        if not 0 <= getattr(timing, name) < math.inf:  # 1e999 is JSON, and infinite
            raise NodeFileError(f"timing.{name}: expected a finite number >= 0")
    devices = raw.get("devices")
    if devices is not None and not isinstance(devices, list | tuple):
        raise NodeFileError("devices: expected a list")
    if not devices:
        raise NodeFileError("devices: a node file needs at least one device")
    if len(devices) > MAX_DEVICES:
        raise NodeFileError(
            f"devices: {len(devices)} devices, more than the {MAX_DEVICES} a node file may have"
        )
    infos: list[DeviceInfo] = []
    simulated: list[SimulatedDevice] = []
    for index, dev in enumerate(devices):
        where = f"devices[{index}]"
        infos.append(codec.from_json(DeviceInfo, dev, where, given={"index": index}))
        simulated.append(_simulated(dev, where))
    _check_layout(infos, simulated)
    node = codec.from_json(NodeInfo, raw, given={"devices": tuple(infos)})
    return NodeFile(
        info=node,
        devices=tuple(simulated),
        status_call_s=timing.status_call_s,
        pcie_sample_s=timing.pcie_sample_s,
        events=_events(raw.get("events"), infos),
    )


def _check_layout(infos: Sequence[DeviceInfo], simulated: Sequence[SimulatedDevice]) -> None:
    """Refuse what no real node has, naming the first field at fault: two devices with one
    bus id (an empty one, a GPU NVML could not open, may repeat: ``--dump-node`` writes it),
    one UUID given twice (GPUs and MIG devices together), a topology entry that names no
    other device or names one twice, MIG devices on a GPU whose ``mig_enabled`` is not
    true, two MIG devices of a GPU with one index (or one GPU and compute instance), a
    negative MIG index, and MIG telemetry of a MIG device the GPU does not have."""
    bus_owner: dict[str, int] = {}
    uuid_owner: dict[str, str] = {}

    def unique_uuid(uuid: str | None, where: str) -> None:
        if uuid is None:
            return
        if uuid in uuid_owner:
            raise NodeFileError(
                f"{where}.uuid: {uuid} is also {uuid_owner[uuid]}'s: every GPU and MIG device "
                "needs its own UUID"
            )
        uuid_owner[uuid] = where

    for info in infos:
        where = f"devices[{info.index}]"
        bus_id = info.pci.bus_id
        if bus_id and bus_id in bus_owner:
            raise NodeFileError(
                f"{where}.pci.bus_id: {bus_id} is also devices[{bus_owner[bus_id]}]'s: "
                "every device needs its own bus id"
            )
        bus_owner.setdefault(bus_id, info.index)
        unique_uuid(info.uuid, where)
        if info.mig_devices and info.mig_enabled is not True:
            raise NodeFileError(
                f"{where}.mig_devices: {len(info.mig_devices)} MIG devices on a GPU whose "
                "mig_enabled is not true: set mig_enabled to true, or remove them"
            )
        indices: set[int] = set()
        instances: set[tuple[int, int]] = set()
        for number, mig in enumerate(info.mig_devices):
            at = f"{where}.mig_devices[{number}]"
            if mig.index < 0 or mig.index in indices:
                raise NodeFileError(
                    f"{at}.index: {mig.index} is "
                    + ("negative" if mig.index < 0 else "used twice on this GPU")
                    + ": each MIG device needs its own index >= 0"
                )
            indices.add(mig.index)
            pair = (mig.gpu_instance_id, mig.compute_instance_id)
            if pair[0] is not None and pair[1] is not None:
                if pair in instances:
                    raise NodeFileError(
                        f"{at}: GPU instance {pair[0]} with compute instance {pair[1]} is "
                        "another MIG device of this GPU too"
                    )
                instances.add((pair[0], pair[1]))
            unique_uuid(mig.uuid, at)
        for number, entry in enumerate(simulated[info.index].status.telemetry.mig_devices):
            if entry.index not in indices:
                raise NodeFileError(
                    f"{where}.status.telemetry.mig_devices[{number}].index: {entry.index} is "
                    "not the index of one of this GPU's mig_devices"
                )
    for info in infos:
        peers: set[str] = set()
        for number, peer in enumerate(info.topology):
            where = f"devices[{info.index}].topology[{number}].bus_id"
            if not peer.bus_id or peer.bus_id not in bus_owner or peer.bus_id == info.pci.bus_id:
                raise NodeFileError(f"{where}: {peer.bus_id or '(empty)'} is not another device")
            if peer.bus_id in peers:
                raise NodeFileError(f"{where}: {peer.bus_id} is listed twice")
            peers.add(peer.bus_id)


def _events(raw: object, devices: Sequence[DeviceInfo]) -> tuple[SimulatedEvent, ...]:
    count = len(devices)
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise NodeFileError("events: expected a list")
    events: list[SimulatedEvent] = []
    seen: set[str] = set()
    for number, entry in enumerate(raw):
        where = f"events[{number}]"
        if not isinstance(entry, Mapping):
            raise NodeFileError(f"{where}: expected an object")
        ident = entry.get("id")
        if isinstance(ident, bool) or not isinstance(ident, str | int) or ident == "":
            raise NodeFileError(f"{where}.id: expected a string or an integer")
        if str(ident) in seen:
            raise NodeFileError(
                f"{where}.id: {_show(ident)} is used twice (each event is delivered once)"
            )
        seen.add(str(ident))
        gpu = entry.get("gpu")
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < count:
            raise NodeFileError(f"{where}.gpu: expected a device index from 0 to {count - 1}")
        kind = entry.get("kind")
        if kind not in SIMULATED_EVENT_KINDS:
            raise NodeFileError(f"{where}.kind: expected one of {', '.join(SIMULATED_EVENT_KINDS)}")
        xid = entry.get("xid")
        if kind == "xid" and (isinstance(xid, bool) or not isinstance(xid, int) or xid <= 0):
            raise NodeFileError(f"{where}.xid: expected the XID number (an integer > 0)")
        mig = entry.get("mig")
        migs = [m.index for m in devices[gpu].mig_devices]
        bad_mig = isinstance(mig, bool) or not isinstance(mig, int) or mig not in migs
        if mig is not None and (kind == "answers_again" or bad_mig):
            have = ", ".join(map(str, migs)) or "none"
            raise NodeFileError(
                f"{where}.mig: expected the index of one of GPU {gpu}'s MIG devices ({have}), "
                "on an xid or double_bit_ecc event"
            )
        events.append(
            SimulatedEvent(str(ident), gpu, str(kind), xid if kind == "xid" else None, mig)
        )
    return tuple(events)


def _simulated(dev: Mapping[str, Any], where: str) -> SimulatedDevice:
    status = dev.get("status")
    status = {} if status is None else status
    if not isinstance(status, Mapping):
        raise NodeFileError(f"{where}.status: expected an object")
    flags = {}
    for name in ("lost", *_HEALTH_FLAGS):
        value = dev.get(name)
        if value is not None and not isinstance(value, bool):
            raise NodeFileError(f"{where}.{name}: expected true, false or null, got {_show(value)}")
        flags[name] = bool(value)
    recovery = dev.get("recovery_action")
    if recovery is not None and (
        isinstance(recovery, bool) or not isinstance(recovery, int) or not 0 <= recovery < 2**32
    ):
        raise NodeFileError(f"{where}.recovery_action: expected an integer >= 0 or null")
    return SimulatedDevice(
        status=codec.from_json(DeviceStatus, status, f"{where}.status"),
        throughput=codec.from_json(PcieThroughput, status.get("pcie"), f"{where}.status.pcie"),
        recovery_action=recovery,
        **flags,
    )


_HEALTH_FLAGS = ("row_remap_failure", "row_remap_pending", "retired_pages_pending")


def _show(value: object) -> str:
    """A value of the file in a message: its repr, cut to 40 characters (one short line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dump(
    info: NodeInfo,
    statuses: Sequence[DeviceStatus],
    throughputs: Sequence[PcieThroughput],
    *,
    status_call_s: float | None = None,
    pcie_sample_s: float | None = None,
) -> dict[str, Any]:
    """The node file for a node, the inverse of ``parse`` (used by ``--dump-node``)."""
    devices = []
    for dev, status, tput in zip(info.devices, statuses, throughputs, strict=True):
        entry = codec.to_json(dev)
        entry["status"] = {**codec.to_json(status), "pcie": codec.to_json(tput)}
        devices.append(entry)
    out: dict[str, Any] = {"schema": SCHEMA}
    out.update({k: v for k, v in codec.to_json(info).items() if k != "devices"})
    if status_call_s is not None or pcie_sample_s is not None:
        out["timing"] = codec.to_json(Timing(status_call_s or 0.0, pcie_sample_s or 0.0))
    out["devices"] = devices
    return out
