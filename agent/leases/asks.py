"""An ask for GPUs, as the REST API and the wrapper send it, and its validation.

An ask is one of three kinds: ``count`` whole GPUs (the default: one), ``count`` MIG devices
of ``mig_profile``, or the ``devices`` it names (``dev`` entries: indices, ``GPU-``/``MIG-``
UUID prefixes, ``<gpu>:<mig>``). ``exclusive`` (the default) takes each unit alone; shared
takes one of its sharing count. ``wait_s`` > 0 queues it for up to that long when it cannot
be served now. ``cpuset`` False leaves the NUMA hint out of the answer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from agent.leases.holders import Owner

MAX_COUNT = 64  # no node has more GPUs (agent.gpu.nodefile.MAX_DEVICES)
MAX_OWNER_LABELS = 16
MAX_DEVICES_CHARS = 4096
_OWNER_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,63}")
_OWNER_VALUE_CHARS = 128
_PROFILE = re.compile(r"[0-9]+(?:c\.[0-9]+)?g\.[0-9]+gb(?:\+[a-z0-9]+)*")  # 1g.18gb, 1c.2g.35gb


class InvalidAsk(ValueError):
    """An ask that asks for nothing valid; ``str()`` is the one-line answer, ``field`` which
    part of the ask is wrong (``count``, ``mig_profile``, ``devices``, ``owner``, ``wait_s``)."""

    def __init__(self, field: str, text: str) -> None:
        super().__init__(f"invalid ask: {text}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Ask:
    count: int = 1  # whole GPUs, or MIG devices of mig_profile; unused with devices
    mig_profile: str | None = None  # "1g.18gb"
    devices: str | None = None  # dev entries, space or comma separated: "0 1", "GPU-8f…"
    owner: Owner = ()  # labels of who asks: (("user", "alice"), ("job", "1234"))
    exclusive: bool = True
    wait_s: float = 0.0  # 0: answer now; > 0: queue for up to that long
    cpuset: bool = True  # False: no NUMA hint in the answer


def check_ask(ask: Ask) -> None:
    """``InvalidAsk`` for an ask the table cannot serve as asked (its shape, not the node's
    state: the devices it names are matched against the node by the table)."""
    if ask.devices is not None and ask.mig_profile is not None:
        raise InvalidAsk("devices", "name devices or a MIG profile, not both")
    if ask.devices is not None:
        entries = ask.devices.replace(",", " ").split()
        if not entries or entries == ["*"]:
            raise InvalidAsk("devices", "name the devices (indices or UUIDs), or ask for a count")
        if len(ask.devices) > MAX_DEVICES_CHARS:
            raise InvalidAsk("devices", f"more than {MAX_DEVICES_CHARS} characters of devices")
    elif not 1 <= ask.count <= MAX_COUNT:
        raise InvalidAsk("count", f"count must be 1 to {MAX_COUNT}: {ask.count}")
    if ask.mig_profile is not None and not _PROFILE.fullmatch(ask.mig_profile):
        raise InvalidAsk(
            "mig_profile", f"not a MIG profile: {ask.mig_profile[:40]!r} (like 1g.18gb)"
        )
    if not (math.isfinite(ask.wait_s) and ask.wait_s >= 0):
        raise InvalidAsk("wait_s", f"wait must be a number of seconds >= 0: {ask.wait_s}")
    check_owner(ask.owner)


def check_owner(owner: Owner) -> None:
    if len(owner) > MAX_OWNER_LABELS:
        raise InvalidAsk("owner", f"at most {MAX_OWNER_LABELS} owner labels")
    keys = [key for key, _ in owner]
    if len(set(keys)) != len(keys):
        raise InvalidAsk("owner", "an owner label is given twice")
    for key, value in owner:
        if not _OWNER_KEY.fullmatch(key):
            raise InvalidAsk(
                "owner",
                f"owner label key {key[:40]!r}: 1 to 64 letters, digits and _./-, "
                "starting with a letter or digit",
            )
        if len(value) > _OWNER_VALUE_CHARS or not value.isprintable():
            raise InvalidAsk(
                "owner",
                f"owner label {key}: at most {_OWNER_VALUE_CHARS} printable characters",
            )


def owner_is_valid(owner: Owner) -> bool:
    try:
        check_owner(owner)
    except InvalidAsk:
        return False
    return True


def ask_text(ask: Ask) -> str:
    """How it was asked, in words: ``2 GPUs``, ``MIG 1g.18gb``, ``devices 0 1``, ``, shared``."""
    if ask.devices is not None:
        what = "devices " + " ".join(ask.devices.replace(",", " ").split())
    elif ask.mig_profile is not None:
        what = f"MIG {ask.mig_profile}" + (f" x{ask.count}" if ask.count != 1 else "")
    else:
        what = f"{ask.count} GPU" + ("s" if ask.count != 1 else "")
    return what if ask.exclusive else f"{what}, shared"


def owner_text(owner: Owner) -> str:
    """``user=alice job=1234``; empty for no owner labels."""
    return " ".join(f"{key}={value}" for key, value in owner)
