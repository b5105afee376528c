"""Which free units an ask for several gets: the best-connected set, least loaded among equals.

Two GPUs are, best first: joined by NVLink (or NVSwitch), then under the same PCIe switch
(NVML's PIX, PXB, or one board), then on the same NUMA node (PHB, NODE; or, with the link
unknown, the same ``cpu_affinity``), then across CPU sockets (SYS), then unknown. The link is
read from either GPU's ``topology`` (``PeerLink`` by bus id). A set is as good as its worst
pair, then its next worst, and so on; among equal sets the one with the fewest leases on its
units and then the lowest busy level (``agent.leases.loads``: the larger of utilization and
memory used, in steps of 10 %, summed over the set) wins, then the lowest indices (so that
the same state and loads always pick the same set). Connection comes first: a busy NVLink
pair is picked before an idle pair that only shares a PCIe switch. The set is found by
``agent.leases.set_search``, which gets the set comparing every set would get without
building most of them.

MIG devices are picked least loaded first, then in index order: the MIG devices of one GPU
share its links.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from agent.gpu.model import DeviceInfo, NodeInfo, PciLink
from agent.leases.set_search import Load, best_set
from agent.leases.units import Unit

PairScore = tuple[int, int, int]  # (NVLink, PCIe tier, PciLink value): larger is better
LoadOf = Callable[[Unit], Load]

TIER_SWITCH = 3
TIER_NUMA = 2
TIER_SOCKETS = 1
TIER_UNKNOWN = 0


def _tier(link: PciLink, a: DeviceInfo, b: DeviceInfo) -> int:
    if link >= PciLink.MULTIPLE_SWITCHES:
        return TIER_SWITCH
    if link in (PciLink.HOST_BRIDGE, PciLink.SAME_CPU):
        return TIER_NUMA
    if link is PciLink.CROSS_CPU:
        return TIER_SOCKETS
    if a.cpu_affinity is None or b.cpu_affinity is None:
        return TIER_UNKNOWN
    return TIER_NUMA if a.cpu_affinity == b.cpu_affinity else TIER_SOCKETS


LINK_WORDS = {TIER_SWITCH: "PCIe switch", TIER_NUMA: "NUMA node", TIER_SOCKETS: "across sockets"}


def link_words(score: PairScore) -> str:
    """A pair's score in a few words: ``NVLink``, ``PCIe switch``, ``NUMA node``, ``across
    sockets`` or ``unknown`` (what ``GET /leases/free`` and ``nvidia-docker-ctl free`` show)."""
    nvlink, tier, _ = score
    return "NVLink" if nvlink else LINK_WORDS.get(tier, "unknown")


class Connectivity:
    """The pair scores of a node's GPUs, read once from their topology."""

    def __init__(self, node: NodeInfo) -> None:
        by_bus = {d.pci.bus_id.upper(): d.index for d in node.devices}
        nvlink: dict[tuple[int, int], bool] = {}
        links: dict[tuple[int, int], PciLink] = {}
        for device in node.devices:
            for peer in device.topology:
                other = by_bus.get(peer.bus_id.upper())
                if other is None or other == device.index:
                    continue
                pair = (min(device.index, other), max(device.index, other))
                nvlink[pair] = nvlink.get(pair, False) or peer.nvlinks > 0
                links[pair] = max(links.get(pair, PciLink.UNKNOWN), peer.link)
        self._scores: dict[tuple[int, int], PairScore] = {}
        for a, b in itertools.combinations(node.devices, 2):
            pair = (a.index, b.index)
            link = links.get(pair, PciLink.UNKNOWN)
            self._scores[pair] = (int(nvlink.get(pair, False)), _tier(link, a, b), int(link))

    def score(self, a: int, b: int) -> PairScore:
        """How well GPUs ``a`` and ``b`` are joined (the same GPU: best of all)."""
        if a == b:
            return (1, TIER_SWITCH + 1, int(PciLink.SAME_BOARD) + 1)
        return self._scores[(min(a, b), max(a, b))]


def pick_gpus(
    candidates: Sequence[Unit], count: int, conn: Connectivity, load_of: LoadOf
) -> tuple[Unit, ...]:
    """The best ``count`` of ``candidates`` (whole GPUs, in index order); ``count`` must be
    at most ``len(candidates)``."""
    ordered = sorted(candidates, key=lambda u: u.gpu)
    if count <= 0 or count > len(ordered):
        raise ValueError(f"cannot pick {count} of {len(ordered)} GPUs")
    scores = {
        (i, j): conn.score(a.gpu, b.gpu)
        for (i, a), (j, b) in itertools.combinations(enumerate(ordered), 2)
    }
    rank_of = {score: rank for rank, score in enumerate(sorted(set(scores.values())))}
    ranks = [[0] * len(ordered) for _ in ordered]
    for (i, j), score in scores.items():
        ranks[i][j] = ranks[j][i] = rank_of[score]
    chosen = best_set(ranks, [load_of(u) for u in ordered], count)
    return tuple(ordered[i] for i in chosen)


def pick_migs(candidates: Sequence[Unit], count: int, load_of: LoadOf) -> tuple[Unit, ...]:
    """The ``count`` least-loaded MIG devices of ``candidates``, in index order on a tie."""
    ordered = sorted(candidates, key=lambda u: (load_of(u), u.gpu, u.mig or 0))
    if count <= 0 or count > len(ordered):
        raise ValueError(f"cannot pick {count} of {len(ordered)} MIG devices")
    return tuple(sorted(ordered[:count], key=lambda u: (u.gpu, u.mig or 0)))
