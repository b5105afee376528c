"""What a process has used, read from ``/proc``: CPU seconds and resident memory.

The benchmarks read these for the server and for their own client processes over the same
window, so a row can say which side ran out of CPU first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far, all its threads together, in seconds.

    Read from ``/proc/<pid>/stat`` (fields 14 and 15, in clock ticks: 10 ms resolution,
    which is well under 1% of a measurement of a few seconds).
    """
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces; what follows the
    # last ")" starts at field 3, so fields 14 and 15 are the 12th and 13th there.
    after_name = text[text.rindex(")") + 2 :].split()
    return (int(after_name[11]) + int(after_name[12])) / _TICKS_PER_S


def machine_busy_seconds() -> float:
    """CPU time every CPU of the machine has spent busy so far (all processes), seconds.

    From the first line of ``/proc/stat``: user, nice, system, irq, softirq and steal (time
    the hypervisor gave to someone else); idle and iowait are not busy. Over a window, this
    minus what the benchmark's own processes used is what other work took from them.
    """
    with Path("/proc/stat").open() as stat:
        fields = stat.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True, slots=True)
class ResidentMemory:
    """Resident memory of a process: now, its peak, and now split into anonymous and file."""

    rss_mb: float
    peak_mb: float
    anon_mb: float
    file_mb: float

    def as_json(self) -> dict[str, float]:
        return {
            "rss": round(self.rss_mb, 1),
            "peak": round(self.peak_mb, 1),
            "anon": round(self.anon_mb, 1),
            "file": round(self.file_mb, 1),
        }


def resident_memory(pid: int) -> ResidentMemory:
    """From ``/proc/<pid>/status``: VmRSS, VmHWM (peak), RssAnon (heap, stacks), RssFile."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024  # kB
    return ResidentMemory(
        rss_mb=fields.get("VmRSS", 0.0),
        peak_mb=fields.get("VmHWM", 0.0),
        anon_mb=fields.get("RssAnon", 0.0),
        file_mb=fields.get("RssFile", 0.0),
    )
