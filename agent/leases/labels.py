"""The labels that tie a container to its lease, written at create, read back from engines.

A leased container carries four labels (``labels_for``): the lease id, its units' keys
(UUIDs where known), exclusive or shared, and the owner labels (a JSON object). They are what
a restarted table rebuilds the leases of running containers from when its snapshot is lost,
and what lets a container whose lease ended get its units again. Labels are anybody's to
write: ``read_label`` takes only what has the table's own form and bounds, and the table
checks a label against its leases. A label is not a secret: it names a lease, it does not
prove the right to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from agent.leases.asks import owner_is_valid
from agent.leases.holders import Lease, Owner, lease_number

LABEL_ID = "nvidia-docker.lease"
LABEL_DEVICES = "nvidia-docker.lease.devices"
LABEL_MODE = "nvidia-docker.lease.mode"
LABEL_OWNER = "nvidia-docker.lease.owner"
EXCLUSIVE = "exclusive"
SHARED = "shared"

MAX_LABEL_CHARS = 8192
MAX_UNITS = 64 * 8  # 64 GPUs of up to 7 MIG devices each, and room
_KEY_CHARS = 128


@dataclass(frozen=True, slots=True)
class LeaseLabel:
    """A container's lease labels, as read: which lease, which units, how, for whom."""

    lease_id: str
    units: tuple[str, ...]  # unit keys
    exclusive: bool = True
    owner: Owner = ()


def labels_for(lease: Lease) -> dict[str, str]:
    """The labels a container created with ``lease`` carries."""
    return {
        LABEL_ID: lease.id,
        LABEL_DEVICES: ",".join(lease.units),
        LABEL_MODE: EXCLUSIVE if lease.exclusive else SHARED,
        LABEL_OWNER: json.dumps(dict(lease.owner), separators=(",", ":")),
    }


def read_label(labels: Mapping[str, str]) -> LeaseLabel | None:
    """The lease label of a container's labels; None when it has none of the table's form
    (no id, a malformed id, units or mode). Owner labels that are malformed read as none."""
    lease_id = labels.get(LABEL_ID)
    devices = labels.get(LABEL_DEVICES)
    mode = labels.get(LABEL_MODE, EXCLUSIVE)
    if lease_id is None or lease_number(lease_id) is None or devices is None:
        return None
    if len(devices) > MAX_LABEL_CHARS or mode not in (EXCLUSIVE, SHARED):
        return None
    units = tuple(devices.split(","))
    if not 0 < len(units) <= MAX_UNITS or len(set(units)) != len(units):
        return None
    if any(not k or len(k) > _KEY_CHARS or not k.isprintable() or " " in k for k in units):
        return None
    return LeaseLabel(lease_id, units, mode == EXCLUSIVE, _owner(labels.get(LABEL_OWNER)))


def _owner(text: str | None) -> Owner:
    if text is None or len(text) > MAX_LABEL_CHARS:
        return ()
    try:
        raw = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        return ()
    owner = tuple((str(k), v) for k, v in raw.items())
    return owner if owner_is_valid(owner) else ()
