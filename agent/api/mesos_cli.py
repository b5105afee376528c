"""``/mesos/cli``: the Mesos agent flags of this node, rendered once per query and cached.

``format`` is ``legacy`` (default, byte-for-byte the old tool's line) or ``native``
(Mesos's own GPU support). ``dev`` selects GPUs as for ``/docker/cli``. The blob is
always the node's whole ``/gpu/info/json`` body. The encoding is the pure ``mesos``
library's; this module only selects and caches. Unhealthy GPUs are not offered
(``agent.health.selection``); they stay in the blob, which describes the node, and each one
left out is named like the MIG devices below.

MIG (docs/mesos.md): the legacy ``gpus`` set is the framework's to hand out through
nvidia-docker, so a GPU in MIG mode is offered as its MIG devices' UUIDs (``NV_GPU`` takes
them). The native format cannot carry MIG devices: Mesos's ``gpu/nvidia`` isolator gives
whole GPUs by index and knows no capability nodes, and a whole GPU in MIG mode runs no CUDA
work without them. So native leaves GPUs in MIG mode out of the default selection and
refuses them (and MIG devices) when ``dev`` names them. Nothing is left out silently: each
GPU left out is logged once and named in the answer's ``X-Left-Out`` header.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from agent.gpu.model import NodeInfo
from agent.health.rule import DeviceHealth
from agent.health.selection import select_usable
from agent.node.selection import InvalidParameter, Target, entries_of, means_all, select_targets
from mesos import flags

log = logging.getLogger("nvidia-docker-plugin.mesos")

FORMATS = ("legacy", "native")
NATIVE_MIG_HINT = (
    " (Mesos's gpu/nvidia isolator gives whole GPUs and cannot give MIG devices: "
    "use format=legacy, whose gpus set offers MIG devices by UUID)"
)


@dataclass(frozen=True, slots=True)
class MesosAnswer:
    body: bytes
    left_out: tuple[str, ...]  # one line per GPU or MIG device not offered, saying why


class MesosCli:
    def __init__(
        self, node: NodeInfo, info_json: bytes, health: Sequence[DeviceHealth] = ()
    ) -> None:
        self._node = node
        self._info_json = info_json
        self._health = tuple(health)
        self._cache: dict[tuple[str, tuple[tuple[int, int | None], ...]], MesosAnswer] = {}

    def answer(self, fmt: str | None, dev: str | None) -> bytes:
        """The flags line; ``InvalidParameter`` for a bad ``dev`` or ``format``,
        ``UnhealthyDevice`` for an unhealthy GPU named in ``dev``."""
        return self.render(fmt, dev).body

    def render(self, fmt: str | None, dev: str | None) -> MesosAnswer:
        """The flags line and what it leaves out; ``InvalidParameter`` as ``answer``."""
        fmt = fmt or "legacy"
        if fmt not in FORMATS:
            raise InvalidParameter("format", fmt, " (expected legacy or native)")
        targets = select_usable(self._node.devices, dev, self._health)
        if fmt == "native":
            self._refuse_mig(dev)
        key = (fmt, tuple((t.gpu.index, t.mig.index if t.mig else None) for t in targets))
        found = self._cache.get(key)
        if found is None:
            found = self._render(fmt, targets, self._unhealthy_left_out(dev))
            for line in found.left_out:
                log.warning("/mesos/cli?format=%s: %s", fmt, line)
            self._cache[key] = found
        return found

    def _refuse_mig(self, dev: str | None) -> None:
        """Native: a ``dev`` entry naming a MIG device or a GPU in MIG mode is refused."""
        for entry in entries_of(dev) or ():
            (target, *_) = select_targets(self._node.devices, entry)
            if target.mig is not None:
                raise InvalidParameter("dev", entry, NATIVE_MIG_HINT)
            if target.gpu.mig_enabled:
                hint = f" (GPU {target.gpu.index} is in MIG mode;{NATIVE_MIG_HINT[1:]}"
                raise InvalidParameter("dev", entry, hint)

    def _unhealthy_left_out(self, dev: str | None) -> list[str]:
        """The default selection leaves unhealthy GPUs out: one line for each."""
        if not means_all(dev):
            return []
        return [
            f"GPU {gpu.index} is unhealthy: {health.reason or 'unknown reason'}"
            for gpu, health in zip(self._node.devices, self._health, strict=False)
            if not health.healthy
        ]

    def _render(self, fmt: str, targets: tuple[Target, ...], unhealthy: list[str]) -> MesosAnswer:
        left_out: list[str] = list(unhealthy)
        items: list[tuple[int, str]] = []  # (GPU index, UUID offered)
        for target in targets:
            gpu = target.gpu
            if fmt == "native" and gpu.mig_enabled:
                left_out.append(f"GPU {gpu.index} is in MIG mode{NATIVE_MIG_HINT}")
                continue
            if fmt == "legacy" and (target.mig is not None or gpu.mig_enabled):
                migs = gpu.mig_devices if target.mig is None else (target.mig,)
                if not migs:
                    left_out.append(f"GPU {gpu.index} is in MIG mode and has no MIG device")
                for mig in migs:
                    if mig.uuid:
                        items.append((gpu.index, mig.uuid))
                    else:
                        left_out.append(f"GPU {gpu.index} MIG device {mig.index}: no UUID")
                continue
            # A GPU whose UUID NVML could not read (lost at start) cannot be offered: Mesos
            # tasks would have no stable name for it. It stays in the blob, with null fields.
            if gpu.uuid:
                items.append((gpu.index, gpu.uuid))
            else:
                left_out.append(f"GPU {gpu.index}: no UUID (NVML could not read it)")
        if not items:
            raise InvalidParameter("format", fmt, f" (nothing to offer: {'; '.join(left_out)})")
        uuids = [uuid for _, uuid in items]
        if fmt == "native":
            line = flags.native_flags(self._info_json, uuids, [index for index, _ in items])
        else:
            line = flags.legacy_flags(self._info_json, uuids)
        return MesosAnswer(line.encode(), tuple(left_out))
