"""Mesos agent flags for a node's GPUs, checked against Mesos's own parsing rules.

Two formats:

``legacy`` (nvidia-docker 1.0, byte for byte)::

    --attributes=gpus:<BLOB> --resources=gpus:{GPU-a,GPU-b}

``native`` (Mesos 1.0+ GPU support, for agents that run the ``gpu/nvidia`` isolator)::

    --attributes=gpus:<BLOB> --resources=gpus:<count> --nvidia_gpu_devices=<i,j>

The native line carries no ``--isolation``: the operator owns that flag (Mesos refuses a flag
given twice, and a lone ``--isolation`` would replace the default ``posix/cpu,posix/mem``), so
``$(curl .../mesos/cli?format=native)`` composes with any launch script. ``merge_agent_args``
adds the isolators that ``gpu/nvidia`` needs, in an order every Mesos version accepts.

The rules checked here are those of Mesos's source (``stout`` flags, ``values::parse``,
``Attributes::parse``, ``Resources::parse``), so an accepted line is one a Mesos agent takes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mesos.blob import ATTRIBUTE_NAME, encode

RESOURCE_NAME = "gpus"

_NUMBER = re.compile(
    r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?0[xX][0-9a-fA-F]+|[+-]?(?:inf|infinity|nan)",
    re.IGNORECASE,
)
_BRACKETS = frozenset("[]{}()")
_SET_ITEM_FORBIDDEN = frozenset("{}[](),;:")


class FlagsError(ValueError):
    """Input that would give Mesos an unusable flag; the message says what and why."""


def legacy_flags(info_json: bytes, uuids: Sequence[str]) -> str:
    """``--attributes=gpus:<BLOB> --resources=gpus:{<uuids>}``, no trailing newline."""
    check_set_items(uuids)
    attribute = encode(info_json)
    check_attribute_text(attribute)
    return (
        f"--attributes={ATTRIBUTE_NAME}:{attribute} "
        f"--resources={RESOURCE_NAME}:{{{','.join(uuids)}}}"
    )


def native_flags(info_json: bytes, uuids: Sequence[str], indices: Sequence[int]) -> str:
    """``--attributes=gpus:<BLOB> --resources=gpus:<n> --nvidia_gpu_devices=<indices>``.

    ``indices`` are NVML indices (what ``nvidia-smi`` shows), one per UUID, in the same order.
    Mesos requires the count in ``--resources`` to equal the number of devices listed.
    """
    check_set_items(uuids)
    if len(indices) != len(uuids):
        raise FlagsError(f"{len(uuids)} GPU UUIDs but {len(indices)} indices: one index per GPU")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
        raise FlagsError(f"GPU indices must be non-negative integers, got {list(indices)}")
    if len(set(indices)) != len(indices):
        raise FlagsError(f"duplicate GPU index in {list(indices)}: Mesos refuses duplicates")
    attribute = encode(info_json)
    check_attribute_text(attribute)
    devices = ",".join(str(i) for i in indices)
    return (
        f"--attributes={ATTRIBUTE_NAME}:{attribute} "
        f"--resources={RESOURCE_NAME}:{len(indices)} "
        f"--nvidia_gpu_devices={devices}"
    )


def check_attribute_text(value: str) -> None:
    """Raise unless Mesos keeps ``value`` as one TEXT attribute value, unchanged.

    Mesos splits ``--attributes`` on ``;`` and newlines, removes spaces, reads a value
    starting with ``[`` as RANGES, ``{`` as a SET (fatal for an attribute), refuses brackets
    elsewhere, and reads anything numeric as a SCALAR.
    """
    if not value:
        raise FlagsError("an attribute value cannot be empty")
    for position, char in enumerate(value, start=1):
        if char in ";\n":
            raise FlagsError(f"{char!r} at position {position} would split the attribute")
        if char in _BRACKETS:
            raise FlagsError(f"bracket {char!r} at position {position}: Mesos would not read TEXT")
        if char.isspace():
            raise FlagsError(f"white space at position {position}: Mesos would remove it")
    if _NUMBER.fullmatch(value):
        raise FlagsError(f"{value!r} reads as a number: Mesos would make it a SCALAR, not TEXT")


def check_set_items(items: Sequence[str]) -> None:
    """Raise unless ``items`` make a Mesos SET resource value ``{a,b}`` of distinct items."""
    if isinstance(items, str):
        raise FlagsError("expected a sequence of GPU UUIDs, got one string")
    if not items:
        raise FlagsError("no GPU selected: a Mesos GPU resource needs at least one GPU")
    for item in items:
        if not item:
            raise FlagsError("an empty GPU UUID cannot be a set item")
        bad = [c for c in item if c in _SET_ITEM_FORBIDDEN or c.isspace()]
        if bad:
            raise FlagsError(f"GPU UUID {item!r} contains {bad[0]!r}, which Mesos would split")
    duplicates = sorted({item for item in items if items.count(item) > 1})
    if duplicates:
        raise FlagsError(f"GPU {duplicates[0]} listed twice: a Mesos set has distinct items")


def parse_flag_line(line: str) -> dict[str, str]:
    """``{name: value}`` of a line of ``--name=value`` words; raises on what Mesos refuses.

    Mesos reads ``--name=value`` only (a bare ``--name`` is a boolean), lower-cases names and
    refuses a flag given twice.
    """
    flags: dict[str, str] = {}
    for word in line.split(" "):
        if not word.startswith("--") or "=" not in word:
            raise FlagsError(f"{word!r} is not a --name=value flag")
        name, value = word[2:].split("=", 1)
        name = name.lower()
        if not name or not value:
            raise FlagsError(f"{word!r} has an empty name or value")
        if name in flags:
            raise FlagsError(f"--{name} given twice: Mesos refuses duplicate flags")
        flags[name] = value
    return flags
