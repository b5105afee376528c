"""The ``dev`` and ``vol`` query parameters: which GPUs and which volumes a request means.

Both are space separated lists (``+`` in a URL; commas work too). ``dev`` entries are GPU
indices or UUID prefixes starting ``GPU-``, or MIG devices: ``<gpu>:<mig>`` indices or UUID
prefixes starting ``MIG-``; ``vol`` entries are volume names. Empty or ``*`` means all.

A selection is a tuple of ``Target``: a whole GPU (with every MIG device it has), or one MIG
device of a GPU. What serves whole GPUs only (``/gpu/info``, ``/gpu/status``) takes the GPUs
of the targets (``select_devices``): a MIG device stands for its GPU there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.display import shown
from agent.gpu.model import DeviceInfo, MigDevice
from plugin.volume_specs import VOLUMES, VolumeSpec, spec_by_name

_NOUNS = {"dev": "device", "vol": "volume", "format": "format"}
_INDEX_DIGITS = 6  # no node has a million GPUs; int() of longer strings is costly or refused


class InvalidParameter(ValueError):
    """A query parameter entry that names nothing, with which parameter and which entry.

    ``str(error)`` is the API's answer (``invalid device: 9``), the entry shown safely
    (bounded, control characters escaped: ``agent.display``); ``parameter`` (``dev``,
    ``vol``, ``format``) and ``entry`` (as sent) are for programs, which never parse the text.
    """

    def __init__(self, parameter: str, entry: str, hint: str = "") -> None:
        noun = _NOUNS.get(parameter, parameter)
        super().__init__(f"invalid {noun}: {shown(entry)}{hint}")
        self.parameter = parameter
        self.entry = entry


def _entries(value: str | None) -> list[str] | None:
    """The entries of a list parameter, or None when it means "all"."""
    if value is None:
        return None
    entries = value.replace(",", " ").split()
    if not entries or entries == ["*"]:
        return None
    return entries


@dataclass(frozen=True, slots=True)
class Target:
    """One thing a selection gives a container: a whole GPU (``mig`` is None), with every
    MIG device it has, or one MIG device of ``gpu``."""

    gpu: DeviceInfo
    mig: MigDevice | None = None


def means_all(value: str | None) -> bool:
    """Whether a list parameter asks for everything (absent, empty or ``*``)."""
    return _entries(value) is None


def _is_index(text: str) -> bool:
    """ASCII digits only, and few of them (``isdigit`` alone takes "²", which int refuses)."""
    return text.isascii() and text.isdigit() and len(text) <= _INDEX_DIGITS


def entries_of(value: str | None) -> list[str] | None:
    """The entries of a list parameter (``dev``, ``vol``), or None when it means "all"."""
    return _entries(value)


def select_targets(devices: Sequence[DeviceInfo], dev: str | None) -> tuple[Target, ...]:
    """What ``dev`` names, in GPU index order (a GPU's MIG devices in MIG index order), each
    once; a whole GPU includes its MIG devices, so naming both gives the GPU."""
    entries = _entries(dev)
    if entries is None:
        return tuple(Target(d) for d in devices)
    whole: set[int] = set()
    migs: dict[int, set[int]] = {}
    for entry in entries:
        gpu, mig = _match_device(devices, entry)
        if mig is None:
            whole.add(gpu)
        else:
            migs.setdefault(gpu, set()).add(mig)
    chosen: list[Target] = []
    for device in devices:
        if device.index in whole:
            chosen.append(Target(device))
        elif device.index in migs:
            wanted = migs[device.index]
            chosen += [Target(device, m) for m in device.mig_devices if m.index in wanted]
    return tuple(chosen)


def select_devices(devices: Sequence[DeviceInfo], dev: str | None) -> tuple[DeviceInfo, ...]:
    """The GPUs ``dev`` names (a MIG device names its GPU), in index order, each once."""
    if _entries(dev) is None:
        return tuple(devices)
    chosen = {target.gpu.index for target in select_targets(devices, dev)}
    return tuple(d for d in devices if d.index in chosen)


def _match_device(devices: Sequence[DeviceInfo], entry: str) -> tuple[int, int | None]:
    """(GPU index, MIG index or None) of one ``dev`` entry."""
    if _is_index(entry):
        index = int(entry)
        if index < len(devices):
            return index, None
    elif entry.upper().startswith("GPU-") and len(entry) > 4:
        prefix = entry.lower()
        matches = [d.index for d in devices if d.uuid and d.uuid.lower().startswith(prefix)]
        if len(matches) == 1:
            return matches[0], None
    elif entry.upper().startswith("MIG-") and len(entry) > 4:
        prefix = entry.lower()
        found = [
            (d.index, m.index)
            for d in devices
            for m in d.mig_devices
            if m.uuid and m.uuid.lower().startswith(prefix)
        ]
        if len(found) == 1:
            return found[0][0], found[0][1]
    elif entry.count(":") == 1:
        return _match_mig_index(devices, entry)
    raise InvalidParameter("dev", entry)


def _match_mig_index(devices: Sequence[DeviceInfo], entry: str) -> tuple[int, int]:
    gpu_text, _, mig_text = entry.partition(":")
    if not (_is_index(gpu_text) and _is_index(mig_text)) or int(gpu_text) >= len(devices):
        raise InvalidParameter("dev", entry)
    gpu = devices[int(gpu_text)]
    if not gpu.mig_enabled:
        raise InvalidParameter("dev", entry, f" (GPU {gpu.index} is not in MIG mode)")
    if not any(m.index == int(mig_text) for m in gpu.mig_devices):
        have = ", ".join(f"{gpu.index}:{m.index}" for m in gpu.mig_devices) or "none"
        raise InvalidParameter("dev", entry, f" (GPU {gpu.index} has MIG devices {have})")
    return gpu.index, int(mig_text)


def select_volumes(vol: str | None) -> tuple[VolumeSpec, ...]:
    """The volumes ``vol`` names, in the plugin's order."""
    entries = _entries(vol)
    if entries is None:
        return VOLUMES
    chosen: set[str] = set()
    for entry in entries:
        spec = spec_by_name(entry)
        if spec is None:
            raise InvalidParameter("vol", entry)
        chosen.add(spec.name)
    return tuple(spec for spec in VOLUMES if spec.name in chosen)
