"""The start gate: may an engine create or start this container?

dockerd, run with ``--authorization-plugin=nvidia-docker``, asks the plugin socket before
each container create and start (``plugin.authz``); Podman's OCI runtime runs
``nvidia-docker-start-hook`` before each container starts, which asks the same socket
(``plugin.start_hook``). ``StartGate`` answers from the lease table
(``LeaseService.may_start``): a start's container as the engine inspects it
(``inspect_container``), a create's as its body describes it (``created_container``), a
hook's as its runtime config describes it (``hooked_container``).

A hook's ask is answered from the table alone, never by asking the engine: Podman holds a
container's lock while it starts it, hooks included, so an inspect of that container would
wait for the hook that waits for it. The runtime config has the container's device nodes
and annotations, not its labels: the lease label comes from annotations (the wrapper gives
Podman's containers the lease's labels as annotations too), or from the table when the
container is bound already. A container without one whose devices are only held by a
pending lease is allowed (it is most likely that lease's own container, created by hand
with the grant's labels: its create event binds it, and were it another, the table records
the conflict), with one log line.

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
from agent.engines.containers import container_of, created_container, inspect_container
from agent.engines.http import EngineClient, EngineError
from agent.leases.answers import Hold, StartVerdict
from agent.leases.containers import Container
from agent.leases.labels import LABEL_DEVICES
from agent.leasing.service import LeaseService
from plugin.authz import Ask, CreateAsk, HookAsk

log = logging.getLogger("nvidia-docker-plugin.leases")

LOG_INTERVAL_S = 60.0
NVIDIA_MAJOR = 195  # the character major of /dev/nvidia<minor> (NVIDIA's driver fixes it)
CONTROL_MINOR = 255  # /dev/nvidiactl


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
            if isinstance(ask, HookAsk) and _only_pending(container, verdict):
                log.info(
                    "Start hook: allowed: container %s has no lease label, and its GPUs are "
                    "held by a pending lease only (%s): its create event binds it",
                    container.id[:12],
                    verdict.text,
                )
                return None
        except EngineError as err:
            self._allowed_anyway("engine", f"{err}")
            return None
        except Exception as err:  # a bug of ours must not stop the node's engine
            self._allowed_anyway("bug", f"{type(err).__name__}: {err}", exc=err)
            return None
        who = "Start hook" if isinstance(ask, HookAsk) else "Authorization"
        if verdict.allowed:
            log.debug("%s: %s", who, verdict.text)
            return None
        log.info("%s: refused: %s", who, verdict.text)
        return verdict.text

    async def _container(self, ask: Ask) -> Container | None:
        if isinstance(ask, CreateAsk):
            return created_container(ask.name, ask.body)
        if isinstance(ask, HookAsk):
            return hooked_container(ask)
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


def hooked_container(ask: HookAsk) -> Container:
    """The container a start hook describes, as the table reads one: not running, its lease
    label from its annotations (its devices joined by ``;`` or ``,``), its GPUs from its
    device nodes. A node of NVIDIA's major is
    the host's ``/dev/nvidia<minor>`` whatever its path in the container (``--device
    /dev/nvidia3:/dev/gpu0``); other nodes (MIG capability files) by their path."""
    paths = [
        f"/dev/nvidia{d.minor}"
        if d.major == NVIDIA_MAJOR and d.minor is not None and d.minor < CONTROL_MINOR
        else d.path
        for d in ask.devices
    ]
    labels = dict(ask.annotations)
    if LABEL_DEVICES in labels:  # the wrapper joins them by ";" there (Podman 4 splits at ",")
        labels[LABEL_DEVICES] = labels[LABEL_DEVICES].replace(";", ",")
    inspect = {
        "Id": ask.container,
        "Config": {"Labels": labels},
        "HostConfig": {"Devices": [{"PathOnHost": path} for path in paths]},
    }
    return container_of(ask.container, inspect)


def _only_pending(container: Container, verdict: StartVerdict) -> bool:
    """A refusal of a container without a lease label whose every reason is a pending
    lease."""
    refusal = verdict.refusal
    return (
        container.lease is None
        and refusal is not None
        and bool(refusal.taken)
        and all(taken.hold is Hold.PENDING for taken in refusal.taken)
    )
