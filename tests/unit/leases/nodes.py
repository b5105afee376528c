"""Nodes built for the lease tests: GPUs with the NUMA nodes, links and MIG devices a test
names, and the helpers the tests share (health, containers, times)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.gpu import nodefile
from agent.gpu.model import (
    Clocks,
    DeviceInfo,
    DeviceMemory,
    MigDevice,
    NodeInfo,
    PciInfo,
    PciLink,
    PeerLink,
)
from agent.health.rule import HEALTHY, DeviceHealth
from agent.leases.answers import Granted, Outcome
from agent.leases.containers import Container
from agent.leases.holders import Lease
from agent.leases.labels import labels_for, read_label

T0 = 1_790_000_000.0  # 2026-09-21T...Z: a time in the tests' lines

Link = tuple[PciLink, int]  # (PCIe relation, NVLinks)


def uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444444444444"


def mig_uuid(gpu: int, index: int, layout: str = "a") -> str:
    return f"MIG-{gpu:04x}{index:04x}-{layout * 4}-5555-6666-777777777777"


def bus(index: int) -> str:
    return f"00000000:{0x10 + index:02X}:00.0"


def build_node(
    numa: Sequence[int | None],
    links: Mapping[tuple[int, int], Link] | None = None,
    migs: Mapping[int, Sequence[str]] | None = None,
    layout: str = "a",
) -> NodeInfo:
    """A node of ``len(numa)`` GPUs on those NUMA nodes, joined as ``links`` says (pairs not
    named: unknown), GPUs in ``migs`` in MIG mode with MIG devices of those profiles."""
    links = links or {}
    migs = migs or {}
    devices = []
    for index, node in enumerate(numa):
        peers = []
        for (a, b), (link, nvlinks) in sorted(links.items()):
            if index in (a, b):
                peers.append(PeerLink(bus(b if index == a else a), link, nvlinks))
        profiles = migs.get(index)
        mig_devices = tuple(
            MigDevice(
                i,
                mig_uuid(index, i, layout),
                profile,
                None,
                i + 1,
                0,
                (f"/dev/nvidia-caps/nvidia-cap{index * 100 + 2 * i}",),
            )
            for i, profile in enumerate(profiles or ())
        )
        devices.append(
            DeviceInfo(
                index=index,
                uuid=uuid(index),
                path=f"/dev/nvidia{index}",
                model="NVIDIA H100 80GB HBM3",
                power_w=700,
                cpu_affinity=node,
                pci=PciInfo(bus(index), None, None),
                clocks=Clocks(None, None),
                topology=tuple(peers),
                family="Hopper",
                arch="9.0",
                cores=None,
                memory=DeviceMemory(None, None, None, None, None, None),
                mig_enabled=profiles is not None,
                mig_devices=mig_devices,
            )
        )
    return NodeInfo("580.159.04", "13.0", tuple(devices))


def nvswitch_16() -> NodeInfo:
    """16 GPUs all joined by NVSwitch, 0-7 on socket 0 and 8-15 on socket 1, each pair (0+1,
    2+3, ...) under one PCIe switch."""
    links: dict[tuple[int, int], tuple[PciLink, int]] = {}
    for a in range(16):
        for b in range(a + 1, 16):
            if a // 2 == b // 2:
                links[(a, b)] = (PciLink.SINGLE_SWITCH, 12)
            else:
                links[(a, b)] = (PciLink.SAME_CPU if a // 8 == b // 8 else PciLink.CROSS_CPU, 12)
    return build_node([i // 8 for i in range(16)], links)


def builtin(name: str) -> NodeInfo:
    return nodefile.load(name).info


def healthy(node: NodeInfo) -> list[DeviceHealth]:
    return [HEALTHY] * len(node.devices)


def sick(reason: str = "XID 79 (GPU has fallen off the bus)", since_s: float = T0) -> DeviceHealth:
    return DeviceHealth(False, reason, 79, since_s)


def granted(outcome: Outcome[object]) -> Granted:
    assert isinstance(outcome.answer, Granted), outcome.answer
    return outcome.answer


def names(grant: Granted) -> list[str]:
    return [u.name for u in grant.units]


def cid(n: int) -> str:
    """A container id of Docker's form (64 hex digits), its short form ``0001abababab``."""
    return f"{n:04x}" + "ab" * 30


def leased_container(n: int, lease: Lease, running: bool = False, engine: str = "") -> Container:
    """Container ``n`` of ``engine``, created with ``lease``'s labels."""
    return Container(cid(n), running, read_label(labels_for(lease)), engine=engine)
