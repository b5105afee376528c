"""An engine's container events, followed for the lease table: create, start, die, destroy.

``EngineEvents`` holds ``GET /events?filters={"type":["container"]}`` open (dockerd, and
Podman's API service on its Docker-compatible endpoint: one JSON object a line, chunked,
never ending) and calls ``on_event(kind, container_id)`` for each event the table follows:

| the engine's ``Action`` (or ``status``) | ``EventKind`` (the table's call) |
| --- | --- |
| ``create`` | ``created`` |
| ``start`` | ``started`` |
| ``die`` (Podman's own name: ``died``) | ``died`` |
| ``destroy`` (Podman's: ``remove``) | ``destroyed`` |

Other events (``kill``, ``stop``, ``exec_start: ...``, Podman's ``init`` and ``cleanup``) are
left out. Each time the stream opens, before its first event is handled, it lists the
engine's containers (``list_containers``) and calls ``on_resync(containers)``: the stream
is opened first, so an event that happens while the list is read is in the stream, after
the resync, and none is lost between an outage and the list.

When the engine cannot be reached, ends the stream (it stopped, or restarted), or sends a
line it may not (longer than ``MAX_LINE_BYTES``, not JSON, too deep, a container event
without a container id), the stream is reopened after a pause that starts at
``first_backoff_s`` (0.5 s) and doubles up to ``most_backoff_s`` (30 s); it starts again
from the first once a stream has stayed open for ``steady_s``. An outage is two log lines:
one when the events stop (why), one when they follow again; never a traceback (that is
at debug level, ``NV_DEBUG``, for an error no engine should cause).

With ``with_facts`` (the node's Docker socket), the engine's version is read before the
stream opens; where it is dockerd (not Podman's service, which sends no daemon events) the
stream takes the ``daemon`` events too, and ``facts`` holds its version and CDI spec dirs
(``agent.engines.facts``): read as the stream opens, before the resync, read again at each
``daemon reload`` event, and None whenever no stream is open or they could not be read.

The callbacks are plain functions, called in the event loop one at a time, in the stream's
order (the lease service makes them the table's serialised calls). An exception in one is
one log line (at most one per kind of callback and ``steady_s``), and the stream goes on.
While the engine is quiet the stream is one blocked read: nothing polls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote

from agent.display import shown
from agent.edge.rate_limit import RateLimiter
from agent.engines.containers import LIST_TIMEOUT_S, MAX_CONTAINERS, list_containers
from agent.engines.facts import EngineFacts, dockerd_version, is_reload, read_facts
from agent.engines.http import BadAnswer, EngineClient, EngineDenied, EngineError, parse_answer
from agent.leases.containers import Container

log = logging.getLogger("nvidia-docker-plugin.engines")

FIRST_BACKOFF_S = 0.5
MOST_BACKOFF_S = 30.0
STEADY_S = 30.0  # a stream open this long resets the backoff
EVENTS_PATH = "/events?filters=" + quote(
    json.dumps({"type": ["container"]}, separators=(",", ":")), safe=""
)
# With the engine's facts: its daemon events too (``reload``; dockerd only, see facts.py).
EVENTS_PATH_WITH_DAEMON = "/events?filters=" + quote(
    json.dumps({"type": ["container", "daemon"]}, separators=(",", ":")), safe=""
)
_ABOUT = "in its event stream"
_ID = re.compile(r"[0-9a-f]{64}")


class EventKind(StrEnum):
    """A container event the lease table follows, named as the table's call for it."""

    CREATED = "created"
    STARTED = "started"
    DIED = "died"
    DESTROYED = "destroyed"


ACTIONS: Mapping[str, EventKind] = {
    "create": EventKind.CREATED,
    "start": EventKind.STARTED,
    "die": EventKind.DIED,
    "died": EventKind.DIED,
    "destroy": EventKind.DESTROYED,
    "remove": EventKind.DESTROYED,
}

OnEvent = Callable[[EventKind, str], None]
OnResync = Callable[[list[Container]], None]


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """One followed event: its kind and the container's full id."""

    kind: EventKind
    container_id: str


def event_of(value: object, bad: str = "the engine's event") -> EngineEvent | None:
    """The followed event one parsed line of the stream says; None for an event the table
    does not follow (another type, another action). ``BadAnswer`` (``bad``: which answer)
    for a line that is not an object, or an event it follows without a container id."""
    if not isinstance(value, dict):
        raise BadAnswer(f"{bad}: a line of it is not a JSON object (an event)")
    if value.get("Type", "container") != "container":
        return None
    action = value.get("Action")
    if not isinstance(action, str):
        action = value.get("status")
    kind = ACTIONS.get(action) if isinstance(action, str) else None
    if kind is None:
        return None
    actor = value.get("Actor")
    container_id = actor.get("ID") if isinstance(actor, dict) else None
    if not isinstance(container_id, str):
        container_id = value.get("id")
    if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
        raise BadAnswer(f"{bad}: one of its {action} events has no 64-hex container id")
    return EngineEvent(kind, container_id)


class Backoff:
    """The pauses between attempts: ``first_s``, doubled at each attempt up to ``most_s``,
    and ``first_s`` again after ``reset()``."""

    def __init__(self, first_s: float = FIRST_BACKOFF_S, most_s: float = MOST_BACKOFF_S):
        if not 0 < first_s <= most_s:
            raise ValueError(f"backoff: need 0 < first ({first_s}) <= most ({most_s})")
        self.first_s = first_s
        self.most_s = most_s
        self._next_s = first_s

    def next_s(self) -> float:
        """The pause before the next attempt (and the one after it doubled)."""
        pause = self._next_s
        self._next_s = min(self._next_s * 2, self.most_s)
        return pause

    def reset(self) -> None:
        self._next_s = self.first_s


class EngineEvents:
    """Follows one engine's container events (see the module); ``start()`` in the event
    loop, ``close()`` when done."""

    def __init__(
        self,
        engine: EngineClient,
        on_event: OnEvent,
        on_resync: OnResync,
        *,
        first_backoff_s: float = FIRST_BACKOFF_S,
        most_backoff_s: float = MOST_BACKOFF_S,
        steady_s: float = STEADY_S,
        max_containers: int = MAX_CONTAINERS,
        list_timeout_s: float = LIST_TIMEOUT_S,
        visible_devices_env: bool | None = None,
        with_facts: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.engine = engine
        self.on_event = on_event
        self.on_resync = on_resync
        self.steady_s = steady_s
        self.max_containers = max_containers
        self.list_timeout_s = list_timeout_s
        self.visible_devices_env = visible_devices_env
        self.with_facts = with_facts
        self._facts: EngineFacts | None = None  # as last read from the engine
        self._backoff = Backoff(first_backoff_s, most_backoff_s)
        self._clock = clock
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None
        self._following = False
        self._down = False  # the events stopped, and that was logged
        self._ever_followed = False
        self._denied: str | None = None  # the last attempt's EACCES line
        self._callback_lines = RateLimiter(steady_s, clock=clock)

    @property
    def following(self) -> bool:
        """Whether a stream is open and resynced now."""
        return self._following

    @property
    def denied(self) -> str | None:
        """The line of the last attempt to follow when the engine's socket refused this
        process (EACCES: the agent's user is not in the socket's group); None once an
        attempt got further, or ended for another reason (the engine down)."""
        return self._denied

    @property
    def facts(self) -> EngineFacts | None:
        """The engine's version and CDI spec dirs while it is followed (``with_facts``)."""
        return self._facts if self._following else None

    def start(self) -> None:
        """Follow the events in a task of the running loop (again after ``close``)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"events of {self.engine.where}"
            )

    async def close(self) -> None:
        """Stop following: the stream is closed, no callback is called after this returns."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # our caller is cancelled too, not only the task we ended

    async def _run(self) -> None:
        while True:
            opened_at = await self._follow_once()
            if opened_at is not None and self._clock() - opened_at >= self.steady_s:
                self._backoff.reset()
            await self._sleep(self._backoff.next_s())

    async def _follow_once(self) -> float | None:
        """One stream, from its opening to its end; when it was resynced (None: never)."""
        opened_at: float | None = None
        try:
            # dockerd's version first: its daemon events are asked for only then (Podman's
            # service sends none); its CDI dirs after the stream opens, so that a reload
            # meanwhile is in the stream
            version = await self._dockerd_version() if self.with_facts else None
            path = EVENTS_PATH_WITH_DAEMON if version is not None else EVENTS_PATH
            stream = await self.engine.stream(path, _ABOUT)
            try:
                if version is not None:
                    self._facts = await self._read_facts(version)
                containers = await list_containers(
                    self.engine,
                    max_containers=self.max_containers,
                    timeout_s=self.list_timeout_s,
                    visible_devices_env=self.visible_devices_env,
                )
                self._resynced(containers)
                opened_at = self._clock()
                bad = self.engine.bad_answer(_ABOUT)
                async for line in stream:
                    value = parse_answer(line, bad)
                    event = event_of(value, bad)
                    if event is not None:
                        self._call_on_event(event)
                    elif version is not None and is_reload(value):
                        self._facts = await self._read_facts(version)
                why = f"{self.engine.where} ended its event stream"
            finally:
                self._following = False
                self._facts = None
                await stream.close()
        except EngineError as err:
            why = str(err)
            self._denied = why if isinstance(err, EngineDenied) else None
        except Exception as err:  # a bug here, not the engine's doing: never end the task
            log.debug("Following the events of %s failed", self.engine.where, exc_info=True)
            why = (
                f"following the events of {self.engine.where} failed unexpectedly "
                f"({type(err).__name__}: {shown(str(err))}; please report it, NV_DEBUG=1 "
                "logs its traceback)"
            )
        self._lost(why)
        return opened_at

    async def _dockerd_version(self) -> str | None:
        """dockerd's version; None for another engine, or an answer that is not dockerd's
        (then no facts are read, and the wrapper asks the engine itself, as without an
        agent). ``EngineError`` when the engine cannot be asked: it is down, as for the
        stream."""
        try:
            return await dockerd_version(self.engine)
        except BadAnswer as err:
            log.debug("No facts of %s: %s", self.engine.where, err)
            return None

    async def _read_facts(self, version: str) -> EngineFacts | None:
        try:
            return await read_facts(self.engine, version)
        except EngineError as err:
            if self._callback_lines.allow("facts") is not None:  # at most one a steady_s
                log.warning("%s; the wrapper asks the engine itself whether it reads CDI", err)
            return None

    def _resynced(self, containers: list[Container]) -> None:
        self._following = True
        count = f"{len(containers)} container{'' if len(containers) == 1 else 's'}"
        if self._down:
            log.info(
                "%s answers again: following its container events (resynced with %s)",
                _capital(self.engine.where),
                count,
            )
        elif not self._ever_followed:
            log.info("Following the container events of %s (%s)", self.engine.where, count)
        self._down = False
        self._denied = None
        self._ever_followed = True
        try:
            self.on_resync(containers)
        except Exception as err:
            self._callback_failed("resync", f"the resync with {count}", err)

    def _call_on_event(self, event: EngineEvent) -> None:
        try:
            self.on_event(event.kind, event.container_id)
        except Exception as err:
            what = f"the {event.kind} event of container {event.container_id[:12]}"
            self._callback_failed("event", what, err)

    def _callback_failed(self, key: str, what: str, err: Exception) -> None:
        log.debug("Handling %s failed", what, exc_info=True)
        held_back = self._callback_lines.allow(key)
        if held_back is None:
            return
        more = f"; {held_back} more such failures since the last line" if held_back else ""
        log.warning(
            "Handling %s of %s failed (%s: %s); following the next events%s",
            what,
            self.engine.where,
            type(err).__name__,
            shown(str(err)),
            more,
        )

    def _lost(self, why: str) -> None:
        if self._down:
            return
        self._down = True
        log.warning(
            "%s: %s; trying again every %g s, up to every %g s (the containers are resynced "
            "when the events follow again)",
            "Container events stopped" if self._ever_followed else "Cannot follow container events",
            why,
            self._backoff.first_s,
            self._backoff.most_s,
        )


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]
