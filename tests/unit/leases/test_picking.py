"""Picking: the best-connected set first (NVLink, then one PCIe switch, then one NUMA node,
then across sockets), the least loaded among equals, and the cpuset hint of the chosen GPUs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent.gpu import nodefile
from agent.gpu.model import NodeInfo, PciLink
from agent.leases.answers import Refusal, Refused
from agent.leases.asks import Ask
from agent.leases.loads import GpuLoad
from agent.leases.picking import Connectivity, LoadOf, pick_gpus
from agent.leases.settings import LeaseSettings
from agent.leases.table import LeaseTable
from agent.leases.units import NodeUnits, Unit
from agent.node.status import Sweep
from agent.usage.table_feed import gpu_loads

from .nodes import T0, build_node, builtin, granted, healthy, names, nvswitch_16

NV = (PciLink.SAME_CPU, 4)  # NVLink between two GPUs of one socket
PIX = (PciLink.SINGLE_SWITCH, 0)
NODE_LINK = (PciLink.SAME_CPU, 0)
SYS = (PciLink.CROSS_CPU, 0)


def _pairs_info() -> NodeInfo:
    """8 GPUs, 0-3 on socket 0 and 4-7 on socket 1; NVLink pairs 0-1, 2-3, 4-5, 6-7; PCIe
    switches 0+2, 1+3, 4+6, 5+7 (so an NVLink pair spans two switches)."""
    links: dict[tuple[int, int], tuple[PciLink, int]] = {}
    for a in range(8):
        for b in range(a + 1, 8):
            same_socket = a // 4 == b // 4
            links[(a, b)] = NODE_LINK if same_socket else SYS
    for pair in ((0, 1), (2, 3), (4, 5), (6, 7)):
        links[pair] = NV
    for pair in ((0, 2), (1, 3), (4, 6), (5, 7)):
        links[pair] = PIX
    return build_node([0, 0, 0, 0, 1, 1, 1, 1], links)


def _pairs_node() -> LeaseTable:
    node = _pairs_info()
    return LeaseTable(node, healthy(node), now_s=T0)


def _take(table: LeaseTable, devices: str) -> None:
    granted(table.ask(Ask(devices=devices), T0))


def _busy(*utilization_pct: int) -> list[GpuLoad]:
    """Loads of GPUs by utilization alone (memory unknown)."""
    return [GpuLoad(u) for u in utilization_pct]


def _sweep_loads(file: nodefile.NodeFile) -> list[GpuLoad]:
    """The loads a status sweep of a simulated node gives the table (the ledger's feed)."""
    sweep = Sweep(file.info, tuple(d.status for d in file.devices), (), None)
    return gpu_loads(sweep)


def test_hgx_a_two_gpu_ask_gets_an_nvlink_pair_on_one_socket() -> None:
    table = LeaseTable(builtin("hgx-h200-8"), healthy(builtin("hgx-h200-8")), now_s=T0)
    grant = granted(table.ask(Ask(count=2), T0))
    assert names(grant) == ["0", "1"]
    assert grant.numa_nodes == (0,)
    assert "GPU 0, GPU 1; NUMA node 0" in grant.text


def test_hgx_least_loaded_among_equals_leaves_the_busy_pair_for_last() -> None:
    """GPUs 2 and 3 run a training job (97 %): every NVLink pair of one socket is equal, so
    the idle ones go first, socket 1's before the busy pair of socket 0."""
    file = nodefile.load("hgx-h200-8")
    table = LeaseTable(file.info, healthy(file.info), now_s=T0)
    table.set_load(_sweep_loads(file))
    got = [names(granted(table.ask(Ask(count=2), T0))) for _ in range(4)]
    assert got == [["0", "1"], ["4", "5"], ["6", "7"], ["2", "3"]]


def test_hgx_four_gpus_are_one_socket_the_idle_one() -> None:
    file = nodefile.load("hgx-h200-8")
    table = LeaseTable(file.info, healthy(file.info), now_s=T0)
    assert names(granted(table.ask(Ask(count=4), T0))) == ["0", "1", "2", "3"]  # no load known
    table = LeaseTable(file.info, healthy(file.info), now_s=T0)
    table.set_load(_sweep_loads(file))
    grant = granted(table.ask(Ask(count=4), T0))
    assert names(grant) == ["4", "5", "6", "7"]
    assert grant.numa_nodes == (1,)


def test_hgx_five_gpus_keep_four_on_one_socket_and_the_hint_names_both() -> None:
    file = nodefile.load("hgx-h200-8")
    table = LeaseTable(file.info, healthy(file.info), now_s=T0)
    table.set_load(_sweep_loads(file))
    grant = granted(table.ask(Ask(count=5), T0))
    assert names(grant) == ["0", "4", "5", "6", "7"]  # 4 cross-socket pairs, not 6
    assert grant.numa_nodes == (0, 1)
    assert "GPU 7; NUMA nodes 0,1; create" in grant.text


def test_no_cpuset_leaves_the_hint_out() -> None:
    node = builtin("hgx-h200-8")
    table = LeaseTable(node, healthy(node), now_s=T0)
    grant = granted(table.ask(Ask(count=2, cpuset=False), T0))
    assert grant.numa_nodes is None
    assert "NUMA" not in grant.text


def test_pairs_node_nvlink_first() -> None:
    table = _pairs_node()
    assert names(granted(table.ask(Ask(count=2), T0))) == ["0", "1"]
    assert names(granted(table.ask(Ask(count=2), T0))) == ["2", "3"]


def test_pairs_node_an_nvlink_pair_beats_one_pcie_switch() -> None:
    table = _pairs_node()
    _take(table, "1 3")  # 0 and 2 share a switch; 4-5 and 6-7 are NVLink pairs
    grant = granted(table.ask(Ask(count=2), T0))
    assert names(grant) == ["4", "5"]
    assert grant.numa_nodes == (1,)


def test_pairs_node_one_pcie_switch_beats_one_numa_node() -> None:
    table = _pairs_node()
    _take(table, "1 2 5 7")  # left: 0+3 (socket 0, no switch), 4+6 (socket 1, one switch)
    assert names(granted(table.ask(Ask(count=2), T0))) == ["4", "6"]
    assert names(granted(table.ask(Ask(count=2), T0))) == ["0", "3"]


def test_pairs_node_one_numa_node_beats_across_sockets() -> None:
    table = _pairs_node()
    _take(table, "1 2 5 6 7")  # left: 0 and 3 (socket 0, no switch, no NVLink), 4 (socket 1)
    grant = granted(table.ask(Ask(count=2), T0))
    assert names(grant) == ["0", "3"]
    assert grant.numa_nodes == (0,)


def test_pairs_node_least_loaded_among_equals() -> None:
    table = _pairs_node()
    table.set_load(_busy(90, 90, 0, 0, 50, 50, 0, 0))
    assert names(granted(table.ask(Ask(count=2), T0))) == ["2", "3"]
    assert names(granted(table.ask(Ask(count=2), T0))) == ["6", "7"]
    assert names(granted(table.ask(Ask(count=2), T0))) == ["4", "5"]


def test_among_equally_connected_gpus_the_less_loaded_is_picked() -> None:
    table = _pairs_node()
    table.set_load([GpuLoad(95, 99), GpuLoad(0, 1), GpuLoad(0, 80)] + [GpuLoad(60)] * 5)
    assert names(granted(table.ask(Ask(count=1), T0))) == ["1"]  # idle
    # GPU 2 computes nothing, but its memory is 80 % used: after the GPUs at 60 %
    got = [names(granted(table.ask(Ask(count=1), T0))) for _ in range(7)]
    assert got == [["3"], ["4"], ["5"], ["6"], ["7"], ["2"], ["0"]]


def test_load_within_one_step_of_10_percent_ties_and_goes_by_index() -> None:
    table = _pairs_node()
    table.set_load([GpuLoad(7, 3), GpuLoad(0, 0), GpuLoad(2, 9)] + [GpuLoad(10)] * 5)
    got = [names(granted(table.ask(Ask(count=1), T0))) for _ in range(3)]
    assert got == [["0"], ["1"], ["2"]]  # idle noise does not reorder idle GPUs


def test_connection_quality_wins_over_load() -> None:
    table = _pairs_node()
    _take(table, "3 5 7")  # left: the NVLink pair 0+1, the PCIe switch pairs 0+2 and 4+6
    table.set_load([GpuLoad(100, 100), GpuLoad(100, 100), *[GpuLoad(0, 0)] * 6])
    assert names(granted(table.ask(Ask(count=2), T0))) == ["0", "1"]  # busy, but NVLink
    assert names(granted(table.ask(Ask(count=2), T0))) == ["4", "6"]  # one switch, not SYS


def test_leases_on_a_shared_gpu_weigh_before_its_load() -> None:
    node = builtin("hgx-h200-8")
    table = LeaseTable(node, healthy(node), LeaseSettings(sharing=2), now_s=T0)
    table.set_load([GpuLoad(90)] + [GpuLoad(0)] * 7)
    picks = [names(granted(table.ask(Ask(exclusive=False), T0))) for _ in range(9)]
    assert picks == [["1"], ["2"], ["3"], ["4"], ["5"], ["6"], ["7"], ["0"], ["1"]]


def test_loads_are_replaced_by_each_sweep_and_forgotten_at_a_node_change() -> None:
    node = _pairs_info()
    table = LeaseTable(node, healthy(node), now_s=T0)
    table.set_load(_busy(90))
    assert names(granted(table.ask(Ask(count=1), T0))) == ["1"]
    table.set_load(_busy(0, 90))  # the next sweep: GPU 0 idle again
    assert names(granted(table.ask(Ask(count=1), T0))) == ["0"]
    table.set_load(_busy(0, 0, 90))
    table.set_node(node, healthy(node), T0)  # a driver reload: indices may mean other GPUs
    assert names(granted(table.ask(Ask(count=1), T0))) == ["2"]


LOADS = st.lists(
    st.tuples(st.none() | st.integers(0, 100), st.none() | st.integers(0, 100)),
    min_size=8,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(loads=LOADS, taken=st.sets(st.integers(0, 7), max_size=5), count=st.integers(1, 4))
def test_loads_never_cost_connection_and_get_the_least_loaded_equal_set(
    loads: list[tuple[int | None, int | None]], taken: set[int], count: int
) -> None:
    """Whatever the loads: the pick is as well connected as without them, no equally
    connected free set is less loaded, and the same inputs pick the same GPUs."""
    node = _pairs_info()
    conn = Connectivity(node)
    free = [g for g in range(8) if g not in taken]
    assume(len(free) >= count)
    gpu_loads = [GpuLoad(u, m) for u, m in loads]

    def quality(gpus: Sequence[int]) -> list[tuple[int, int, int]]:
        return sorted(conn.score(a, b) for a, b in itertools.combinations(gpus, 2))

    def level(gpus: Sequence[int]) -> int:
        return sum(gpu_loads[g].level for g in gpus)

    def pick(with_loads: bool) -> list[int]:
        table = LeaseTable(node, healthy(node), now_s=T0)
        if taken:
            _take(table, " ".join(map(str, sorted(taken))))
        if with_loads:
            table.set_load(gpu_loads)
        return [int(n) for n in names(granted(table.ask(Ask(count=count), T0)))]

    loaded = pick(True)
    assert quality(loaded) == quality(pick(False))
    for other in itertools.combinations(free, count):
        if quality(other) == quality(loaded):
            assert level(loaded) <= level(other), (loaded, other)
    assert pick(True) == loaded


def test_across_sockets_when_nothing_better_is_left() -> None:
    table = _pairs_node()
    _take(table, "1 2 3 5 6 7")
    grant = granted(table.ask(Ask(count=2), T0))
    assert names(grant) == ["0", "4"]
    assert grant.numa_nodes == (0, 1)


def test_unknown_links_fall_back_to_the_numa_nodes() -> None:
    node = build_node([0, 1, 1])  # no topology at all
    table = LeaseTable(node, healthy(node), now_s=T0)
    assert names(granted(table.ask(Ask(count=2), T0))) == ["1", "2"]


def test_pcie_only_node_prefers_the_switch_pair() -> None:
    links = {(0, 1): PIX, (2, 3): PIX, (0, 2): SYS, (0, 3): SYS, (1, 2): SYS, (1, 3): SYS}
    node = build_node([0, 0, 1, 1], links)
    table = LeaseTable(node, healthy(node), now_s=T0)
    _take(table, "0")
    assert names(granted(table.ask(Ask(count=2), T0))) == ["2", "3"]  # not 1 with 2 or 3


def test_shared_asks_spread_over_the_least_shared_gpus_first() -> None:
    node = builtin("hgx-h200-8")
    table = LeaseTable(node, healthy(node), LeaseSettings(sharing=2), now_s=T0)
    picks = [names(granted(table.ask(Ask(exclusive=False), T0))) for _ in range(9)]
    assert picks == [["0"], ["1"], ["2"], ["3"], ["4"], ["5"], ["6"], ["7"], ["0"]]


def test_a_16_gpu_node_gets_its_best_set_for_every_ask() -> None:
    """With GPU 8 taken, a 10-GPU ask takes a whole socket and the one PCIe switch pair of
    the other that is whole (10+11), not 9 and 10 (two switches): the set comparing every
    set of 10 finds, which a greedy search missed."""
    node = nvswitch_16()
    table = LeaseTable(node, healthy(node), now_s=T0)
    _take(table, "8")
    got = names(granted(table.ask(Ask(count=10), T0)))
    assert got == [str(g) for g in (0, 1, 2, 3, 4, 5, 6, 7, 10, 11)]


def test_islands_of_four_on_16_gpus_keep_an_8_gpu_ask_on_one_socket() -> None:
    links: dict[tuple[int, int], tuple[PciLink, int]] = {}
    for a in range(16):
        for b in range(a + 1, 16):
            same_socket = a // 8 == b // 8
            links[(a, b)] = NODE_LINK if same_socket else SYS
            if a // 4 == b // 4:
                links[(a, b)] = NV
    node = build_node([i // 8 for i in range(16)], links)
    units = NodeUnits(node)
    idle: LoadOf = lambda u: (0, 0)  # noqa: E731
    chosen = pick_gpus(units.whole_gpus(), 8, Connectivity(node), idle)
    assert [u.gpu for u in chosen] == list(range(8))
    free = [u for u in units.whole_gpus() if u.gpu not in (0, 5)]
    chosen = pick_gpus(free, 4, Connectivity(node), idle)
    assert [u.gpu for u in chosen] == [8, 9, 10, 11]  # the first whole island


LINKS = st.sampled_from([NV, PIX, NODE_LINK, SYS, (PciLink.HOST_BRIDGE, 0), (PciLink.UNKNOWN, 0)])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), size=st.integers(2, 9))
def test_the_pick_is_the_best_of_every_set(data: st.DataObject, size: int) -> None:
    """Any links, sockets, loads and count: the pick is the set that comparing every set of
    that many free GPUs gives (its worst pair best, then its next worst, ...; then the fewest
    leases and the lowest busy level; then the lowest indices)."""
    numa = data.draw(st.lists(st.sampled_from([0, 1, None]), min_size=size, max_size=size))
    links = {
        pair: data.draw(LINKS, label=str(pair)) for pair in itertools.combinations(range(size), 2)
    }
    node = build_node(numa, links)
    conn = Connectivity(node)
    free = [u for u in NodeUnits(node).whole_gpus() if data.draw(st.booleans(), label="free")]
    assume(free)
    loads = {u.gpu: data.draw(st.tuples(st.integers(0, 2), st.integers(0, 10))) for u in free}
    count = data.draw(st.integers(1, len(free)), label="count")

    def key(units: Sequence[Unit]) -> tuple[list[tuple[int, ...]], tuple[int, int], list[int]]:
        worst_first = sorted(conn.score(a.gpu, b.gpu) for a, b in itertools.combinations(units, 2))
        leases, busy = (sum(loads[u.gpu][i] for u in units) for i in (0, 1))
        return [tuple(-v for v in s) for s in worst_first], (leases, busy), [u.gpu for u in units]

    best = min(itertools.combinations(free, count), key=key)
    assert pick_gpus(free, count, conn, lambda u: loads[u.gpu]) == best


def test_mig_profile_ask_on_h200x2_mig() -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    first = granted(table.ask(Ask(mig_profile="1g.18gb"), T0))
    assert names(first) == ["0:2"]
    assert first.units[0].uuid == node.devices[0].mig_devices[2].uuid
    assert first.units[0].profile == "1g.18gb"
    assert first.numa_nodes == (0,)
    assert first.dev == node.devices[0].mig_devices[2].uuid
    assert names(granted(table.ask(Ask(mig_profile="1g.18gb"), T0))) == ["0:3"]
    third = table.ask(Ask(mig_profile="1g.18gb"), T0).answer
    assert isinstance(third, Refused)
    assert third.kind is Refusal.NOT_ENOUGH
    assert third.text.startswith("not enough free MIG devices 1g.18gb: asked for 1, 0 free;")
    assert names(granted(table.ask(Ask(mig_profile="3g.71gb"), T0))) == ["0:0"]
    assert names(granted(table.ask(Ask(count=1), T0))) == ["1"]  # the GPU not in MIG mode


def test_mig_profile_ask_for_two_takes_two_of_that_profile() -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    assert names(granted(table.ask(Ask(count=2, mig_profile="1g.18gb"), T0))) == ["0:2", "0:3"]


def test_mig_devices_go_least_loaded_first() -> None:
    node = build_node([0, 1], migs={0: ["1g.10gb", "1g.10gb"], 1: ["1g.10gb", "1g.10gb"]})
    table = LeaseTable(node, healthy(node), now_s=T0)
    table.set_load(_busy(80, 10))
    assert names(granted(table.ask(Ask(mig_profile="1g.10gb"), T0))) == ["1:0"]


@pytest.mark.parametrize(
    ("ask", "line"),
    [
        (
            Ask(count=2),
            "asked for 2 GPUs: this node has 1 GPU to lease (in MIG mode: GPU 0; ask for a MIG "
            "profile: 3g.71gb, 2g.35gb, 1g.18gb)",
        ),
        (
            Ask(mig_profile="7g.141gb"),
            "asked for MIG 7g.141gb: this node has 0 MIG devices of that profile (its profiles: "
            "3g.71gb, 2g.35gb, 1g.18gb)",
        ),
        (
            Ask(count=3, mig_profile="1g.18gb"),
            "asked for MIG 1g.18gb x3: this node has 2 MIG devices of that profile (its "
            "profiles: 3g.71gb, 2g.35gb, 1g.18gb)",
        ),
    ],
)
def test_more_than_the_node_has_is_impossible_at_once(ask: Ask, line: str) -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    answer = table.ask(replace(ask, wait_s=30.0), T0).answer
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.IMPOSSIBLE
    assert answer.text == line
    assert table.view().waiting == ()
