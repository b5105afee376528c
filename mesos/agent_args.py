"""Merge a node's GPU flags into a ``mesos-agent`` command line.

Mesos refuses a flag given twice, and a flag on the command line silently replaces the same
flag from the environment (``MESOS_ATTRIBUTES`` ...). So the node's ``--attributes`` and
``--resources`` are joined to the operator's (``;``, Mesos's separator for both), and for the
native format the isolators that ``gpu/nvidia`` needs are added to ``--isolation``.

How Mesos reads its command line (stout's flags): ``--name=value``; a bare ``--name`` is a
boolean and ``--no-name`` its negation; names are lower-cased; reading stops at ``--``. Mesos
itself rejects ``--attributes VALUE`` (two words); the merge accepts it and writes one word.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from mesos.flags import RESOURCE_NAME, FlagsError, parse_flag_line
from mesos.isolation import GPU_ISOLATOR, isolators, with_gpu_isolation

MERGED_FLAGS = ("attributes", "resources", "isolation")
"""Flags whose values are joined with the operator's instead of given twice."""

_ENV_PREFIX = "MESOS_"
_SEPARATORS = {"attributes": ";", "resources": ";", "isolation": ","}


class MergeError(ValueError):
    """The operator's arguments cannot take the node's flags; the message says why."""


def merge_agent_args(
    args: Sequence[str], flags: str, *, environ: Mapping[str, str] | None = None
) -> list[str]:
    """``args`` (a ``mesos-agent`` command line, program excluded) with ``flags`` merged in.

    ``flags`` is a ``/mesos/cli`` line. ``environ`` (optional) is the environment the agent
    will get: its ``MESOS_ATTRIBUTES``, ``MESOS_RESOURCES`` and ``MESOS_ISOLATION`` are kept by
    merging them in, since the merged command-line flag would otherwise hide them.
    """
    try:
        ours = parse_flag_line(flags)
    except FlagsError as error:
        raise MergeError(f"the node's flags are not valid: {error}") from None

    head, given, tail = _scan(args, set(ours))
    for name in MERGED_FLAGS:
        if name not in given and environ is not None:
            from_env = _environment_value(environ, name)
            if from_env is not None:
                given[name] = [from_env]

    native = "nvidia_gpu_devices" in ours
    merged: dict[str, str] = {}
    if "attributes" in ours:
        merged["attributes"] = _merge_attributes(given.get("attributes", []), ours["attributes"])
    if "resources" in ours:
        merged["resources"] = _merge_resources(given.get("resources", []), ours["resources"])
    user_isolation = ",".join(given["isolation"]) if "isolation" in given else None
    if native or "isolation" in ours:
        base = user_isolation
        if "isolation" in ours:
            tokens = isolators(base or "") + isolators(ours["isolation"])
            base = ",".join(dict.fromkeys(tokens))
        merged["isolation"] = with_gpu_isolation(base) if native else base or ""
    elif user_isolation is not None and GPU_ISOLATOR in isolators(user_isolation):
        raise MergeError(
            f"--isolation has {GPU_ISOLATOR}, whose agent drops the legacy '{RESOURCE_NAME}' set "
            "resource and then offers no GPUs: use the native format (--format native)"
        )
    for name, value in ours.items():
        if name not in MERGED_FLAGS:
            merged[name] = value

    result: list[str] = []
    placed: set[str] = set()
    for item in head:
        if isinstance(item, _Slot):
            if item.name in merged:
                result.append(f"--{item.name}={merged[item.name]}")
                placed.add(item.name)
            else:
                result.append(f"--{item.name}={item.value}")
        else:
            result.append(item)
    result.extend(f"--{name}={value}" for name, value in merged.items() if name not in placed)
    result.extend(tail)
    return result


class _Slot:
    """Where the first occurrence of a merged flag stood in the operator's arguments."""

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value


def _scan(
    args: Sequence[str], ours: set[str]
) -> tuple[list[str | _Slot], dict[str, list[str]], list[str]]:
    head: list[str | _Slot] = []
    given: dict[str, list[str]] = {}
    slots: dict[str, _Slot] = {}
    index = 0
    while index < len(args):
        raw = args[index]
        word = raw.strip()
        if word == "--":
            return head, given, list(args[index:])
        if not word.startswith("--"):
            head.append(raw)
            index += 1
            continue
        name, has_value, value = word[2:].partition("=")
        name = name.lower()
        if name.startswith("no-") and (name[3:] in MERGED_FLAGS or name[3:] in ours):
            raise MergeError(f"{word}: --{name[3:]} takes a value, Mesos refuses --{name}")
        if name in MERGED_FLAGS:
            if not has_value:
                if index + 1 >= len(args) or args[index + 1].strip().startswith("--"):
                    raise MergeError(f"--{name} has no value (write --{name}=VALUE)")
                index += 1
                value = args[index]
            given.setdefault(name, []).append(value)
            if name in slots:
                slots[name].value = _SEPARATORS[name].join(given[name])
            else:
                slots[name] = _Slot(name, value)
                head.append(slots[name])
        elif name in ours:
            raise MergeError(
                f"{word}: --{name} comes from the node's GPU flags; remove it from the command line"
            )
        else:
            head.append(raw)
        index += 1
    return head, given, []


def _environment_value(environ: Mapping[str, str], name: str) -> str | None:
    for key, value in environ.items():
        if key.startswith(_ENV_PREFIX) and key[len(_ENV_PREFIX) :].lower() == name:
            return value
    return None


def _merge_attributes(values: list[str], ours: str) -> str:
    kept: list[str] = []
    for value in values:
        _refuse_file(value, "attributes")
        for token in value.replace("\n", ";").split(";"):
            if not token.strip():
                continue
            if token.split(":", 1)[0].strip() == RESOURCE_NAME:
                raise MergeError(
                    f"--attributes already has a '{RESOURCE_NAME}' attribute ({token[:40]}...): "
                    "remove it, the node's flags provide it"
                )
            kept.append(token)
    return ";".join([*kept, ours])


def _merge_resources(values: list[str], ours: str) -> str:
    texts = [v for v in values if v.strip()]
    for value in texts:
        _refuse_file(value, "resources")
    as_json = [_json_array(v) for v in texts]
    if any(parsed is not None for parsed in as_json):
        if any(parsed is None for parsed in as_json):
            raise MergeError("--resources mixes JSON and text forms: use one")
        merged: list[object] = []
        for parsed in as_json:
            assert parsed is not None
            for entry in parsed:
                if isinstance(entry, dict) and entry.get("name") == RESOURCE_NAME:
                    raise MergeError(_duplicate_resource())
                merged.append(entry)
        merged.append(_resource_json(ours))
        return json.dumps(merged, separators=(",", ":"))
    for value in texts:
        for token in value.split(";"):
            name = token.split(":", 1)[0].split("(", 1)[0].strip()
            if name == RESOURCE_NAME:
                raise MergeError(_duplicate_resource())
    return ";".join([*texts, ours])


def _duplicate_resource() -> str:
    return (
        f"--resources already names '{RESOURCE_NAME}': remove it, the node's flags provide "
        "the GPUs (Mesos would add the two or refuse the mix)"
    )


def _json_array(value: str) -> list[object] | None:
    if not value.lstrip().startswith("["):
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None  # the ranges text form also starts with '[' (not valid JSON)
    return parsed if isinstance(parsed, list) else None


def _resource_json(ours: str) -> dict[str, object]:
    name, value = ours.split(":", 1)
    if value.startswith("{"):
        items = [item for item in value.strip("{}").split(",") if item]
        return {"name": name, "type": "SET", "set": {"item": items}}
    count: float = int(value) if value.isdigit() else float(value)
    return {"name": name, "type": "SCALAR", "scalar": {"value": count}}


def _refuse_file(value: str, name: str) -> None:
    if value.strip().startswith("file://"):
        raise MergeError(
            f"--{name}={value.strip()} reads a file; write its content on the command line "
            "so that the GPU flags can be merged into it"
        )
