"""The GPU model's values as JSON and back, read off the dataclass declarations themselves.

Node files (``nodefile``), ``--dump-node`` and the CUDA child's answer (``cuda_probe``) all
write and read model values. Rather than spelling out every field again in each of them,
``to_json`` and ``from_json`` walk the dataclass fields and their type hints, so adding a
field to a model type (with a default, for files written before it existed) is all it takes
for those formats to carry it.

What a field may be, by its type hint:

- ``int``, ``str``, ``bool``, ``float``; an ``int`` never accepts ``true``/``false``;
- ``X | None``: missing or ``null`` means ``None``;
- an ``enum.IntEnum``: its integer value;
- another model dataclass: a JSON object (missing or ``null``: an object with no keys, so
  that its own defaults and ``None`` fields apply);
- ``tuple[X, ...]``: a JSON list (missing or ``null``: empty).

A field without a default and not optional must be present and not ``null``; one with a
default takes it when missing or ``null``. Keys the model does not know are ignored (files
carry comments; newer files carry newer fields). The JSON name is the field name, unless the
field's metadata says otherwise: ``{"json": "global"}`` for ``global_``, or ``{"json": None}``
for a field that is not part of the JSON at all (a device's index is its position).

Every error is a ``CodecError`` whose message starts with the path of the field
(``devices[3].pci.bus_id: missing``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

JSON_NAME = "json"
_ABSENT = object()


class CodecError(ValueError):
    """A JSON value that does not fit the model; the message names the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str  # the Python attribute
    key: str | None  # the JSON key; None: not in JSON
    hint: Any  # the resolved type hint
    default: Any  # _ABSENT when the field has none


@functools.cache
def _fields(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        key = field.metadata.get(JSON_NAME, field.name)
        if field.default is not dataclasses.MISSING:
            default: Any = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = _ABSENT
        found.append(_Field(field.name, key, hints[field.name], default))
    return tuple(found)


# --- writing --------------------------------------------------------------------------------


def to_json(value: object) -> Any:
    """A model value as JSON-ready data (dicts, lists, numbers, strings, None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = _fields(type(value))
        return {f.key: to_json(getattr(value, f.name)) for f in fields if f.key is not None}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_json(item) for item in value]
    return value


# --- reading --------------------------------------------------------------------------------


def from_json(
    cls: type[T],
    data: object,
    where: str = "",
    *,
    given: Mapping[str, Any] | None = None,
    lenient: bool = False,
) -> T:
    """Build a ``cls`` from JSON ``data``; raises ``CodecError`` naming the field.

    ``given`` supplies fields that are not read from the JSON (``{"index": 3}``).
    ``lenient``: an optional field whose value has the wrong type becomes ``None`` instead of
    an error (for answers of our own child process, where a bad value must not cost the rest).
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise CodecError(f"{where or 'top level'}: expected an object, got {_show(data)}")
    values: dict[str, Any] = dict(given or {})
    for field in _fields(typing.cast(type, cls)):
        if field.name in values:
            continue
        if field.key is None:
            raise CodecError(f"{_join(where, field.name)}: must be given (not read from JSON)")
        path = _join(where, field.key)
        raw = data.get(field.key, _ABSENT)
        values[field.name] = _read(field, raw, path, lenient)
    return cls(**values)


def _read(field: _Field, raw: object, path: str, lenient: bool) -> Any:
    hint, optional = _unwrap_optional(field.hint)
    if raw is _ABSENT or raw is None:
        if field.default is not _ABSENT:
            return field.default
        if optional:
            return None
        if _is_model(hint) or _is_tuple(hint):
            return _value(hint, {} if _is_model(hint) else [], path, lenient)
        raise CodecError(f"{path}: missing" if raw is _ABSENT else f"{path}: must not be null")
    try:
        return _value(hint, raw, path, lenient)
    except CodecError:
        if lenient and optional and not _is_model(hint) and not _is_tuple(hint):
            return None
        raise


def _value(hint: Any, raw: object, path: str, lenient: bool) -> Any:
    if _is_model(hint):
        return from_json(hint, raw, path, lenient=lenient)
    if _is_tuple(hint):
        if not isinstance(raw, list | tuple):
            raise CodecError(f"{path}: expected a list, got {_show(raw)}")
        item = typing.get_args(hint)[0]
        return tuple(_item(item, value, f"{path}[{i}]", lenient) for i, value in enumerate(raw))
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        if not _is_int(raw) or raw not in hint._value2member_map_:
            choices = ", ".join(str(member.value) for member in hint)
            raise CodecError(f"{path}: expected one of {choices}, got {_show(raw)}")
        return hint(typing.cast(int, raw))
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        raise CodecError(f"{path}: expected true or false, got {_show(raw)}")
    if hint is int:
        if _is_int(raw):
            return raw
        raise CodecError(f"{path}: expected an integer, got {_show(raw)}")
    if hint is float:
        if _is_int(raw) or isinstance(raw, float):
            return float(raw)  # type: ignore[arg-type]
        raise CodecError(f"{path}: expected a number, got {_show(raw)}")
    if hint is str:
        if isinstance(raw, str):
            return raw
        raise CodecError(f"{path}: expected a string, got {_show(raw)}")
    raise TypeError(f"{path}: the codec cannot read a {hint!r} field")  # a model bug


def _item(hint: Any, raw: object, path: str, lenient: bool) -> Any:
    inner, optional = _unwrap_optional(hint)
    if raw is None:
        if optional:
            return None
        if _is_model(inner):
            return from_json(inner, {}, path, lenient=lenient)
        raise CodecError(f"{path}: must not be null")
    return _value(inner, raw, path, lenient)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _is_model(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def _is_int(raw: object) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _show(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


# --- compiled, for our own child process ----------------------------------------------------
#
# The GPU worker (``agent.gpu.worker``) sends every status sweep across a pipe, so the two
# walks above would run on the daemon's hot path for every device of every sweep (about
# 56 µs to read one DeviceStatus back, 25 µs to write it). ``encoder(cls)`` and
# ``decoder(cls)`` build, once per type, a function from the same declarations that does
# only the conversions: the JSON is the same as ``to_json``'s and a valid value reads back
# equal to ``from_json``'s, but nothing is checked. Use them only for JSON our own code
# wrote (the worker's answers); files and user input go through ``from_json``.

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


@functools.cache
def encoder(cls: type) -> Encode:
    """``to_json`` for values of ``cls``, compiled from its declarations."""
    steps = [(f.name, f.key, _encode_step(f.hint)) for f in _fields(cls) if f.key is not None]

    def encode(value: Any) -> Any:
        out = {}
        for name, key, step in steps:
            raw = getattr(value, name)
            out[key] = None if raw is None else step(raw)
        return out

    return encode


def _encode_step(hint: Any) -> Encode:
    inner, _ = _unwrap_optional(hint)
    if _is_model(inner):
        return encoder(inner)
    if _is_tuple(inner):
        item, _ = _unwrap_optional(typing.get_args(inner)[0])
        each = _encode_step(item)
        if each is _identity:
            return list
        return lambda raw: [None if x is None else each(x) for x in raw]
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return lambda raw: raw.value
    return _identity


@functools.cache
def decoder(cls: type[T]) -> Callable[[Any], T]:
    """``from_json`` for JSON of ``cls`` written by ``encoder``: no checks, only conversions.

    Fields that are not in JSON (``{"json": None}``) cannot be given: such types are read
    with ``from_json``.
    """
    steps = []
    for f in _fields(typing.cast(type, cls)):
        if f.key is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not in JSON: use from_json")
        hint, optional = _unwrap_optional(f.hint)
        if f.default is not _ABSENT:
            missing: Callable[[], Any] = functools.partial(_identity, f.default)
        elif optional:
            missing = functools.partial(_identity, None)
        elif _is_model(hint):
            sub = decoder(hint)
            missing = functools.partial(sub, {})
        elif _is_tuple(hint):
            missing = tuple
        else:
            missing = functools.partial(_identity, None)
        steps.append((f.name, f.key, _decode_step(hint), missing))

    def decode(data: Any) -> T:
        get = (data or {}).get
        values = {}
        for name, key, step, missing in steps:
            raw = get(key)
            values[name] = missing() if raw is None else step(raw)
        return cls(**values)

    return decode


def _decode_step(hint: Any) -> Decode:
    if _is_model(hint):
        return decoder(hint)
    if _is_tuple(hint):
        item, _ = _unwrap_optional(typing.get_args(hint)[0])
        each = _decode_step(item)
        if each is _identity:
            return tuple
        return lambda raw: tuple(None if x is None else each(x) for x in raw)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if hint is float:
        return float
    return _identity
