"""Which GPUs of a node can reach each other directly, over which PCI path, with how many NVLinks.

For every ordered pair of GPUs (i, j):

- reachable: NVML's P2P status says both reads and writes work (``nvmlDeviceGetP2PStatus``
  with the READ and WRITE capability indices). Where NVML cannot tell (the call is not
  supported), CUDA's ``cuDeviceCanAccessPeer`` decides. A pair joined by NVLink is reachable.
- link: the PCI relation, from ``nvmlDeviceGetTopologyCommonAncestor`` (``PciLink``).
- nvlinks: the number of active NVLinks between the pair, what ``nvidia-smi topo -m`` shows
  as ``NV#``. Each active link of a GPU (``nvmlDeviceGetNvLinkState``) is attributed by its
  remote end:

  1. the remote PCI bus id (``nvmlDeviceGetNvLinkRemotePciInfo``) is another GPU of the node:
     the link joins that pair;
  2. the remote end is an NVSwitch (``nvmlDeviceGetNvLinkRemoteDeviceType``): the links go
     to the switch fabric, which joins every pair of GPUs on it; the pair gets the smaller
     of the two GPUs' switch link counts (an HGX H200 board: 18 for every pair);
  3. otherwise the remote end is not visible. That is the case in virtual machines, where
     the hypervisor hides the peer's PCI address (it reads ``FFFFFFFF:FF:FF.0``). Such
     links are attributed when exactly one peer can be their other end: the only other GPU
     whose NVLink P2P status (``NVML_P2P_CAPS_INDEX_NVLINK``) is OK, or, when NVML cannot
     tell, the only other GPU of the node. Two H200s of one board passed to a VM: 18 links
     each, one candidate each, so 18 both ways. With several candidates the links are not
     guessed: they count 0 and one warning says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.gpu import nvml_query as nvml
from agent.gpu.cuda_driver import CudaFacts
from agent.gpu.model import PciLink, PeerLink

log = logging.getLogger(__name__)

# nvmlGpuP2PCapsIndex_t. (pynvml 13's NVML_P2P_CAPS_INDEX_READ is the tuple ``(0,)`` because
# of a stray comma, so the values are written here.)
P2P_CAPS_INDEX_READ = 0
P2P_CAPS_INDEX_WRITE = 1
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0

# nvmlNvLinkDeviceType_t (0 is a GPU: those links are told apart by their bus id)
NVLINK_DEVICE_TYPE_IBMNPU = 1
NVLINK_DEVICE_TYPE_SWITCH = 2

# Upper bound on NVLinks per GPU (NVML_NVLINK_MAX_LINKS is 36 in NVML 13; Hopper has 18,
# Blackwell 18). The scan stops at the first link index the GPU does not have.
MAX_NVLINKS = 36

# nvmlGpuTopologyLevel_t -> the ``Topology[].Link`` integer of /gpu/info/json (docs/api.md).
_ANCESTOR_TO_LINK = {
    0: PciLink.SAME_BOARD,  # NVML_TOPOLOGY_INTERNAL
    10: PciLink.SINGLE_SWITCH,  # NVML_TOPOLOGY_SINGLE
    20: PciLink.MULTIPLE_SWITCHES,  # NVML_TOPOLOGY_MULTIPLE
    30: PciLink.HOST_BRIDGE,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: PciLink.SAME_CPU,  # NVML_TOPOLOGY_NODE (was NVML_TOPOLOGY_CPU)
    50: PciLink.CROSS_CPU,  # NVML_TOPOLOGY_SYSTEM
}


def pci_link(common_ancestor: int | None) -> PciLink:
    """The ``Link`` integer (docs/api.md) for an NVML common ancestor level."""
    if common_ancestor is None:
        return PciLink.UNKNOWN
    return _ANCESTOR_TO_LINK.get(common_ancestor, PciLink.UNKNOWN)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI bus id in NVML's form, 8-digit domain and upper case: ``00000000:00:06.0``."""
    domain, sep, rest = bus_id.strip().partition(":")
    if not sep:
        return bus_id.strip().upper()
    try:
        return f"{int(domain, 16):08X}:{rest.upper()}"
    except ValueError:
        return bus_id.strip().upper()


@dataclass(slots=True)
class NvLinkCensus:
    """The active NVLinks of one GPU, sorted by what is at their other end."""

    to_gpu: dict[str, int] = field(default_factory=dict)  # peer bus id -> links
    to_switch: int = 0
    unresolved: int = 0


def nvlink_census(handle: Any, gpu_bus_ids: frozenset[str]) -> NvLinkCensus:
    census = NvLinkCensus()
    for link in range(MAX_NVLINKS):
        state = nvml.attempt("nvmlDeviceGetNvLinkState", handle, link)
        if state.error is not None:
            break  # past the last link (invalid argument), no NVLink at all, or lost
        if not state.value:
            continue
        remote = nvml.query("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remote_bus = _bus_id_of(remote)
        if remote_bus is not None and remote_bus in gpu_bus_ids:
            census.to_gpu[remote_bus] = census.to_gpu.get(remote_bus, 0) + 1
            continue
        kind = nvml.query("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if kind == NVLINK_DEVICE_TYPE_SWITCH:
            census.to_switch += 1
        elif kind != NVLINK_DEVICE_TYPE_IBMNPU:  # links to a POWER CPU join no GPU pair
            census.unresolved += 1
    return census


def _bus_id_of(pci_info: Any) -> str | None:
    bus_id = nvml.decode(getattr(pci_info, "busId", None))
    if not isinstance(bus_id, str) or not bus_id:
        return None
    return normalize_bus_id(bus_id)


def _status_ok(handle: Any, peer: Any, index: int) -> bool | None:
    status = nvml.query("nvmlDeviceGetP2PStatus", handle, peer, index)
    if status is None:
        return None
    return bool(status == P2P_STATUS_OK)


def node_topology(
    handles: Sequence[Any | None], bus_ids: Sequence[str], cuda: CudaFacts | None
) -> tuple[tuple[PeerLink, ...], ...]:
    """The ``Topology`` list of every GPU, in index order."""
    count = len(handles)
    # A GPU NVML cannot open, or whose bus id it cannot read (lost), has no peers.
    handles = [h if h is not None and bus_ids[i] else None for i, h in enumerate(handles)]
    known = frozenset(bus_ids[i] for i in range(count) if handles[i] is not None)
    censuses = [
        nvlink_census(handle, known) if handle is not None else NvLinkCensus() for handle in handles
    ]
    nvlink_ok: dict[tuple[int, int], bool | None] = {}
    for i in range(count):
        for j in range(count):
            if i != j and handles[i] is not None and handles[j] is not None:
                nvlink_ok[i, j] = _status_ok(handles[i], handles[j], P2P_CAPS_INDEX_NVLINK)
    result = []
    for i in range(count):
        peers = []
        handle = handles[i]
        for j in range(count):
            peer = handles[j]
            if i == j or handle is None or peer is None:
                continue
            links = _nvlinks(i, j, censuses, bus_ids, nvlink_ok)
            if not (links or _reachable(handle, peer, bus_ids[i], bus_ids[j], cuda)):
                continue
            ancestor = nvml.query("nvmlDeviceGetTopologyCommonAncestor", handle, peer)
            peers.append(PeerLink(bus_id=bus_ids[j], link=pci_link(ancestor), nvlinks=links))
        result.append(tuple(peers))
    return tuple(result)


def _reachable(
    handle: Any, peer: Any, bus_id: str, peer_bus_id: str, cuda: CudaFacts | None
) -> bool:
    read = _status_ok(handle, peer, P2P_CAPS_INDEX_READ)
    write = _status_ok(handle, peer, P2P_CAPS_INDEX_WRITE)
    if read is not None and write is not None:
        return read and write
    if cuda is not None:
        return bool(cuda.can_access_peer(bus_id, peer_bus_id))
    return False


def _nvlinks(
    i: int,
    j: int,
    censuses: Sequence[NvLinkCensus],
    bus_ids: Sequence[str],
    nvlink_ok: dict[tuple[int, int], bool | None],
) -> int:
    mine, theirs = censuses[i], censuses[j]
    links = mine.to_gpu.get(bus_ids[j], 0)
    if mine.to_switch and theirs.to_switch and nvlink_ok.get((i, j)) is not False:
        links += min(mine.to_switch, theirs.to_switch)
    if mine.unresolved and _only_candidate(i, censuses, nvlink_ok) == j:
        links += mine.unresolved
    return links


def _only_candidate(
    i: int, censuses: Sequence[NvLinkCensus], nvlink_ok: dict[tuple[int, int], bool | None]
) -> int | None:
    """The one GPU that can be the far end of GPU i's unresolved links, if there is one."""
    others = [j for (a, j) in nvlink_ok if a == i]
    said_ok = [j for j in others if nvlink_ok[i, j]]
    candidates = said_ok if said_ok else [j for j in others if nvlink_ok[i, j] is None]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        _warn_ambiguous(i, censuses[i].unresolved, len(candidates))
    return None


_ambiguous_warned: set[int] = set()


def _warn_ambiguous(index: int, links: int, candidates: int) -> None:
    if index in _ambiguous_warned:
        return
    _ambiguous_warned.add(index)
    log.warning(
        "GPU %d: %d active NVLinks whose far end NVML does not show (virtual machine?) could "
        "join any of %d GPUs: they are not counted in its topology",
        index,
        links,
        candidates,
    )
