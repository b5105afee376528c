"""``--health-checks``: what may make a GPU unhealthy, in the spirit of NVIDIA's device plugin.

The value is a comma separated list (spaces allowed, case ignored):

- at most one of ``all`` (the default: critical XIDs, double-bit ECC events and the
  sweeps' checks), ``xids`` (critical XIDs only, as the device plugin judges) or ``none``
  (nothing: every GPU stays healthy; events are still watched, logged and exported);
- ``-N``: XID ``N`` is ignored (logged, never held against a GPU);
- ``+N``: XID ``N`` counts, even if it is one of the application XIDs ignored by default,
  and even after ``none`` (``none,+79``: only XID 79 makes a GPU unhealthy).

The XIDs ignored by default are those an application causes (``APPLICATION_XIDS``), the
device plugin's list: 13, 31, 43, 45, 68, 109. Its ``DP_DISABLE_HEALTHCHECKS=all`` (or
``xids``) is our ``none``, its ``DP_DISABLE_HEALTHCHECKS=48,79`` our ``-48,-79``, and its
``DP_ENABLE_HEALTHCHECKS=31`` our ``+31``. Where the device plugin differs: it judges XID
events only (our ``xids``; our default also counts double-bit ECC events, lost GPUs, failed
or pending row remaps and the driver's recovery action), it skips a malformed XID with a log
line where we refuse the setting, and it marks every GPU unhealthy when waiting for events
fails, where we keep the last health and the sweeps go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALL = "all"
XIDS = "xids"
NONE = "none"
BASES = (ALL, XIDS, NONE)
MAX_XID = 65535  # XIDs are small numbers (the driver's catalog goes to about 170)

# XIDs that an application causes (a bad kernel, a bad stream), not the GPU: NVIDIA's device
# plugin for Kubernetes skips the same ones. They are logged, never held against a GPU.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception",  # a kernel's illegal instruction or out-of-range access
    31: "GPU memory page fault",  # an application touched memory it does not own
    43: "GPU stopped processing",  # the driver stopped a faulting application's channel
    45: "preemptive cleanup, due to previous errors",  # a killed process's work cleaned up
    68: "NVDEC0 exception",  # the video decoder rejected an application's stream
    109: "context switch timeout",  # an application's context did not yield in time
}


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Which signals count (``base``) and which XIDs are ignored or counted besides."""

    base: str = ALL
    ignored: frozenset[int] = field(default_factory=lambda: frozenset(APPLICATION_XIDS))
    counted: frozenset[int] = frozenset()  # +N: counted whatever the base and the defaults

    @property
    def checks(self) -> bool:
        """Whether double-bit ECC events and the sweeps' conditions make a GPU unhealthy."""
        return self.base == ALL

    def counts_xid(self, xid: int | None) -> bool:
        """Whether XID ``xid`` (None: an XID event without a number) is held against a GPU."""
        if xid is not None and xid in self.counted:
            return True
        if self.base == NONE:
            return False
        return xid is None or xid not in self.ignored

    def __str__(self) -> str:
        """The setting as it is written, canonical: ``all``, ``xids,-48,+13``."""
        default = frozenset(APPLICATION_XIDS)
        extra = [f"-{x}" for x in sorted(self.ignored - default)]
        extra += [f"+{x}" for x in sorted(self.counted)]
        return ",".join([self.base, *extra])


def parse_health_checks(text: str) -> HealthPolicy:
    """A ``--health-checks`` value as a ``HealthPolicy``; ``ValueError`` (one line) for an
    entry that is none of the forms the module docstring lists."""
    base: str | None = None
    ignored = set(APPLICATION_XIDS)
    counted: set[int] = set()
    for raw in text.replace(" ", ",").split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry in BASES:
            if base is not None and base != entry:
                raise ValueError(f"{base!r} and {entry!r}: give at most one of all, xids, none")
            base = entry
            continue
        sign, number = entry[:1], entry[1:]
        if sign not in "+-" or not (number.isascii() and number.isdigit()) or len(number) > 5:
            raise ValueError(
                f"{raw.strip()[:40]!r}: expected all, xids, none, -XID (ignore it) or "
                "+XID (count it), e.g. xids,-48,+13"
            )
        xid = int(number)
        if not 0 < xid <= MAX_XID:
            raise ValueError(f"{raw.strip()!r}: an XID is a number from 1 to {MAX_XID}")
        if sign == "-":
            ignored.add(xid)
            counted.discard(xid)
        else:
            counted.add(xid)
            ignored.discard(xid)
    return HealthPolicy(base or ALL, frozenset(ignored), frozenset(counted))


DEFAULT_POLICY = HealthPolicy()
