"""Whether a GPU create through the engine socket gets CDI device names (docs/engine-socket.md).

An engine that reads the node's CDI spec (Docker 25 and later with CDI on) is given the
leased GPUs as CDI devices, ``{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=GPU-..."]}``:
the spec brings the device nodes, the control nodes and the driver volume, the way that
engine's own ``--device nvidia.com/gpu=...`` does. Any other engine gets the device-node form.

The engine says where it reads specs in its ``GET /info`` answer: ``CDISpecDirs``, a list
(Docker 25 and later; empty while CDI is off; absent in older engines). The form is CDI when
that list holds a directory of the spec in force (``CdiSpecWriter.dirs_in_force``: this
agent's ``--cdi-spec-dir`` once its spec is written), so that every name resolves. While the
agent follows the engine's events, the list is the one it read then and at the engine's
latest ``daemon reload`` (``facts``: ``agent.engines.facts``), and the engine is not asked;
otherwise it is asked, and the answer kept ``KEEP_S`` seconds (a Compose ``up`` of many
replicas asks once). An engine that cannot be asked gets the device-node form, and its
create meets the engine's own error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from agent.cdi_spec.inputs import CdiNaming
from agent.engines.facts import EngineFacts
from agent.engines.http import EngineClient, EngineError, parse_answer

log = logging.getLogger("nvidia-docker-plugin.engine-socket")

KEEP_S = 10.0
INFO_BYTES = 1024 * 1024  # dockerd's /info is a few KB


class SpecInForce(Protocol):
    """What the CDI writer says of its spec (``agent.cdi_spec.writer.CdiSpecWriter``)."""

    @property
    def dirs_in_force(self) -> frozenset[Path]: ...

    @property
    def naming(self) -> CdiNaming: ...


def spec_dirs(info: object) -> tuple[str, ...]:
    """``CDISpecDirs`` of an engine's ``/info`` answer; () where it has none."""
    if not isinstance(info, dict):
        return ()
    dirs = info.get("CDISpecDirs")
    if not isinstance(dirs, list):
        return ()
    return tuple(d for d in dirs if isinstance(d, str) and d)


def reads_from(engine_dirs: Collection[str], wanted: Collection[Path]) -> bool:
    """Whether one of ``engine_dirs`` is one of ``wanted`` (both resolved)."""
    real = {os.path.realpath(d) for d in wanted}
    return any(os.path.realpath(d) in real for d in engine_dirs)


class CdiForm:
    """``naming()``: the CDI names to give the engine, or None for the device-node form."""

    def __init__(
        self,
        engine: EngineClient,
        spec: SpecInForce,
        *,
        facts: Callable[[], EngineFacts | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._spec = spec
        self._facts = facts
        self._clock = clock
        self._dirs: tuple[str, ...] = ()
        self._asked_at: float | None = None
        self._said: bool | None = None  # the form last logged: CDI or not

    async def naming(self) -> CdiNaming | None:
        now = self._clock()
        known = self._facts()
        if known is not None:  # the agent follows the engine: its answer, as of its last reload
            self._dirs, self._asked_at = known.cdi_spec_dirs, None
        elif self._asked_at is None or now - self._asked_at >= KEEP_S:
            self._dirs = await self._ask()
            self._asked_at = now
        cdi = reads_from(self._dirs, self._spec.dirs_in_force)
        if cdi is not self._said:
            self._said = cdi
            if cdi:
                log.info(
                    "Engine socket: GPU creates get CDI devices (the engine reads specs from %s)",
                    ", ".join(self._dirs),
                )
            else:
                log.info(
                    "Engine socket: GPU creates get device nodes and the driver volume (%s)",
                    self._why_not(),
                )
        return self._spec.naming if cdi else None

    async def _ask(self) -> tuple[str, ...]:
        try:
            body = await self._engine.get("/info", "to /info", max_bytes=INFO_BYTES)
            return spec_dirs(parse_answer(body or b"{}", self._engine.bad_answer("to /info")))
        except EngineError as err:
            log.debug("Engine socket: the engine's CDI directories are unknown: %s", err)
            return ()

    def _why_not(self) -> str:
        if not self._dirs:
            return "the engine reads no CDI specs"
        if not self._spec.dirs_in_force:
            return "this agent's CDI spec is not written"
        return (
            f"the engine reads specs from {', '.join(self._dirs)}, not from "
            f"{', '.join(sorted(map(str, self._spec.dirs_in_force)))}"
        )
