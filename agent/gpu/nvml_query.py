"""The one door to NVML: every pynvml call of the agent goes through this module.

``query`` calls a pynvml function by name and turns every way a per-device value can be
missing into ``None``: "not supported" (an L1 ECC counter on a Hopper), "no permission",
"GPU is lost", "unknown error", and a function that the installed driver (or pynvml) does
not have. It never raises. Byte strings become ``str``. A function missing from an old
driver is logged once, with what to do about it; other unexpected errors are logged once
per function and error, so a broken GPU cannot flood the log at every status request.

``call`` is the raising variant, for the few calls whose failure means the backend cannot
work at all (``nvmlInit``, the device count).

The pynvml module is looked up at call time through this module's ``pynvml`` attribute, so
that tests can replace it with a fake (``monkeypatch.setattr(nvml_query, "pynvml", fake)``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# NVML return codes (nvmlReturn_t, stable across driver versions).
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_LIB_RM_VERSION_MISMATCH = 18
ERROR_NO_DATA = 21
ERROR_UNKNOWN = 999
# Not an NVML code: the installed pynvml has no wrapper of that name (too old).
ERROR_NOT_IN_PYNVML = -1
# Not an NVML code: the wrapper raised something else than NVMLError (a pynvml bug).
ERROR_PYTHON = -2

# Codes that only say "this value does not exist here": logged at debug level.
_QUIET = frozenset({ERROR_NOT_SUPPORTED, ERROR_NOT_FOUND, ERROR_NO_DATA, ERROR_INVALID_ARGUMENT})

_NAMES = {
    ERROR_UNINITIALIZED: "NVML not initialized",
    ERROR_INVALID_ARGUMENT: "invalid argument",
    ERROR_NOT_SUPPORTED: "not supported",
    ERROR_NO_PERMISSION: "insufficient permissions",
    ERROR_NOT_FOUND: "not found",
    ERROR_DRIVER_NOT_LOADED: "driver not loaded",
    ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found",
    ERROR_FUNCTION_NOT_FOUND: "function not found in libnvidia-ml",
    ERROR_GPU_IS_LOST: "GPU is lost",
    ERROR_LIB_RM_VERSION_MISMATCH: "NVML library and kernel module versions differ",
    ERROR_NO_DATA: "no data",
    ERROR_UNKNOWN: "unknown error",
    ERROR_NOT_IN_PYNVML: "not in the installed pynvml",
}


def error_name(code: int) -> str:
    """A short English name for an NVML return code."""
    return _NAMES.get(code, f"NVML error {code}")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one NVML call gave: a value, or the error code that stands for its absence."""

    value: Any
    error: int | None  # None on success

    @property
    def lost(self) -> bool:
        """The GPU stopped answering (fell off the bus, needs a reset)."""
        return self.error == ERROR_GPU_IS_LOST


class NvmlCallError(Exception):
    """A raising call (``call``) failed; ``code`` is the NVML return code."""

    def __init__(self, func: str, code: int, detail: str) -> None:
        super().__init__(f"{func}: {detail}")
        self.func = func
        self.code = code


_warned: set[tuple[str, int]] = set()
_warned_lock = threading.Lock()


def _warn_once(func: str, code: int, message: str) -> None:
    with _warned_lock:
        if (func, code) in _warned:
            return
        _warned.add((func, code))
    log.warning("%s", message)


# Codes that say the driver itself went away under a running NVML (module unloaded, library
# and module versions differ), not that one value is missing: the GPU worker reports them
# (``take_driver_error``) so that the daemon re-reads the driver instead of serving nulls.
DRIVER_GONE = frozenset(
    {ERROR_UNINITIALIZED, ERROR_DRIVER_NOT_LOADED, ERROR_LIB_RM_VERSION_MISMATCH}
)
_driver_error: list[int] = []  # the last such code, until taken


def take_driver_error() -> int | None:
    """The last driver-wide error code any call got since the previous call; None if none."""
    with _warned_lock:
        code = _driver_error[-1] if _driver_error else None
        _driver_error.clear()
    return code


def decode(value: Any) -> Any:
    """Bytes from old pynvml versions become ``str``; lists and tuples are decoded inside."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list | tuple):
        return type(value)(decode(item) for item in value)
    return value


def _code_of(err: BaseException) -> int:
    code = getattr(err, "value", None)
    return code if isinstance(code, int) else ERROR_UNKNOWN


def _function(func: str) -> Callable[..., Any] | None:
    fn = getattr(pynvml, func, None)
    return fn if callable(fn) else None


def _invoke(func: str, *args: Any) -> Outcome:
    """Call without logging, except for the pynvml bugs that only a log can reveal."""
    fn = _function(func)
    if fn is None:
        return Outcome(None, ERROR_NOT_IN_PYNVML)
    try:
        return Outcome(decode(fn(*args)), None)
    except pynvml.NVMLError as err:
        code = _code_of(err)
        if code in DRIVER_GONE:
            _note_driver_error(code)
        return Outcome(None, code)
    except Exception as err:  # a pynvml wrapper bug must not take the node down
        _warn_once(func, ERROR_PYTHON, f"{func} failed inside pynvml ({err!r}): reported as null")
        return Outcome(None, ERROR_PYTHON)


def _note_driver_error(code: int) -> None:
    with _warned_lock:
        _driver_error[:] = [code]


def _report(func: str, outcome: Outcome) -> Outcome:
    code = outcome.error
    if code is None or code == ERROR_PYTHON:
        return outcome
    if code == ERROR_NOT_IN_PYNVML:
        _warn_once(
            func,
            code,
            f"{func} is not in the installed pynvml: values that need it are reported as "
            "null; upgrade the nvidia-ml-py package",
        )
    elif code == ERROR_FUNCTION_NOT_FOUND:
        _warn_once(
            func,
            code,
            f"{func} is not in this driver's libnvidia-ml (the driver is older than the "
            "function): values that need it are reported as null; update the NVIDIA driver "
            "to get them",
        )
    elif code in _QUIET:
        log.debug("%s: %s", func, error_name(code))
    elif code != ERROR_GPU_IS_LOST:  # the backend reports a lost GPU once per device
        _warn_once(func, code, f"{func}: {error_name(code)}: reported as null")
    return outcome


def attempt(func: str, *args: Any) -> Outcome:
    """Call ``pynvml.<func>(*args)``; never raises. Logs as described in the module doc."""
    return _report(func, _invoke(func, *args))


def query(func: str, *args: Any) -> Any:
    """The value of ``pynvml.<func>(*args)``, or ``None`` when NVML cannot give it."""
    return attempt(func, *args).value


_MISSING = (ERROR_FUNCTION_NOT_FOUND, ERROR_NOT_IN_PYNVML)


def attempt_first(funcs: tuple[str, ...], *args: Any) -> Outcome:
    """Try versions of one function, newest first (``..._v3``, ``..._v2``, plain).

    Moves on only while a version is missing (from the driver or from pynvml); any other
    outcome is the answer. When none exists, warns once naming the newest.
    """
    for func in funcs:
        outcome = _invoke(func, *args)
        if outcome.error not in _MISSING:
            return _report(func, outcome)
        log.debug("%s: %s", func, error_name(outcome.error or 0))
    return _report(funcs[0], Outcome(None, ERROR_FUNCTION_NOT_FOUND))


def pynvml_name(name: str) -> Any:
    """A pynvml type or constant that is no call (a ctypes structure such as
    ``c_nvmlGpmMetricsGet_t``), looked up as calls are; None when pynvml has none."""
    return getattr(pynvml, name, None)


def call(func: str, *args: Any) -> Any:
    """Call ``pynvml.<func>(*args)`` and raise ``NvmlCallError`` when it fails."""
    fn = _function(func)
    if fn is None:
        raise NvmlCallError(func, ERROR_NOT_IN_PYNVML, error_name(ERROR_NOT_IN_PYNVML))
    try:
        return decode(fn(*args))
    except pynvml.NVMLError as err:
        code = _code_of(err)
        raise NvmlCallError(func, code, error_name(code)) from None
