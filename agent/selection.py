"""The ``dev`` and ``vol`` query parameters: which GPUs and which volumes a request means.

Both are space separated lists (``+`` in a URL). ``dev`` entries are GPU indices or UUID
prefixes starting ``GPU-``; ``vol`` entries are volume names. Empty or ``*`` means all.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.display import shown
from agent.gpu.model import DeviceInfo
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


def means_all(value: str | None) -> bool:
    """Whether a list parameter asks for everything (absent, empty or ``*``)."""
    return _entries(value) is None


def select_devices(devices: Sequence[DeviceInfo], dev: str | None) -> tuple[DeviceInfo, ...]:
    """The devices ``dev`` names, in index order, each once."""
    entries = _entries(dev)
    if entries is None:
        return tuple(devices)
    chosen: set[int] = set()
    for entry in entries:
        chosen.add(_match_device(devices, entry))
    return tuple(d for d in devices if d.index in chosen)


def _match_device(devices: Sequence[DeviceInfo], entry: str) -> int:
    if entry.isascii() and entry.isdigit() and len(entry) <= _INDEX_DIGITS:
        index = int(entry)
        if index < len(devices):
            return index
    elif entry.upper().startswith("GPU-") and len(entry) > 4:
        prefix = entry.lower()
        matches = [d.index for d in devices if d.uuid and d.uuid.lower().startswith(prefix)]
        if len(matches) == 1:
            return matches[0]
    raise InvalidParameter("dev", entry)


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
