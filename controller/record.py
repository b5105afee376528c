"""Frozen value classes with slots, without ``dataclasses``: ``@record`` and ``field``.

Why: ``nvidia-docker run`` builds a dozen small frozen value classes (its ``Options``, the
node's ``Endpoint`` and ``TlsOptions``, the lease's ask and grant, ...). Importing
``dataclasses`` costs 7 to 35 ms on the 2-core development machine (it imports ``inspect``,
hence ``ast``, ``dis`` and ``tokenize``), and each frozen dataclass about 1 ms more to make
(its methods are written as text and compiled), together more than the rest of the run
(docs/nvidia-docker.md, "Speed"). ``@record`` makes the same kind of class from the same
class body, with generic methods instead of generated ones:

- the annotated names of the class body, in order, are its fields (``__slots__``); a value
  given there is the field's default (immutable ones only: the default is shared), or
  ``field(default=..., compare=False, meta=...)`` for a field left out of ``==`` and
  ``hash``, or one that carries ``meta`` (``controller.options``' declarations);
- ``__init__`` takes the fields positionally or by name (a missing one without a default,
  an unknown or repeated one: ``TypeError``, as a dataclass says it), about twice the time
  of a dataclass's; a class may write its own, storing each field with
  ``object.__setattr__`` (``Endpoint`` and ``TlsOptions`` do: a fleet makes thousands);
- instances are frozen (``FrozenInstanceError``, an ``AttributeError``), equal when of the
  same class with equal compared fields, hashable by them, and shown as
  ``Name(field=value, ...)``; ``copy`` and ``pickle`` work;
- ``replace(obj, **changes)`` and ``fields(cls)`` are ``dataclasses``' functions of those
  names.

The class is made anew (as ``dataclass(slots=True)`` does): its methods must not use
``super()`` or ``__class__``, which would name the class before ``@record``.

Type checkers read ``@record`` as a frozen dataclass (``dataclass_transform``). A class
that is not on the wrapper's run path may as well be a dataclass; both can be mixed.
This module imports nothing.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from typing_extensions import dataclass_transform

    T = TypeVar("T")
else:

    def dataclass_transform(**_how: object) -> object:
        """``typing.dataclass_transform`` for type checkers only (no ``typing`` at run time)."""
        return lambda decorator: decorator


class FrozenInstanceError(AttributeError):
    """An assignment to a field of a record (``dataclasses.FrozenInstanceError``'s role)."""


MISSING: Any = object()  # a field without a default


class Field:
    """A field's settings in a class body (``field(...)``): its default, whether it is
    compared, and what else the class's own code keeps with it (``meta``)."""

    __slots__ = ("compare", "default", "meta")

    def __init__(self, default: object, compare: bool, meta: object) -> None:
        self.default = default
        self.compare = compare
        self.meta = meta


def field(*, default: Any = MISSING, compare: bool = True, meta: object = None) -> Any:
    """A field with a default (``default``), left out of ``==`` and ``hash`` when not
    ``compare``, carrying ``meta`` (``fields(cls)`` gives it back)."""
    return Field(default, compare, meta)


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """The class ``cls`` made a frozen, slotted value class (see the module docstring)."""
    body = dict(cls.__dict__)
    names = tuple(body.get("__annotations__", {}))
    defaults: dict[str, object] = {}
    meta: dict[str, object] = {}
    compared = []
    for name in names:
        default = body.pop(name, MISSING)
        compare = True
        if isinstance(default, Field):
            compare, meta[name], default = default.compare, default.meta, default.default
        if default is not MISSING:
            defaults[name] = default
        elif defaults:
            raise TypeError(f"{cls.__name__}.{name}: a field without a default follows one with")
        if compare:
            compared.append(name)
    for name in ("__dict__", "__weakref__"):
        body.pop(name, None)
    for name, value in body.items():  # see the module docstring: the old class would stay
        function = getattr(value, "fget", value)  # a property's getter too
        if "__class__" in getattr(getattr(function, "__code__", None), "co_freevars", ()):
            raise TypeError(f"{cls.__name__}.{name} uses super() or __class__: not in a record")
    body.update(
        __slots__=names,
        __record_fields__=names,
        __record_defaults__=defaults,
        __record_default_list__=tuple(defaults.get(name, MISSING) for name in names),
        __record_meta__=meta,
        __record_compared__=tuple(compared),
    )
    for name, method in _METHODS.items():
        body.setdefault(name, method)
    kind: Any = type(cls)  # the metaclass: type, unless the class names another
    made = kind(cls.__name__, cls.__bases__, body)
    made.__qualname__ = cls.__qualname__
    return made  # type: ignore[no-any-return]


def _init(self: Any, *args: object, **kwargs: object) -> None:
    cls = type(self)
    names, defaults = cls.__record_fields__, cls.__record_default_list__
    given = len(args)
    if given > len(names):
        raise TypeError(
            f"{cls.__name__}() takes {len(names)} positional arguments but {given} were given"
        )
    store = object.__setattr__
    for name, value in zip(names, args, strict=False):
        store(self, name, value)
    pop = kwargs.pop
    for name, default in zip(names[given:], defaults[given:], strict=True):
        value = pop(name, default)
        if value is MISSING:
            raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
        store(self, name, value)
    for name in kwargs:
        why = "multiple values for" if name in names else "an unexpected keyword"
        raise TypeError(f"{cls.__name__}() got {why} argument {name!r}")


def _setattr(self: object, name: str, _value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _compared(self: Any) -> tuple[object, ...]:
    return tuple(getattr(self, name) for name in self.__record_compared__)


def _eq(self: object, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]
    return _compared(self) == _compared(other)


def _hash(self: object) -> int:
    return hash(_compared(self))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__record_fields__)
    return f"{type(self).__qualname__}({shown})"


def _getstate(self: Any) -> tuple[object, ...]:
    return tuple(getattr(self, name) for name in self.__record_fields__)


def _setstate(self: Any, state: tuple[object, ...]) -> None:
    for name, value in zip(self.__record_fields__, state, strict=True):
        object.__setattr__(self, name, value)


_METHODS = {
    "__init__": _init,
    "__setattr__": _setattr,
    "__delattr__": _delattr,
    "__eq__": _eq,
    "__hash__": _hash,
    "__repr__": _repr,
    "__getstate__": _getstate,
    "__setstate__": _setstate,
}


def fields(cls: type) -> tuple[tuple[str, object, object], ...]:
    """``(name, default, meta)`` of each field of a record class, in order (``MISSING``: no
    default; ``meta``: None unless ``field`` gave one)."""
    found: Any = cls
    defaults, meta = found.__record_defaults__, found.__record_meta__
    return tuple(
        (name, defaults.get(name, MISSING), meta.get(name)) for name in found.__record_fields__
    )


def is_record(cls: type) -> bool:
    """Whether ``cls`` was made by ``@record``."""
    return "__record_fields__" in cls.__dict__


def replace(obj: T, **changes: Any) -> T:
    """A copy of the record ``obj`` with ``changes`` (``dataclasses.replace``)."""
    names = type(obj).__record_fields__  # type: ignore[attr-defined]
    return type(obj)(**{**{name: getattr(obj, name) for name in names}, **changes})
