"""How a Mesos 1.x agent reads its command line, as an independent model for the tests.

Written from the behaviour of Mesos's flag loading (stout), value parsing (``values::parse``),
``Attributes::parse``, ``Resources::parse`` and the Nvidia GPU allocator's checks, so that the
tests judge the product's output by Mesos's rules rather than by the product's own validators.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

VALUE_FLAGS = frozenset({"attributes", "resources", "isolation", "nvidia_gpu_devices", "master"})


class MesosRefused(Exception):
    """What the Mesos agent would print before exiting."""


@dataclass(frozen=True)
class Value:
    type: str  # SCALAR, RANGES, SET, TEXT
    scalar: float | None = None
    items: tuple[str, ...] = ()
    text: str = ""


def load_flags(argv: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``--name=value`` / ``--name`` / ``--no-name`` up to ``--``; refuses duplicates."""
    values: dict[str, str | None] = {}
    for raw in argv[1:]:
        arg = raw.strip()
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.lower()
        base = name[3:] if name.startswith("no-") else name
        if base in values or name in values:
            raise MesosRefused(f"Flag '{base}' is already loaded")
        if base in VALUE_FLAGS:
            if name != base:
                raise MesosRefused(f"Failed to load non-boolean flag '{base}' via '{name}'")
            if not eq:
                raise MesosRefused(f"Failed to load non-boolean flag '{base}': Missing value")
        values[name] = value if eq else None
    for key, value in (environ or {}).items():
        if key.startswith("MESOS_") and key[6:].lower() not in values:
            values[key[6:].lower()] = value
    return values


def parse_value(text: str) -> Value:
    temp = text.replace(" ", "")
    if not temp:
        raise MesosRefused("Expecting non-empty string")
    for left, right in ("{}", "[]", "()"):
        depth = 0
        for char in temp:
            depth += (char == left) - (char == right)
            if depth < 0:
                raise MesosRefused("Mismatched brackets")
        if depth:
            raise MesosRefused("Mismatched brackets")
    if temp.startswith("["):
        bounds = [t for t in re.split(r"[\[\]\-,\n]", temp) if t]
        if len(bounds) % 2 or not all(b.isdigit() for b in bounds):
            raise MesosRefused("Expecting one or more ranges")
        return Value("RANGES")
    if "[" in temp:
        raise MesosRefused("Unexpected '[' found")
    if temp.startswith("{"):
        return Value("SET", items=tuple(t for t in re.split(r"[{},\n]", temp) if t))
    if "{" in temp:
        raise MesosRefused("Unexpected '{' found")
    number = _number(temp)
    if number is not None and number >= 0:
        return Value("SCALAR", scalar=number)
    return Value("TEXT", text=temp)


def _number(text: str) -> float | None:
    if re.fullmatch(r"[+-]?0[xX][0-9a-fA-F]+", text):
        return float(int(text, 16))
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
        return float(text)
    if text.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        return None  # boost reads it, Mesos then keeps it as TEXT
    return None


def parse_attributes(text: str) -> dict[str, Value]:
    attributes: dict[str, Value] = {}
    for token in (t for t in re.split(r"[;\n]", text) if t):
        name, sep, value = token.partition(":")
        if not sep or not name or not value:
            raise MesosRefused(f"Invalid attribute key:value pair '{token}'")
        parsed = parse_value(value)
        if parsed.type == "SET":
            raise MesosRefused(f"Bad type for attribute {name}")
        attributes[name] = parsed
    return attributes


def parse_resources(text: str) -> list[tuple[str, Value]]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None
    resources: list[tuple[str, Value]] = []
    if isinstance(document, list):
        for entry in document:
            kind = entry["type"]
            if kind == "SCALAR":
                resources.append((entry["name"], Value("SCALAR", scalar=entry["scalar"]["value"])))
            elif kind == "SET":
                items = tuple(entry["set"]["item"])
                resources.append((entry["name"], Value("SET", items=items)))
            else:
                resources.append((entry["name"], Value(kind)))
    else:
        for token in (t for t in text.split(";") if t):
            pair = [t for t in token.split(":") if t]
            if len(pair) != 2:
                raise MesosRefused(f"Bad value for resources, missing or extra ':' in {token}")
            name = pair[0].split("(", 1)[0].strip()
            value = parse_value(pair[1])
            if value.type == "TEXT":
                raise MesosRefused(f"Bad type for resource {name}")
            resources.append((name, value))
    kinds: dict[str, str] = {}
    for name, value in resources:
        if value.type == "SET" and len(set(value.items)) != len(value.items):
            raise MesosRefused("Invalid set resource: duplicated elements")
        if kinds.setdefault(name, value.type) != value.type:
            raise MesosRefused(f"Resources with the same name ('{name}') but different types")
    return resources


def native_gpus_offered(flags: Mapping[str, str | None], mesos_version: tuple[int, int]) -> int:
    """How many GPUs an agent with the ``gpu/nvidia`` isolator offers, or why it refuses."""
    isolation = [t for t in (flags.get("isolation") or "posix/cpu,posix/mem").split(",") if t]
    devices_flag = flags.get("nvidia_gpu_devices")
    if "gpu/nvidia" not in isolation:
        if devices_flag is not None:
            raise MesosRefused("'--nvidia_gpus_devices' can only be specified with gpu/nvidia")
        return 0
    gpu_at = isolation.index("gpu/nvidia")
    devices_ok = "cgroups/devices" in isolation or (
        mesos_version >= (1, 7) and "cgroups/all" in isolation
    )
    if not devices_ok:
        raise MesosRefused("The 'cgroups/devices' isolator must be enabled")
    if mesos_version >= (1, 2) and "filesystem/linux" not in isolation:
        raise MesosRefused("The 'filesystem/linux' isolator must be enabled")
    if mesos_version < (1, 7):
        if isolation.index("cgroups/devices") > gpu_at:
            raise MesosRefused("'cgroups/devices' must precede 'gpu/nvidia'")
        if mesos_version >= (1, 2) and isolation.index("filesystem/linux") > gpu_at:
            raise MesosRefused("'filesystem/linux' must precede 'gpu/nvidia'")
    text = flags.get("resources") or ""
    gpus = [value for name, value in parse_resources(text) if name == "gpus"]
    scalar = sum(v.scalar or 0 for v in gpus if v.type == "SCALAR")
    if "gpus" in text and scalar == 0:
        if devices_flag is not None:
            raise MesosRefused("'--nvidia_gpus_devices' cannot be specified with 0 GPUs")
        return 0  # a gpus SET (the legacy line) lands here: no GPU is offered
    if devices_flag is None:
        if scalar:
            raise MesosRefused("The `gpus` resource can not be set without --nvidia_gpu_devices")
        raise MesosRefused("this model needs an explicit GPU list")
    indices = [int(t) for t in devices_flag.split(",") if t]
    if len(set(indices)) != len(indices):
        raise MesosRefused("'--nvidia_gpu_devices' contains duplicates")
    if len(indices) != scalar:
        raise MesosRefused("'--resources' and '--nvidia_gpu_devices' specify different numbers")
    return len(indices)
