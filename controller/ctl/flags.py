"""The click options of ``nvidia-docker-ctl``, made from the declarations of ``controller.options``.

Every flag of the tool is a ``Setting`` of a frozen class: the operator's ``Options`` (a
``controller.record``: TLS, timeouts, concurrency, output format, ...) or a command's own
request, a frozen dataclass (``FleetNodes``, ``FlagsRequest``). This module turns each
declaration into one click option (its flags, help with the default and the variable, and no
conversion of its own: the declaration's is the only one), and hands the command one object
instead of loose parameters:

- ``@operator_options("parallel", "timeout_s", ...)``: the command gets ``options``, the
  ``Options`` that ``controller.ctl.main``'s edge builds from the environment with the
  flags given here winning (built once per run);
- ``@request_options(FleetNodes, "nodes")``: the command gets ``nodes``, a ``FleetNodes``
  built from its own flags.

``output`` (``--json``, ``--jsonl``) is one setting shown as one flag per format; a name
``"output:json"`` gives a command only some of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import click

from controller.options import (
    Options,
    OptionsError,
    Setting,
    convert,
    declarations,
    shown_default,
)

F = TypeVar("F", bound=Callable[..., Any])


def _param(cls: type, name: str) -> str:
    """The click parameter of a field: its class in the name, so that two objects' fields of
    one name cannot meet."""
    return f"{cls.__name__.lower()}_{name}"


def _help(declared: Setting, default: Any, *, env: bool = True) -> str:
    extra = shown_default(declared, default).strip().removeprefix("[").removesuffix("]")
    if env and declared.env:
        extra = f"{extra}; env: {declared.env}" if extra else f"env: {declared.env}"
    return f"{declared.help}  [{extra}]" if extra else declared.help


def _formats(name: str, declared: Setting) -> tuple[str, ...]:
    _, _, only = name.partition(":")
    chosen = tuple(c for c in declared.choices if c != "table")
    return tuple(c for c in chosen if not only or c in only.split(","))


def _click_options(cls: type, names: tuple[str, ...], *, env: bool) -> list[Callable[[F], F]]:
    wanted = {n.partition(":")[0]: n for n in names}
    made: list[Callable[[F], F]] = []
    for name, declared, default in declarations(cls):
        if name not in wanted or not declared.flags:
            continue
        if declared.kind == "output":
            helps = dict(zip(declared.choices, declared.choice_help, strict=True))
            for fmt in _formats(wanted[name], declared):
                param = _param(cls, f"{name}_{fmt}")
                made.append(click.option(f"--{fmt}", param, is_flag=True, help=helps[fmt]))
            continue
        if declared.kind == "flag":
            made.append(
                click.option(*declared.flags, _param(cls, name), is_flag=True, help=declared.help)
            )
            continue
        made.append(
            click.option(
                *declared.flags,
                _param(cls, name),
                metavar=declared.metavar or "TEXT",
                multiple=declared.multiple,
                default=None,
                help=_help(declared, default, env=env),
            )
        )
    missing = set(wanted) - {n for n, _, _ in declarations(cls)}
    if missing:
        raise TypeError(f"{cls.__name__} declares no {sorted(missing)}")
    return made


def _given(kwargs: dict[str, Any], cls: type) -> dict[str, Any]:
    """The flags given (field name -> text, True, or a tuple), taken out of ``kwargs``."""
    given: dict[str, Any] = {}
    for name, declared, _default in declarations(cls):
        if declared.kind == "output":
            chosen = [
                fmt for fmt in declared.choices if kwargs.pop(_param(cls, f"{name}_{fmt}"), False)
            ]
            if len(chosen) > 1:
                raise OptionsError(
                    " and ".join(f"--{c}" for c in chosen) + " exclude each other: give one"
                )
            if chosen:
                given[name] = chosen[0]
            continue
        value = kwargs.pop(_param(cls, name), None)
        if value is None or value is False or value == ():
            continue
        given[name] = value
    return given


def _apply(function: F, made: Sequence[Callable[[Any], Any]]) -> F:
    for option in reversed(made):
        function = option(function)
    return function


def operator_options(*names: str) -> Callable[[F], F]:
    """Add the flags of these ``Options`` fields; the command gets ``options=Options``."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = _given(kwargs, Options)
            from controller.ctl.main import edge  # noqa: PLC0415 (the edge builds them)

            return function(*args, options=edge().options(given), **kwargs)

        return _apply(cast(F, command), _click_options(Options, names, env=True))

    return decorate


def request_options(cls: type, into: str) -> Callable[[F], F]:
    """Add the flags of every field of ``cls``; the command gets ``into=cls(...)``, each
    value converted by its declaration (paths: ``~`` is the edge's ``HOME``)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def command(*args: Any, **kwargs: Any) -> Any:
            from controller.ctl.main import edge  # noqa: PLC0415

            home = edge().home
            given = _given(kwargs, cls)
            values: dict[str, Any] = {}
            for name, declared, _default in declarations(cls):
                if name not in given:
                    continue
                where = next((f for f in declared.flags if f.startswith("--")), name)
                value = given[name]
                if declared.kind == "flag":
                    values[name] = bool(value)
                elif declared.multiple:
                    values[name] = tuple(convert(declared, v, where, home) for v in value)
                else:
                    values[name] = convert(declared, value, where, home)
            return function(*args, **{into: cls(**values)}, **kwargs)

        names = tuple(n for n, _, _ in declarations(cls))
        return _apply(cast(F, command), _click_options(cls, names, env=False))

    return decorate
