"""What the engines say about containers, fed to the lease service in order.

``EngineFeed`` takes the callbacks of one ``agent.engines.events.EngineEvents`` per engine
(dockerd, Podman's API service) and turns them into the lease service's calls:

- ``created`` and ``started`` events inspect the container (its lease label and the GPU
  devices it was given) and call ``created(container)`` / ``started(container)``; a
  container gone by the time it is inspected is left to its ``destroyed`` event. A
  ``created`` container is often starting by the time it is inspected (``docker run``), and
  dockerd holds it for as long as its start takes (seconds, with a slow runtime hook), and
  an inspect waits for that: so a ``created`` inspect has ``CREATED_INSPECT_S``, then the
  container is read from the engine's list (its lease label, all that ``created`` reads:
  dockerd's list does not wait), and where that does not answer within the client's time
  either (Podman's list waits too) the event is left to the container's ``started`` event;
- ``died`` and ``destroyed`` call ``died(id)`` / ``destroyed(id)``;
- a resync (the stream opened, every container listed) calls ``resync(name, containers)``
  for that engine at once: the table ends only what that engine's containers held, so
  Docker's list never ends the leases of Podman's containers, and an engine that is down
  (after a restart of the agent, say) keeps its containers' leases as the state file had
  them until it lists them.

Each engine is known by a name that its containers carry (``Container.engine``) and the
state file keeps: its socket path, unless ``follow`` is given another. At ``start`` the
feed tells the table which names it follows (``followed``): leases of containers of any
other engine (a socket path that changed) are of an unknown engine from then on.

The events of all engines go through one queue, handled one at a time by one task, so that
an event is applied after the ones before it even when its inspect takes a while. The
queue is bounded (``MAX_QUEUED``): an engine that sends more events than can be inspected
makes the feed drop what is queued and list every engine's containers again (a resync),
which costs a list but loses nothing. An inspect that fails (the engine went away) is one
line; the stream's reopening resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import quote

from agent.engines.containers import (
    container_of,
    inspect_container,
    list_containers,
    listed_container,
)
from agent.engines.events import FIRST_BACKOFF_S, MOST_BACKOFF_S, EngineEvents, EventKind
from agent.engines.http import BadAnswer, EngineClient, EngineError, EngineTimeout, parse_answer
from agent.leases.containers import Container, check_engine
from agent.leases.labels import LABEL_ID
from agent.leasing.service import LeaseService, NotListed

log = logging.getLogger("nvidia-docker-plugin.leases")

MAX_QUEUED = 4096  # events waiting for their turn, all engines together
# A created container's inspect: answered in milliseconds, unless the container is already
# starting (dockerd then holds it, and the inspect waits for the start): the list then.
CREATED_INSPECT_S = 0.5
LABELLED_S = 2.0  # each engine's list of the containers that carry one lease's label


class _Starting(Exception):
    """A created container that neither its inspect nor the list told in time."""


@dataclass(frozen=True, slots=True)
class _Event:
    engine: int
    kind: EventKind
    container_id: str


@dataclass(frozen=True, slots=True)
class _Resync:
    engine: int
    containers: tuple[Container, ...]


@dataclass(frozen=True, slots=True)
class _Relist:
    engine: int


class Inspect(Protocol):
    """How the feed inspects a container (tests give their own)."""

    def __call__(
        self, engine: EngineClient, container_id: str, *, timeout_s: float | None = None
    ) -> Awaitable[Container | None]: ...


async def _inspect(
    engine: EngineClient, container_id: str, *, timeout_s: float | None = None
) -> Container | None:
    return await inspect_container(engine, container_id, timeout_s=timeout_s)


class EngineFeed:
    """The engines' container events, applied to ``service`` one at a time (see module)."""

    def __init__(self, service: LeaseService, *, inspect: Inspect = _inspect) -> None:
        self._service = service
        self._inspect = inspect
        self._engines: list[EngineClient] = []
        self._names: list[str] = []  # per engine: the name its containers carry
        self._events: list[EngineEvents] = []
        self._listed: list[bool] = []  # per engine: whether its containers were ever listed
        self._queue: asyncio.Queue[_Event | _Resync | _Relist] = asyncio.Queue(MAX_QUEUED + 64)
        self._task: asyncio.Task[None] | None = None
        self.applied = 0  # events and resyncs applied, since start

    def follow(
        self,
        engine: EngineClient,
        *,
        name: str | None = None,
        with_facts: bool = False,
        first_backoff_s: float = FIRST_BACKOFF_S,
        most_backoff_s: float = MOST_BACKOFF_S,
    ) -> EngineEvents:
        """Follow ``engine``'s events; its containers carry ``name`` (default: its socket
        path). ``with_facts`` and the reconnection's pauses are ``EngineEvents``'; the stream
        reads containers as the feed's own inspects and lists do (the engines' defaults)."""
        name = check_engine(str(engine.socket_path) if name is None else name)
        if name in self._names:
            raise ValueError(f"two engines named {name!r}: each engine needs a name of its own")
        index = len(self._engines)
        self._engines.append(engine)
        self._names.append(name)
        self._listed.append(False)

        def on_event(kind: EventKind, container_id: str) -> None:
            self._put(_Event(index, kind, container_id))

        def on_resync(containers: list[Container]) -> None:
            self._put(_Resync(index, tuple(containers)))

        events = EngineEvents(
            engine,
            on_event,
            on_resync,
            with_facts=with_facts,
            first_backoff_s=first_backoff_s,
            most_backoff_s=most_backoff_s,
        )
        self._events.append(events)
        return events

    def engines(self) -> tuple[EngineEvents, ...]:
        """Each followed engine's events, in the order followed: whether they follow now,
        and the engine's facts where they are read (``/engines/json``)."""
        return tuple(self._events)

    def denied(self) -> str | None:
        """Why leases would go unfollowed (``LeaseService.refuse_while``): the line of the
        first engine followed (the agent's Docker engine, which the wrapper, Compose and the
        engine socket create with) while its socket refuses the agent
        (``EngineEvents.denied``), or of another engine that does while no engine is
        followed (a Podman-only node); None otherwise. Another engine refused beside a
        followed Docker (root Podman's socket, for an agent of its own user) refuses
        nothing: Docker's leases are followed, and Podman's starts still ask the start
        hook."""
        if not self._events:
            return None
        if self._events[0].denied is not None:
            return self._events[0].denied
        if any(e.following for e in self._events):
            return None
        return next((e.denied for e in self._events[1:] if e.denied is not None), None)

    def start(self) -> None:
        self._service.followed(self._names)
        self._service.find_labelled_with(self.labelled)
        self._service.refuse_while(self.denied)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease feed")
        for events in self._events:
            events.start()

    async def close(self) -> None:
        for events in self._events:
            await events.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def labelled(self, lease_id: str) -> list[Container]:
        """The containers that carry ``lease_id``'s label, as each engine's list tells them
        now (``docker ps -a --filter label=nvidia-docker.lease=ID``: their ids, states and
        lease labels), within ``LABELLED_S`` each. An engine whose events are not followed
        now is pinged first; one that does not answer is not asked if the feed never listed
        its containers (no socket: a Docker-only node's Podman; the table never knew its
        containers). ``NotListed`` (one line) when an engine that was followed does not
        answer now (Podman's CLI creates containers while its API service is down), or an
        engine that answers does not list them."""
        filters = quote(json.dumps({"label": [f"{LABEL_ID}={lease_id}"]}), safe="")
        about = f"to its list of the containers of {lease_id[:40]}"
        found: list[Container] = []
        engines = zip(self._names, self._engines, self._events, self._listed, strict=True)
        for name, engine, events, ever_listed in engines:
            if not events.following and not await engine.answers_ping(LABELLED_S):
                if ever_listed:
                    raise NotListed(
                        f"{engine.where} does not answer now (its events are not followed)"
                    )
                continue
            try:
                body = await engine.get(
                    f"/containers/json?all=1&filters={filters}", about, timeout_s=LABELLED_S
                )
                if body is None:
                    raise EngineError(f"{engine.where} answered HTTP 404 {about}")
                listed = parse_answer(body, engine.bad_answer(about))
                if not isinstance(listed, list):
                    raise BadAnswer(f"{engine.bad_answer(about)}: it is not a JSON array")
            except EngineError as err:
                raise NotListed(str(err)) from None
            for item in listed:
                if not isinstance(item, dict) or not isinstance(item.get("Id"), str):
                    continue
                as_inspected = {
                    "Id": item["Id"],
                    "State": {"Status": item.get("State")},
                    "Config": {"Labels": item.get("Labels")},
                }
                container = container_of(item["Id"], as_inspected)
                label = container.lease
                if label is not None and label.lease_id == lease_id:  # the filter, checked
                    found.append(replace(container, engine=name))
        return found

    def relist(self) -> None:
        """List every engine's containers again and resync the table with them (after a
        node change: the units the containers' devices name have changed)."""
        for index in range(len(self._engines)):
            self._put(_Relist(index))

    async def drained(self) -> None:
        """Wait until every event queued so far is applied (tests)."""
        await self._queue.join()

    def _put(self, item: _Event | _Resync | _Relist) -> None:
        if self._queue.qsize() < MAX_QUEUED:
            self._queue.put_nowait(item)
        else:
            self._overflowed(item.engine)

    def _overflowed(self, engine: int) -> None:
        """Too many events: drop the queue and list every engine's containers again."""
        dropped = 0
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
            dropped += 1
        log.warning(
            "Leases: %d container events (the latest of %s) arrived faster than they could "
            "be applied; they are dropped and the containers listed again",
            dropped,
            self._engines[engine].where,
        )
        for index in range(len(self._engines)):
            self._queue.put_nowait(_Relist(index))

    async def _created(self, engine: EngineClient, container_id: str) -> Container | None:
        """A created container, inspected within ``CREATED_INSPECT_S``; else as the list
        tells it (its lease label is all ``created`` reads: dockerd's list does not wait for
        the start that holds the container), within the client's time; ``_Starting`` when
        that does not answer in time either (Podman's list waits too: the container's start
        event follows)."""
        try:
            return await self._inspect(engine, container_id, timeout_s=CREATED_INSPECT_S)
        except EngineTimeout:
            pass
        try:
            return await listed_container(engine, container_id)
        except EngineTimeout:
            raise _Starting from None

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._apply(item)
            except Exception:  # a bug: the feed must go on
                log.exception("Leases: applying a container event failed")
            finally:
                self._queue.task_done()
            self.applied += 1

    async def _apply(self, item: _Event | _Resync | _Relist) -> None:
        name = self._names[item.engine]
        if isinstance(item, _Relist):
            engine = self._engines[item.engine]
            try:
                listed = await list_containers(engine)
            except EngineError as err:
                log.warning("Leases: the containers of %s not listed: %s", engine.where, err)
                return
            item = _Resync(item.engine, tuple(listed))
        if isinstance(item, _Resync):
            self._listed[item.engine] = True
            self._service.resync(name, [replace(c, engine=name) for c in item.containers])
            return
        if item.kind in (EventKind.DIED, EventKind.DESTROYED):
            if item.kind is EventKind.DESTROYED:
                self._service.destroyed(item.container_id)
            else:
                self._service.died(item.container_id)
            return
        engine = self._engines[item.engine]
        try:
            if item.kind is EventKind.CREATED:
                container = await self._created(engine, item.container_id)
            else:
                container = await self._inspect(engine, item.container_id)
        except _Starting:
            log.debug(
                "Leases: container %s of %s is being started: its start event binds it",
                item.container_id[:12],
                engine.where,
            )
            return
        except EngineError as err:
            log.warning(
                "Leases: container %s of %s not inspected (%s); its lease follows the next resync",
                item.container_id[:12],
                engine.where,
                err,
            )
            return
        if container is None:
            return  # removed already: its destroyed event follows
        container = replace(container, engine=name)
        if item.kind is EventKind.CREATED:
            self._service.created(container)
        else:
            self._service.started(container)
