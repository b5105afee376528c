"""The authorization plugin's gate: may the Docker engine create or start this container?

dockerd, run with ``--authorization-plugin=nvidia-docker``, asks the plugin socket before
each container create and start (``plugin.authz``). ``StartGate`` answers from the lease
table (``LeaseService.may_start``): a start's container as the engine inspects it
(``inspect_container``), a create's as its body describes it (``created_container``).

It fails open: dockerd waits for this answer on every create and start, and a node whose
docker refuses everything is worse than one GPU shared. So the agent's own trouble, an
engine that does not answer the inspect within its client's timeout (``EngineError``), a
container id the engine would not know, a bug, is an allow, with one log line per kind of
trouble and ``LOG_INTERVAL_S``. The table's own verdicts stay the same: a container the
engine no longer has is allowed (dockerd answers 404 itself), and until the table is open
(``leases`` not yet done: the start-up's gap between the plugin socket and the table) every
container is allowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.edge.rate_limit import RateLimiter
from agent.engines.containers import created_container, inspect_container
from agent.engines.http import EngineClient, EngineError
from agent.leases.containers import Container
from agent.leasing.service import LeaseService
from plugin.authz import Ask, CreateAsk

log = logging.getLogger("nvidia-docker-plugin.leases")

LOG_INTERVAL_S = 60.0


class StartGate:
    """``plugin.authz.Gate`` of the lease table (see the module docstring)."""

    def __init__(
        self,
        engine: EngineClient,
        leases: asyncio.Future[LeaseService],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._leases = leases
        self._trouble = RateLimiter(LOG_INTERVAL_S, clock=clock)

    async def __call__(self, ask: Ask) -> str | None:
        if not self._leases.done() or self._leases.cancelled():
            return None
        try:
            container = await self._container(ask)
            if container is None:
                return None
            verdict = self._leases.result().may_start(container)
        except EngineError as err:
            self._allowed_anyway("engine", f"{err}")
            return None
        except Exception as err:  # a bug of ours must not stop the node's docker
            self._allowed_anyway("bug", f"{type(err).__name__}: {err}", exc=err)
            return None
        if verdict.allowed:
            log.debug("Authorization: %s", verdict.text)
            return None
        log.info("Authorization: refused: %s", verdict.text)
        return verdict.text

    async def _container(self, ask: Ask) -> Container | None:
        if isinstance(ask, CreateAsk):
            return created_container(ask.name, ask.body)
        try:
            return await inspect_container(self._engine, ask.container)
        except ValueError:
            return None  # no id or name the engine has: it answers 404 itself

    def _allowed_anyway(self, kind: str, why: str, exc: BaseException | None = None) -> None:
        held_back = self._trouble.allow(kind)
        if held_back is None:
            return
        more = f" ({held_back} more since the last line)" if held_back else ""
        log.warning(
            "Authorization: allowed without the lease table's answer: %s%s",
            why,
            more,
            exc_info=exc,
        )
