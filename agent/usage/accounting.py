"""The ledger's arithmetic: status sweeps in, holds and hourly totals out (a pure model).

``Accounting.observe(t_s, units)`` takes one sweep: for every GPU unit (a whole GPU or a MIG
device) who holds it now (``UnitSample.holders``) and how busy it is. Between two sweeps
``dt`` seconds passed, and for every holder seen in both (at most ``max_gap_s`` apart: after
a longer gap, an agent stopped or a driver being replaced, the hold ended at its last
sighting and a new one starts; the gap is not counted as held):

- ``held_s`` grows by ``dt`` (a unit-second: a whole GPU, or one MIG device);
- ``busy_s`` grows by ``dt`` times the unit's utilisation (the mean of the two sweeps'
  readings), shared equally by the holders of a shared unit; a unit without a reading (a
  MIG device: NVML gives no utilisation per MIG device) adds nothing;
- ``energy_j`` grows by the GPU's mean power between two moves of its energy counter times
  the unit-seconds held (whole GPUs only). The counter is the slow sample's
  (``agent.node.status``), so it may stay the same for several sweeps and then move by what
  the GPU used since it was last read (``UnitSample.energy_at_s``): each holder seen at the
  move gets that power times the unit-seconds it held the GPU since the previous move (its
  share of a shared unit), so no holder gets what the GPU used while another held it; a
  hold that ended before the move gets its part then, in the hour it was last seen. A
  counter that went backwards (a driver reload), or that did not move for longer than
  ``max_energy_span_s``, adds nothing; so does a move that would mean more than
  ``MAX_GPU_POWER_W`` (no GPU draws that: one of the two readings was wrong), and a reading
  of 0 is no reading (NVML's counter counts from the driver's load; an H100 once read 0
  before its counter, and the move from 0 went to the hold);
- ``peak_memory_mib`` is the most memory seen in use on the unit while it was held.

A wall clock set back by more than ``max_gap_s`` is a gap too: the open holds end at their
last sighting and the holders seen then start new ones (a smaller step back skips the sweeps
until the clock is past the last one). The hourly totals do not count a wall-clock span twice
in one run: the part of a sweep's span that this run already added to the hours (the clock
lives it again after the step) is left out of them, while the holds count it.

A holder seen for the first time starts its hold at this sweep, or at its lease's grant
time when that is later than the previous sweep (so a lease granted just before a sweep
is counted from its grant); a holder no longer seen ends at the last sweep that saw it. So
each figure is within one sweep interval of the truth. Every amount is also added to the
UTC hour(s) it fell in, per grouping: ``gpu`` (the GPU's UUID; a MIG device counts under its
GPU), ``image`` and ``label:KEY`` for each recorded label key (``""`` for a holder without
it): what long reports read (``agent.usage.records``). A holder whose labels are not known
yet (``Holder.settled`` false: a lease before its container is created) keeps its hourly
amounts with its hold until they are, or until it ends.

``take_batch()`` hands over what changed since the last batch: one write of the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from agent.usage.records import Batch, Hold, HolderKind, HourDelta, Labels, hour_of

# More than any GPU draws (an H200 700 W, a B200 1,000 W, a GB300 superchip's GPU 1,400 W):
# a counter move that would mean more is a wrong reading, and counts nothing.
MAX_GPU_POWER_W = 5_000.0


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a unit in one sweep; ``ident`` names it on the node ("lease-3", a
    container id, "pid 42"), the rest is what the ledger records of it."""

    kind: HolderKind
    ident: str
    lease_id: str | None = None
    container_id: str | None = None
    container_name: str | None = None
    image: str | None = None
    pid: int | None = None
    labels: Labels = ()
    since_s: float | None = None  # a lease's grant time, when known
    idle_policy: str | None = None  # its nvidia-docker.idle label, as given (agent.usage.idle)
    # A lease's container runs (False: pending, or its container is stopped); None for the
    # other holders, which hold a unit only while they run (agent.usage.idle).
    running: bool | None = None
    # Its labels are final. False for a lease whose container is not known yet (pending, or
    # its engine has not said its labels): its hourly amounts wait, so that the seconds
    # before its container was created count under the container's labels too.
    settled: bool = True


@dataclass(frozen=True, slots=True)
class UnitSample:
    """One unit in one sweep."""

    unit: str  # dev name: "3", "0:1"
    gpu_index: int
    gpu_uuid: str
    mig_uuid: str | None
    utilization_pct: int | None  # None: no reading (MIG devices, a GPU that did not answer)
    memory_used_mib: int | None
    energy_mj: int | None  # the GPU's counter since the driver loaded; None for MIG devices
    holders: tuple[Holder, ...]
    # Working now, or not known to be idle: utilisation above 0, a GPU process of a holder,
    # or a reading that could not tell (agent.usage.ledger.build_samples).
    active: bool = False
    # When the energy counter was read (the slow sample's time); None: at the sweep.
    energy_at_s: float | None = None


@dataclass(slots=True)
class _Open:
    hold: Hold
    seen_at: float  # the sweep that last saw it
    resumed: bool = False  # the previous run's, not seen by this run yet
    settled: bool = True  # its holder's labels are known (see Holder.settled)
    # While not settled: its amounts by UTC hour, not yet in the hourly deltas.
    unsettled: dict[int, list[float]] = field(default_factory=dict)


class Accounting:
    """The holds open now and what changed since the last batch."""

    def __init__(
        self,
        label_keys: Sequence[str],
        *,
        max_gap_s: float,
        max_energy_span_s: float | None = None,
    ) -> None:
        self.label_keys = tuple(dict.fromkeys(label_keys))
        self.max_gap_s = max_gap_s
        # The longest time between two moves of a GPU's energy counter that is counted
        # (default: max_gap_s); see the module docstring.
        self.max_energy_span_s = max(max_gap_s, max_energy_span_s or 0.0)
        self._open: dict[str, _Open] = {}  # by (holder ident, unit key)
        self._dirty: dict[str, Hold] = {}  # by hold key: the figures to write
        self._deltas: dict[tuple[int, str, str], list[float]] = {}
        self._last_t: float | None = None
        self._last_util: dict[str, int | None] = {}  # by unit
        # By GPU index: when its energy counter was read at its last move, and the reading.
        self._last_energy: dict[int, tuple[float, int]] = {}
        # By GPU index: the unit-seconds each hold (by key) held it since that move.
        self._energy_held: dict[int, dict[str, tuple[float, Hold]]] = {}
        # The wall-clock spans this run added to the hourly totals: disjoint, in order, at
        # most MAX_SPANS (one while the clock only goes forward; one more per step back).
        self._counted: list[tuple[float, float]] = []
        self._sweep_from: float | None = None  # the earliest start added by this sweep

    @property
    def open_holds(self) -> tuple[Hold, ...]:
        return tuple(o.hold for o in self._open.values())

    def resume(self, holds: Iterable[Hold]) -> None:
        """The holds the previous run left open: each continues if its holder is still on
        its unit at the first sweep (the agent's time away counted only when it was within
        ``max_gap_s``), and ends at its last sighting otherwise."""
        for hold in holds:
            ident = _ident_of(hold)
            self._open[_slot(ident, hold.mig_uuid or hold.gpu_uuid)] = _Open(
                replace(hold), hold.last_seen_s, resumed=True
            )

    def observe(self, t_s: float, units: Sequence[UnitSample]) -> None:
        last = self._last_t
        if last is not None and t_s <= last:
            if last - t_s <= self.max_gap_s:
                return  # the same sweep again, or the clock went back a little: nothing to add
            # The wall clock was set back further: as after a gap, the holds end at their
            # last sighting and the holders seen now start new ones (instead of nothing being
            # counted until the clock is past the last sweep again).
            for slot in list(self._open):
                self._end(self._open.pop(slot))
            self._last_util.clear()
            self._last_energy.clear()
            self._energy_held.clear()
            self._last_t = last = None
        seen: set[str] = set()
        self._sweep_from = None
        for sample in units:
            self._observe_unit(t_s, sample, seen)
        for slot in [s for s in self._open if s not in seen]:
            self._end(self._open.pop(slot))
        if self._sweep_from is not None:
            self._count_span(self._sweep_from, t_s)
        self._last_t = t_s

    def _count_span(self, start_s: float, end_s: float) -> None:
        """Note [start_s, end_s) as added to the hours (merged with the spans it touches)."""
        spans = [*self._counted, (start_s, end_s)]
        spans.sort()
        merged: list[tuple[float, float]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._counted = merged[-MAX_SPANS:]

    def _uncounted(self, start_s: float, end_s: float) -> list[tuple[float, float]]:
        """The parts of [start_s, end_s) that no earlier sweep of this run added to the hours."""
        parts: list[tuple[float, float]] = []
        at = start_s
        for a, b in self._counted:
            if b <= at:
                continue
            if a >= end_s:
                break
            if a > at:
                parts.append((at, a))
            at = max(at, b)
        if at < end_s:
            parts.append((at, end_s))
        return parts

    def _end(self, current: _Open) -> None:
        self._settle(current)
        current.hold.ended_s = current.hold.last_seen_s
        self._dirty[current.hold.key] = current.hold

    def _observe_unit(self, t_s: float, sample: UnitSample, seen: set[str]) -> None:
        unit_key = sample.mig_uuid or sample.gpu_uuid
        util_then = self._last_util.get(unit_key)
        self._last_util[unit_key] = sample.utilization_pct
        counting, energy = self._energy_since(t_s, sample)  # energy: (joules, over seconds)
        held_since_move: dict[str, tuple[float, Hold]] | None = None
        if counting:  # the seconds held now count toward the counter's next move
            held_since_move = self._energy_held.setdefault(sample.gpu_index, {})
        holders = sample.holders
        share = 1.0 / len(holders) if holders else 0.0
        for holder in holders:
            slot = _slot(holder.ident, unit_key)
            seen.add(slot)
            current = self._open.get(slot)
            step = 0.0
            if current is not None and current.resumed:
                # The previous run's hold, its holder still there: it goes on; the time the
                # agent was away counts only if it was short.
                current.resumed = False
                gap = t_s - current.seen_at
                step = gap if 0.0 < gap <= self.max_gap_s else 0.0
            elif current is not None and t_s - current.seen_at > self.max_gap_s:
                self._end(current)  # not seen for too long: it ended at its last sighting
                current = None
            else:
                step = t_s - current.seen_at if current is not None else 0.0
            if current is None:
                started, step = t_s, 0.0
                last = self._last_t
                if holder.since_s is not None and last is not None and last < holder.since_s:
                    started, step = min(holder.since_s, t_s), max(0.0, t_s - holder.since_s)
                current = _Open(self._new_hold(holder, sample, started), t_s)
                current.settled = holder.settled
                self._open[slot] = current
            hold = current.hold
            self._refresh(hold, holder)
            busy = 0.0
            if step > 0.0 and sample.utilization_pct is not None:
                readings = [u for u in (util_then, sample.utilization_pct) if u is not None]
                busy = step * (sum(readings) / len(readings)) / 100.0 * share
            joules: float | None = None
            if held_since_move is not None and step > 0.0:
                unit_s = held_since_move.get(hold.key, (0.0, hold))[0] + step * share
                if energy is None:
                    held_since_move[hold.key] = (unit_s, hold)
                else:
                    held_since_move.pop(hold.key, None)
                    joules = energy[0] / energy[1] * unit_s  # the mean power, held
                    hold.energy_j = (hold.energy_j or 0.0) + joules
            hold.held_s += step
            hold.busy_s += busy
            if sample.memory_used_mib is not None:
                hold.peak_memory_mib = max(hold.peak_memory_mib or 0, sample.memory_used_mib)
            hold.last_seen_s = t_s
            current.seen_at = t_s
            self._dirty[hold.key] = hold
            if holder.settled and not current.settled:
                self._settle(current)
            if step > 0.0:
                start = t_s - step
                if self._sweep_from is None or start < self._sweep_from:
                    self._sweep_from = start
                self._add_to_hours(current, start, t_s, busy, joules or 0.0)
        if energy is not None and held_since_move:
            # Holds that ended before the move: their part, into their last hour.
            power_w = energy[0] / energy[1]
            for unit_s, gone in held_since_move.values():
                gone.energy_j = (gone.energy_j or 0.0) + power_w * unit_s
                self._dirty[gone.key] = gone
                self._add_hour(gone, hour_of(gone.last_seen_s), (0.0, 0.0, power_w * unit_s))
            held_since_move.clear()

    def _energy_since(
        self, t_s: float, sample: UnitSample
    ) -> tuple[bool, tuple[float, float] | None]:
        """Whether this sweep's held seconds count toward the GPU's energy (it has a counter
        read before this sweep: whole GPUs only), and, when the counter moved at this sweep,
        the joules since its previous move and over how many seconds of its readings. A
        first reading, a reset, a move after longer than ``max_energy_span_s`` or one faster
        than ``MAX_GPU_POWER_W`` counts nothing (the held seconds waiting for a move are
        forgotten); a reading of 0 is none."""
        if sample.mig_uuid is not None or sample.energy_mj is None or sample.energy_mj <= 0:
            return False, None
        before = self._last_energy.get(sample.gpu_index)
        if before is not None and before[1] == sample.energy_mj:
            if t_s - before[0] > self.max_energy_span_s:  # a counter that stopped
                self._energy_held.pop(sample.gpu_index, None)
            return True, None  # not sampled again yet: the held seconds wait for the move
        read_at = t_s if sample.energy_at_s is None else sample.energy_at_s
        self._last_energy[sample.gpu_index] = (read_at, sample.energy_mj)
        if before is None:
            return False, None
        then_s, then_mj = before
        seconds = read_at - then_s
        joules = (sample.energy_mj - then_mj) / 1000.0
        if (
            joules < 0.0
            or not 0.0 < seconds <= self.max_energy_span_s
            or joules / seconds > MAX_GPU_POWER_W
        ):
            self._energy_held.pop(sample.gpu_index, None)
            return False, None
        return True, (joules, seconds)

    def _new_hold(self, holder: Holder, sample: UnitSample, started_s: float) -> Hold:
        unit_key = sample.mig_uuid or sample.gpu_uuid
        return Hold(
            key=f"{holder.ident}|{unit_key}|{started_s:.3f}",
            gpu_uuid=sample.gpu_uuid,
            gpu_index=sample.gpu_index,
            unit=sample.unit,
            mig_uuid=sample.mig_uuid,
            holder=holder.kind,
            lease_id=holder.lease_id,
            container_id=holder.container_id,
            container_name=holder.container_name,
            image=holder.image,
            pid=holder.pid,
            labels=holder.labels,
            started_s=started_s,
            last_seen_s=started_s,
            ended_s=None,
        )

    @staticmethod
    def _refresh(hold: Hold, holder: Holder) -> None:
        """What became known since the hold started: a pending lease's container, the
        container's name and image once the engine said them."""
        hold.container_id = holder.container_id or hold.container_id
        hold.container_name = holder.container_name or hold.container_name
        hold.image = holder.image or hold.image
        if holder.labels:
            hold.labels = holder.labels

    def _add_to_hours(
        self, current: _Open, start_s: float, end_s: float, busy_s: float, energy_j: float
    ) -> None:
        """Spread the amounts of [start_s, end_s) over the UTC hours they fall in: into the
        hourly deltas, or, while the holder's labels are not known yet, into the hold's own
        unsettled hours (``_settle`` moves them, under the labels then known). The parts
        that an earlier sweep of this run added already (a clock set back) are left out."""
        span = end_s - start_s
        for from_s, until in self._uncounted(start_s, end_s):
            at = from_s
            while at < until:
                hour = hour_of(at)
                piece_end = min(until, hour + 3600)
                part = (piece_end - at) / span
                amounts = (piece_end - at, busy_s * part, energy_j * part)
                if current.settled:
                    self._add_hour(current.hold, hour, amounts)
                else:
                    kept = current.unsettled.setdefault(hour, [0.0, 0.0, 0.0])
                    for i, amount in enumerate(amounts):
                        kept[i] += amount
                at = piece_end

    def _settle(self, current: _Open) -> None:
        """The holder's labels are known (or the hold ended): its unsettled hours go to the
        hourly deltas under the labels the hold has now."""
        current.settled = True
        for hour, amounts in current.unsettled.items():
            self._add_hour(current.hold, hour, (amounts[0], amounts[1], amounts[2]))
        current.unsettled.clear()

    def _add_hour(self, hold: Hold, hour: int, amounts: tuple[float, float, float]) -> None:
        labels = dict(hold.labels)
        groups = [("gpu", hold.gpu_uuid), ("image", hold.image or "")]
        groups += [(f"label:{key}", labels.get(key, "")) for key in self.label_keys]
        for dim, value in groups:
            totals = self._deltas.setdefault((hour, dim, value), [0.0, 0.0, 0.0])
            for i, amount in enumerate(amounts):
                totals[i] += amount

    def take_batch(self) -> Batch | None:
        """What changed since the last batch (None: nothing)."""
        if not self._dirty and not self._deltas:
            return None
        holds = tuple(replace(hold) for hold in self._dirty.values())
        deltas = tuple(
            HourDelta(hour, dim, value, held, busy, energy)
            for (hour, dim, value), (held, busy, energy) in self._deltas.items()
        )
        self._dirty.clear()
        self._deltas.clear()
        return Batch(holds, deltas)


MAX_SPANS = 64  # counted wall-clock spans kept (Accounting._counted): the newest


def _slot(ident: str, unit_key: str) -> str:
    return f"{ident}|{unit_key}"


def _ident_of(hold: Hold) -> str:
    """The holder's ident as ``Holder.ident`` gives it, from a stored hold."""
    return hold.key.split("|", 1)[0]
