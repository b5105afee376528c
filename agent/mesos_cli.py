"""``/mesos/cli``: the Mesos agent flags of this node, rendered once per query and cached.

``format`` is ``legacy`` (default, byte-for-byte the old tool's line) or ``native``
(Mesos's own GPU support). ``dev`` selects GPUs as for ``/docker/cli``. The blob is
always the node's whole ``/gpu/info/json`` body. The encoding is the pure ``mesos``
library's; this module only selects and caches. Unhealthy GPUs are not offered
(``agent.health_selection``); they stay in the blob, which describes the node.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.gpu.health import DeviceHealth
from agent.gpu.model import NodeInfo
from agent.health_selection import select_usable
from agent.selection import InvalidParameter
from mesos import flags

FORMATS = ("legacy", "native")


class MesosCli:
    def __init__(
        self, node: NodeInfo, info_json: bytes, health: Sequence[DeviceHealth] = ()
    ) -> None:
        self._node = node
        self._info_json = info_json
        self._health = tuple(health)
        self._cache: dict[tuple[str, tuple[int, ...]], bytes] = {}

    def answer(self, fmt: str | None, dev: str | None) -> bytes:
        """The flags line; ``InvalidParameter`` for a bad ``dev`` or ``format``,
        ``UnhealthyDevice`` for an unhealthy GPU named in ``dev``."""
        fmt = fmt or "legacy"
        if fmt not in FORMATS:
            raise InvalidParameter("format", fmt, " (expected legacy or native)")
        devices = select_usable(self._node.devices, dev, self._health)
        key = (fmt, tuple(d.index for d in devices))
        body = self._cache.get(key)
        if body is None:
            body = self._render(fmt, key[1])
            self._cache[key] = body
        return body

    def _render(self, fmt: str, indices: tuple[int, ...]) -> bytes:
        # A GPU whose UUID NVML could not read (lost at start) cannot be offered: Mesos
        # tasks would have no stable name for it. It stays in the blob, with null fields.
        indices = tuple(i for i in indices if self._node.devices[i].uuid)
        uuids = [self._node.devices[i].uuid or "" for i in indices]
        if fmt == "native":
            return flags.native_flags(self._info_json, uuids, indices).encode()
        return flags.legacy_flags(self._info_json, uuids).encode()
