"""The ledger's arithmetic (agent.usage.accounting): sweeps in, holds and hourly totals out."""

from __future__ import annotations

import pytest

from agent.usage.accounting import Accounting, Holder, UnitSample
from agent.usage.records import Batch, HolderKind, hour_of

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
T0 = 1_764_633_600.0  # 2025-12-02T00:00:00Z, an hour's first second
ALICE = Holder(
    HolderKind.LEASE, "lease-1", lease_id="lease-1", container_id="c1", container_name="train",
    image="pytorch:2", labels=(("team", "ml"),),
)  # fmt: skip
BOB = Holder(HolderKind.CONTAINER, "c2", container_id="c2", image="jax:1")


def sample(
    *holders: Holder,
    util: int | None = 50,
    memory: int | None = 1000,
    energy: int | None = None,
    gpu: str = GPU0,
    index: int = 0,
) -> UnitSample:
    return UnitSample(str(index), index, gpu, None, util, memory, energy, holders)


def run(accounting: Accounting, *sweeps: tuple[float, list[UnitSample]]) -> Batch:
    for t_s, units in sweeps:
        accounting.observe(t_s, units)
    batch = accounting.take_batch()
    assert batch is not None
    return batch


def totals(batch: Batch, dim: str, value: str) -> tuple[float, float, float]:
    found = [d for d in batch.deltas if d.dim == dim and d.value == value]
    return (
        sum(d.held_s for d in found),
        sum(d.busy_s for d in found),
        sum(d.energy_j for d in found),
    )


def test_held_and_busy_seconds_add_up_between_sweeps() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    batch = run(accounting, *[(T0 + 10 * i, [sample(ALICE)]) for i in range(7)])
    (hold,) = batch.holds
    assert hold.held_s == pytest.approx(60.0)
    assert hold.busy_s == pytest.approx(30.0)
    assert hold.peak_memory_mib == 1000
    assert hold.started_s == T0
    assert hold.ended_s is None
    assert hold.container_name == "train"
    assert hold.labels == (("team", "ml"),)
    assert totals(batch, "gpu", GPU0)[:2] == pytest.approx((60.0, 30.0))
    assert totals(batch, "label:team", "ml")[:2] == pytest.approx((60.0, 30.0))
    assert totals(batch, "image", "pytorch:2")[:2] == pytest.approx((60.0, 30.0))


def test_a_holder_that_leaves_ends_at_its_last_sighting_and_a_new_one_starts() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(
        accounting,
        (T0, [sample(ALICE)]),
        (T0 + 10, [sample(ALICE)]),
        (T0 + 20, [sample(BOB)]),
        (T0 + 30, [sample(BOB)]),
    )
    by_key = {h.container_id: h for h in batch.holds}
    assert by_key["c1"].ended_s == T0 + 10
    assert by_key["c1"].held_s == pytest.approx(10.0)
    assert by_key["c2"].started_s == T0 + 20
    assert by_key["c2"].held_s == pytest.approx(10.0)
    assert by_key["c2"].ended_s is None


def test_a_lease_granted_between_sweeps_counts_from_its_grant() -> None:
    accounting = Accounting([], max_gap_s=30)
    granted = Holder(HolderKind.LEASE, "lease-2", lease_id="lease-2", since_s=T0 + 4)
    batch = run(accounting, (T0, [sample()]), (T0 + 10, [sample(granted)]))
    (hold,) = batch.holds
    assert hold.started_s == T0 + 4
    assert hold.held_s == pytest.approx(6.0)


def test_a_shared_unit_shares_busy_seconds_and_energy_but_each_holds_it() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(
        accounting,
        (T0, [sample(ALICE, BOB, util=100, energy=1_000_000)]),
        (T0 + 10, [sample(ALICE, BOB, util=100, energy=1_300_000)]),
    )
    for hold in batch.holds:
        assert hold.held_s == pytest.approx(10.0)
        assert hold.busy_s == pytest.approx(5.0)
        assert hold.energy_j == pytest.approx(150.0)
    assert totals(batch, "gpu", GPU0) == pytest.approx((20.0, 10.0, 300.0))


def test_a_gap_longer_than_allowed_is_not_counted_as_held() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(
        accounting,
        (T0, [sample(ALICE)]),
        (T0 + 10, [sample(ALICE)]),
        (T0 + 500, [sample(ALICE)]),  # the agent was away
        (T0 + 510, [sample(ALICE)]),
    )
    first, second = sorted(batch.holds, key=lambda h: h.started_s)
    assert first.ended_s == T0 + 10
    assert first.held_s == pytest.approx(10.0)
    assert second.started_s == T0 + 500
    assert second.held_s == pytest.approx(10.0)


def test_an_energy_counter_that_went_back_adds_nothing() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(
        accounting,
        (T0, [sample(ALICE, energy=5_000_000)]),
        (T0 + 10, [sample(ALICE, energy=1_000)]),  # the driver was reloaded
        (T0 + 20, [sample(ALICE, energy=201_000)]),
    )
    (hold,) = batch.holds
    assert hold.energy_j == pytest.approx(200.0)


def test_a_counter_read_as_0_first_gives_no_hold_the_whole_counter() -> None:
    """A GPU that ran for a day before the agent: NVML's field read 0 once, then the counter
    (4.9 MJ). The move from 0 is no energy of the hold's (before, the hold got the whole
    4.9 MJ); from the next move on, it gets the GPU's power (74 W) times its seconds."""
    accounting = Accounting([], max_gap_s=30, max_energy_span_s=180)
    batch = run(
        accounting,
        (T0, [sample(ALICE, energy=0)]),
        (T0 + 1, [sample(ALICE, energy=4_931_200_000)]),
        *[(T0 + 1 + 10 * i, [sample(ALICE, energy=4_931_200_000)]) for i in range(1, 6)],
        (T0 + 61, [sample(ALICE, energy=4_931_200_000 + 74 * 60 * 1000)]),
    )
    (hold,) = batch.holds
    assert hold.energy_j == pytest.approx(74 * 60)


def test_a_move_faster_than_any_gpu_draws_counts_nothing() -> None:
    accounting = Accounting([], max_gap_s=30, max_energy_span_s=180)
    batch = run(
        accounting,
        (T0, [sample(ALICE, energy=1_000_000)]),
        (T0 + 10, [sample(ALICE, energy=1_000_000 + 100_000_000)]),  # 10 kW: a wrong reading
        (T0 + 20, [sample(ALICE, energy=1_000_000 + 100_000_000 + 4_000_000)]),  # 400 W
    )
    (hold,) = batch.holds
    assert hold.energy_j == pytest.approx(4_000.0)


def test_a_counter_sampled_less_often_than_the_sweeps_gives_each_holder_its_own_part() -> None:
    """The counter is the slow sample's: it stays the same for sweeps, then moves by what
    the GPU used since its last move. Alice held the GPU for the first part of that, Bob
    for the last: each gets their part, not Bob the whole move."""
    accounting = Accounting([], max_gap_s=30, max_energy_span_s=120)
    batch = run(
        accounting,
        (T0, [sample(ALICE, energy=1_000_000)]),
        (T0 + 10, [sample(ALICE, energy=1_000_000)]),
        (T0 + 20, [sample(ALICE, BOB, energy=1_000_000)]),  # Bob joins: a shared unit
        (T0 + 30, [sample(BOB, energy=1_000_000)]),
        (T0 + 40, [sample(BOB, energy=5_000_000)]),  # 4,000 J over 40 s
    )
    by_id = {h.container_id: h for h in batch.holds}
    # The GPU drew 100 W. Alice: 10 s alone, then 10 s of a unit shared with Bob (seen
    # first at T0 + 20): 15 unit-seconds; her hold ended before the move and gets its part
    # then. Bob held it alone from T0 + 20: 20 unit-seconds.
    assert by_id["c1"].ended_s == T0 + 20
    assert by_id["c1"].energy_j == pytest.approx(1500.0)
    assert by_id["c2"].energy_j == pytest.approx(2000.0)
    assert totals(batch, "gpu", GPU0)[2] == pytest.approx(3500.0)
    assert totals(batch, "image", "pytorch:2")[2] == pytest.approx(1500.0)  # Alice's image


def test_a_counter_that_does_not_move_for_too_long_adds_nothing() -> None:
    accounting = Accounting([], max_gap_s=30, max_energy_span_s=60)
    sweeps = [(T0 + 10 * i, [sample(ALICE, energy=1_000_000)]) for i in range(9)]
    batch = run(
        accounting,
        *sweeps,  # 80 s without a move: the sampler rested
        (T0 + 90, [sample(ALICE, energy=9_000_000)]),
        (T0 + 100, [sample(ALICE, energy=9_500_000)]),
    )
    (hold,) = batch.holds
    assert hold.held_s == pytest.approx(100.0)
    assert hold.energy_j == pytest.approx(500.0)  # only the last move's 10 s


def test_a_unit_without_a_reading_adds_held_but_not_busy_seconds() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(accounting, (T0, [sample(ALICE, util=None)]), (T0 + 10, [sample(ALICE, util=None)]))
    (hold,) = batch.holds
    assert (hold.held_s, hold.busy_s) == pytest.approx((10.0, 0.0))


def test_amounts_are_split_over_the_hours_they_fall_in() -> None:
    accounting = Accounting([], max_gap_s=30)
    batch = run(
        accounting,
        (T0 - 5, [sample(ALICE, util=100)]),
        (T0 + 15, [sample(ALICE, util=100)]),
    )
    hours = {d.hour_s: d.held_s for d in batch.deltas if d.dim == "gpu"}
    assert hours == pytest.approx({hour_of(T0 - 5): 5.0, T0: 15.0})


def test_holders_without_a_recorded_label_group_under_an_empty_value() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    batch = run(accounting, (T0, [sample(BOB)]), (T0 + 10, [sample(BOB)]))
    assert totals(batch, "label:team", "")[0] == pytest.approx(10.0)


def test_a_batch_holds_only_what_changed_since_the_last_one() -> None:
    accounting = Accounting([], max_gap_s=30)
    run(accounting, (T0, [sample(ALICE)]), (T0 + 10, [sample(ALICE)]))
    assert accounting.take_batch() is None
    accounting.observe(T0 + 10, [sample(ALICE)])  # the same sweep again: nothing new
    assert accounting.take_batch() is None
    batch = run(accounting, (T0 + 20, [sample(ALICE)]))
    assert [h.held_s for h in batch.holds] == pytest.approx([20.0])
    assert totals(batch, "gpu", GPU0)[0] == pytest.approx(10.0)


def test_the_previous_runs_open_holds_continue_or_end() -> None:
    first = Accounting([], max_gap_s=30)
    left_open = run(first, (T0, [sample(ALICE), sample(BOB, gpu=GPU1, index=1)]),
                    (T0 + 10, [sample(ALICE), sample(BOB, gpu=GPU1, index=1)])).holds  # fmt: skip
    restarted = Accounting([], max_gap_s=30)
    restarted.resume(left_open)
    batch = run(restarted, (T0 + 25, [sample(ALICE), sample(gpu=GPU1, index=1)]))
    by_key = {h.container_id: h for h in batch.holds}
    assert by_key["c1"].held_s == pytest.approx(25.0)  # seen again within the gap: it goes on
    assert by_key["c1"].ended_s is None
    assert by_key["c2"].ended_s == T0 + 10  # gone: it ended where it was last seen


def test_after_a_long_restart_the_hold_goes_on_without_the_time_away() -> None:
    first = Accounting([], max_gap_s=30)
    left_open = run(first, (T0, [sample(ALICE)]), (T0 + 10, [sample(ALICE)])).holds
    restarted = Accounting([], max_gap_s=30)
    restarted.resume(left_open)
    batch = run(restarted, (T0 + 600, [sample(ALICE)]), (T0 + 610, [sample(ALICE)]))
    (hold,) = batch.holds
    assert hold.key == left_open[0].key
    assert hold.ended_s is None
    assert hold.held_s == pytest.approx(20.0)  # 10 before, 10 after; the 590 away not counted


def test_a_leases_seconds_before_its_container_count_under_the_containers_labels() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    pending = Holder(HolderKind.LEASE, "lease-1", lease_id="lease-1", settled=False)
    batch = run(
        accounting,
        (T0, [sample(pending)]),
        (T0 + 10, [sample(pending)]),  # granted, its container not created yet
        (T0 + 20, [sample(ALICE)]),  # created with team=ml
        (T0 + 30, [sample(ALICE)]),
    )
    assert totals(batch, "label:team", "ml")[0] == pytest.approx(30.0)
    assert totals(batch, "label:team", "")[0] == 0.0


def test_a_hold_that_ends_unsettled_counts_under_what_it_had() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    pending = Holder(HolderKind.LEASE, "lease-1", lease_id="lease-1", settled=False)
    batch = run(accounting, (T0, [sample(pending)]), (T0 + 10, [sample(pending)]), (T0 + 20, []))
    assert totals(batch, "label:team", "")[0] == pytest.approx(10.0)


def test_a_clock_set_back_ends_the_holds_and_counts_on_from_the_new_time() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    before = [(T0 + 10 * i, [sample(ALICE)]) for i in range(4)]  # 30 s held
    back = T0 - 3600  # the wall clock set back an hour at T0 + 35 s
    after = [(back + 5 + 10 * i, [sample(ALICE)]) for i in range(4)]  # 30 s more
    batch = run(accounting, *before, *after)
    second, first = sorted(batch.holds, key=lambda h: h.started_s)
    assert (first.started_s, first.ended_s, first.held_s) == (T0, T0 + 30, 30.0)
    assert (second.started_s, second.ended_s, second.held_s) == (back + 5, None, 30.0)
    assert totals(batch, "gpu", GPU0)[0] == pytest.approx(60.0)


def test_a_clock_set_back_does_not_count_the_span_it_lives_again_in_the_hours() -> None:
    accounting = Accounting(["team"], max_gap_s=30)
    before = [(T0 + 10 * i, [sample(ALICE)]) for i in range(61)]  # T0 to T0 + 600
    back = T0 + 305  # the wall clock set back 305 s at T0 + 610
    after = [(back + 10 * i, [sample(ALICE)]) for i in range(61)]  # to T0 + 905
    batch = run(accounting, *before, *after)
    assert sorted(h.held_s for h in batch.holds) == pytest.approx([600.0, 600.0])
    # the hour counts the wall-clock span T0 .. T0 + 905 once, not 1200 s of it
    assert totals(batch, "gpu", GPU0)[:2] == pytest.approx((905.0, 452.5))
    assert totals(batch, "label:team", "ml")[0] == pytest.approx(905.0)
