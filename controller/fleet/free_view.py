"""Which nodes have N free healthy GPUs now, and their best-connected set: ``free``.

A query, not a scheduler: nothing is asked for, so another client may take the GPUs a moment
later. Each node is asked ``GET /leases/free?count=N`` (``&mig_profile=P``): what an
exclusive ask would get there now, picked by the agent itself with its GPUs' loads, in one
small answer (``free_query``). An agent older than that route (HTTP 404 or 405) is asked
next, on the same connection, for its ``/leases/json`` (who holds what) and, when a set of
two or more whole GPUs is picked, its ``/gpu/info/json`` (the topology), and the set is
picked here:

- free units: no holder, healthy (``lease_view.is_free``); whole GPUs, or with ``mig`` the
  MIG devices of that profile;
- a node qualifies when it has at least ``count`` of them; its set is the one the agent's
  own picker would choose for idle GPUs (``agent.leases.picking.pick_gpus`` on the same
  connectivity: NVLink, then the same PCIe switch, then the same NUMA node, then across CPU
  sockets, a set as good as its worst pair; for one GPU the picker's choice among equals,
  the lowest index, which needs no topology), MIG devices in index order (``pick_migs``).

Either way, qualifying nodes are sorted best-connected first (worst pair, then the next
worst...), the nodes' order among equals. Only the qualifying nodes' few facts are kept
(``Candidate``), never the answers.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.gpu.model import Clocks, DeviceInfo, DeviceMemory, NodeInfo, PciInfo, PciLink, PeerLink
from agent.leases.picking import Connectivity, link_words, pick_gpus
from agent.leases.picking import pick_migs as _pick_migs
from agent.leases.units import Unit
from controller.fleet.lease_view import LEASES_REQUEST, TOO_OLD, is_free, units
from controller.fleet.query import INFO_REQUEST, NodeResult, Query, Request, json_int
from controller.fleet.table import Column, Row, render

FREE_PATH = "/leases/free"
MAX_NOTES = 1000  # agents too old for leases named on stderr; the rest are counted
MAX_PICKS = 4096  # picks remembered for nodes of the same shape (then forgotten, all at once)

FREE_COLUMNS = (
    Column("NODE", min_width=8),
    Column("FREE", right=True),
    Column("SET"),
    Column("LINK"),
    Column("NUMA"),
)

PairScore = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class FreeAsk:
    """What ``free`` looks for: ``count`` whole GPUs, or MIG devices of ``mig``."""

    count: int = 1
    mig: str | None = None

    @property
    def what(self) -> str:
        kind = f"{self.mig} MIG device" if self.mig else "GPU"
        return f"{self.count} free healthy {kind}{'s' if self.count != 1 else ''}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that qualifies: how many are free, the set, how well it is joined."""

    order: int  # the node's place in the nodes as named (ties keep it)
    node: str
    free: int
    total: int
    names: tuple[str, ...]  # dev names of the set: "2", "3:0"
    link: str  # the set's worst link in words, "-" for one GPU or MIG devices
    numa: tuple[int, ...]
    rank: tuple[PairScore, ...]  # pair scores, worst first: larger is better

    def row(self) -> Row:
        numa = ",".join(map(str, self.numa)) or "-"
        return (self.node, f"{self.free}/{self.total}", ",".join(self.names), self.link, numa)

    def json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "free": self.free,
            "units": self.total,
            "set": list(self.names),
            "link": self.link,
            "numa_nodes": list(self.numa),
        }


def free_query(ask: FreeAsk) -> Query:
    """What ``free`` asks each node for ``ask``: ``/leases/free``; an agent older than that
    route, its leases, and its topology too only where a set of two or more whole GPUs is
    picked here (one request instead of two for ``--gpus 1``, the default, and for MIG)."""
    params = {"count": str(ask.count)}
    if ask.mig is not None:
        params["mig_profile"] = ask.mig
    unlinked = ask.mig is not None or ask.count == 1  # no pair to score: no topology read
    older = (LEASES_REQUEST,) if unlinked else (INFO_REQUEST, LEASES_REQUEST)
    return Query("free", (Request("free", FREE_PATH, params, must_have="Set", instead=older),))


def _link(value: Any) -> PciLink:
    try:
        return PciLink(json_int(value) or 0)
    except ValueError:  # a newer agent's link kind: unknown here
        return PciLink.UNKNOWN


def node_topology(info: Any) -> NodeInfo:
    """The part of ``/gpu/info/json`` the picker reads (bus ids, peer links, NUMA nodes)."""
    devices = info.get("Devices") if isinstance(info, Mapping) else None
    made = []
    for index, given in enumerate(devices if isinstance(devices, list) else []):
        device: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        pci = device.get("PCI")
        bus = pci.get("BusID") if isinstance(pci, Mapping) else None
        peers = []
        listed = device.get("Topology")
        for peer in listed if isinstance(listed, list) else []:
            if isinstance(peer, Mapping) and isinstance(peer.get("BusID"), str):
                nvlinks = json_int(peer.get("NVLinks")) or 0
                peers.append(PeerLink(peer["BusID"], _link(peer.get("Link")), nvlinks))
        made.append(
            DeviceInfo(
                index=index,
                uuid=None,
                path=None,
                model=None,
                power_w=None,
                cpu_affinity=json_int(device.get("CPUAffinity")),
                pci=PciInfo(bus if isinstance(bus, str) else f"unknown-{index}", None, None),
                clocks=Clocks(None, None),
                topology=tuple(peers),
                family=None,
                arch=None,
                cores=None,
                memory=DeviceMemory(None, None, None, None, None, None),
            )
        )
    return NodeInfo("", "", tuple(made))


def _unit(unit: Mapping[str, Any]) -> Unit | None:
    gpu = json_int(unit.get("GPU"))
    if gpu is None:
        return None
    uuid, profile = unit.get("UUID"), unit.get("Profile")
    return Unit(
        gpu,
        json_int(unit.get("MIG")),
        uuid if isinstance(uuid, str) else None,
        profile if isinstance(profile, str) else None,
        json_int(unit.get("NumaNode")),
        None,
    )


def _no_load(_: Unit) -> tuple[int, int]:
    return (0, 0)  # free units: no leases on them; utilization is not asked for


# (topology signature, the free GPUs' indices, count) -> (the picked GPUs' indices, pair scores)
Picks = dict[tuple[Hashable, tuple[int, ...], int], tuple[tuple[int, ...], tuple[PairScore, ...]]]


def _signature(info: Any) -> Hashable:
    """What of ``/gpu/info/json`` the picker reads, as a key (None: not usable as one): the
    nodes of one model answer the same (their UUIDs differ, and are not part of it), so a
    fleet's picks are made once per shape and set of free GPU indices: a pick costs 0.2 ms
    on an 8-GPU node, a reused one only its key
    (``python -m tests.benchmarks.bench_free_picks``)."""
    devices = info.get("Devices") if isinstance(info, Mapping) else None
    if not isinstance(devices, list):
        return None
    try:
        shape = tuple(
            (
                device["PCI"]["BusID"],
                device.get("CPUAffinity"),
                tuple((p["BusID"], p["Link"], p["NVLinks"]) for p in device["Topology"] or ()),
            )
            for device in devices
        )
        hash(shape)
    except (KeyError, TypeError, AttributeError):  # not the usual shape: no key, no reuse
        return None
    return shape


def _score(value: Any) -> PairScore | None:
    if isinstance(value, list) and len(value) == 3 and all(json_int(v) is not None for v in value):
        return (value[0], value[1], value[2])
    return None


def agents_pick(result: NodeResult, ask: FreeAsk, order: int = 0) -> Candidate | None:
    """The set the node's agent picked (its ``/leases/free`` answer), or None when it has
    too few free (or answered something unusable)."""
    body = result.answers.get("free") if result.ok else None
    chosen = body.get("Set") if isinstance(body, Mapping) else None
    if not isinstance(body, Mapping) or not isinstance(chosen, list) or not chosen:
        return None
    names = [u.get("Name") if isinstance(u, Mapping) else None for u in chosen]
    free, total = json_int(body.get("Free")), json_int(body.get("Units"))
    pairs = body.get("Pairs")
    rank = tuple(_score(p) for p in pairs) if isinstance(pairs, list) else ()
    fit = len(names) == ask.count and all(isinstance(n, str) for n in names)
    if not fit or free is None or total is None or None in rank:
        return None
    numa = {json_int(u.get("NumaNode")) for u in chosen}
    link = body.get("Link")
    return Candidate(
        order,
        result.node.name,
        free,
        total,
        tuple(n for n in names if isinstance(n, str)),
        link if isinstance(link, str) else "-",
        tuple(sorted(n for n in numa if n is not None)),
        tuple(sorted(s for s in rank if s is not None)),
    )


def candidate(
    result: NodeResult, ask: FreeAsk, order: int = 0, picks: Picks | None = None
) -> Candidate | None:
    """The node's best set for ``ask`` from its leases (and topology: an agent older than
    ``/leases/free``), or None when it does not have enough free. ``picks``: the sets
    already picked for a topology and its free GPUs (kept by the caller across nodes)."""
    body = result.answers.get("leases") if result.ok else None
    if body is None:
        return None
    every = units(body)
    wanted: list[Unit] = []
    total = 0
    for raw in every:
        unit = _unit(raw)
        if unit is None:
            continue
        fits = unit.mig is None if ask.mig is None else unit.profile == ask.mig
        total += fits
        if fits and is_free(raw):
            wanted.append(unit)
    if len(wanted) < ask.count or ask.count < 1:
        return None
    rank: tuple[PairScore, ...] = ()
    link = "-"
    chosen: tuple[Unit, ...]
    if ask.mig is not None:
        chosen = _pick_migs(wanted, ask.count, _no_load)
    elif ask.count == 1:  # no pair to score: the picker takes the lowest index of equals
        chosen = (min(wanted, key=lambda u: u.gpu),)
    else:
        info = result.answers.get("info")
        # the picker reads the topology and the GPUs' indices, never a UUID: the key holds
        # no more, so that the nodes of one model share their picks
        by_gpu = {u.gpu: u for u in wanted}
        key = (_signature(info), tuple(sorted(by_gpu)), ask.count)
        cached = picks is not None and key[0] is not None and len(by_gpu) == len(wanted)
        known = picks.get(key) if picks is not None and cached else None
        if known is None:
            topology = node_topology(info)
            if any(not 0 <= u.gpu < len(topology.devices) for u in wanted):
                return None  # the two answers disagree (a GPU came or went between them)
            conn = Connectivity(topology)
            picked = pick_gpus(wanted, ask.count, conn, _no_load)
            pairs = itertools.combinations(picked, 2)
            scores = tuple(sorted(conn.score(a.gpu, b.gpu) for a, b in pairs))
            known = (tuple(u.gpu for u in picked), scores)
            if picks is not None and cached:
                if len(picks) >= MAX_PICKS:
                    picks.clear()
                picks[key] = known
        indices, rank = known
        chosen = tuple(by_gpu[gpu] for gpu in indices)
        link = link_words(rank[0]) if rank else "-"
    numa = tuple(sorted({u.numa_node for u in chosen if u.numa_node is not None}))
    return Candidate(
        order, result.node.name, len(wanted), total, tuple(u.name for u in chosen), link, numa, rank
    )


@dataclass
class FreeTally:
    """The qualifying nodes, gathered as nodes answer; the agents too old for leases."""

    key = "free"  # its list in the --json document

    ask: FreeAsk
    found: list[Candidate] = field(default_factory=list)
    too_old: list[tuple[int, str]] = field(default_factory=list)  # (order, node)
    too_old_left_out: int = 0
    _picks: Picks = field(default_factory=dict)

    def add(self, result: NodeResult, order: int) -> None:
        """Take node number ``order`` (its place in the nodes as named: ties keep it)."""
        if result.ok and "free" in result.answers:  # the agent picked
            made = agents_pick(result, self.ask, order)
            if made is not None:
                self.found.append(made)
            return
        if result.ok and result.answers.get("leases") is None:
            if len(self.too_old) < MAX_NOTES:
                self.too_old.append((order, result.node.name))
            else:
                self.too_old_left_out += 1
            return
        made = candidate(result, self.ask, order, self._picks)
        if made is not None:
            self.found.append(made)

    def best_first(self) -> list[Candidate]:
        # a larger rank is better; then the nodes' order
        return sorted(self.found, key=lambda c: (tuple(_negated(s) for s in c.rank), c.order))

    def lines(self, width: int | None, ellipsis: str = "…") -> list[str]:
        """The table: header and a row per qualifying node, best first; none: nothing."""
        best = self.best_first()
        return (
            render(FREE_COLUMNS, [c.row() for c in best], width, ellipsis=ellipsis) if best else []
        )

    def notes(self) -> list[str]:
        """What ``free`` says on stderr before its summary."""
        notes = [f"{name}: {TOO_OLD}" for _, name in sorted(self.too_old)]
        if self.too_old_left_out:
            notes.append(f"and {self.too_old_left_out} more agents too old for leases")
        notes.append(
            f"{len(self.found)} node{'s' if len(self.found) != 1 else ''} with {self.ask.what}"
        )
        return notes

    def json(self) -> list[dict[str, Any]]:
        return [c.json() for c in self.best_first()]


def _negated(score: Sequence[int]) -> tuple[int, ...]:
    return tuple(-v for v in score)
