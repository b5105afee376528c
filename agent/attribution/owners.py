"""Each GPU process's owner: its cgroup says which container, the container's engine (the
Docker engine, or Podman's API service) says its name and image, and a cache keeps the
engines out of the hot path.

- The cgroup is read at every call (a procfs read of a few microseconds): PIDs are reused,
  so an old answer could name the wrong container.
- Container facts are cached by engine and container id, LRU-bounded (``max_containers``).
  A miss asks the engine (concurrent misses of one id share one request); an entry is asked again
  after ``ttl_s`` (a renamed container), an id the engine does not know after
  ``missing_ttl_s`` (a container of another engine, or one just removed).
- An inspect the engine does not answer in time is asked again of its container list
  (``DockerEngine.listed``): dockerd holds a container's lock while it starts or stops, and
  an inspect waits for it (a start of seconds, where a runtime hook or an image is slow),
  while the list answers at once. Podman's list waits for the lock too: when neither
  answers in time but the engine answers its ping (``GET /_ping``, asked beside the list),
  the engine holds that container: it is shown by id, asked again after ``BUSY_RETRY_S``,
  counted as a failed lookup and not logged; the engine is not taken as down. Only an
  engine that answers neither is.
- While an engine cannot be reached, it is asked again only every ``retry_s``; the
  processes keep their container id and kind, without name and image. The outage is logged
  once per engine, and its end too. Without a Podman service (the common case on Docker
  nodes), Podman containers are shown by id and the engine is asked only every ``retry_s``.
- An answer that breaks a bound (``BadAnswer``: too large, too deep, not JSON; see
  ``docker_engine``) is a failed lookup of that container alone: it is shown by id, asked
  again after ``retry_s``, and logged in one line, at most once per engine and ``retry_s``
  (the next line says how many were held back). So is an error that no answer should cause
  (a bug here): one line, its traceback only at debug level (``NV_DEBUG``).
- A Docker container that the Mesos Docker containerizer started is named
  ``mesos-<container id>`` (older Mesos: ``mesos-<agent id>.<container id>``, and its
  executor's ``....executor``): its Mesos container id is taken from the name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.attribution.cgroup import CgroupPlace, OwnerKind, read_place
from agent.attribution.docker_engine import (
    BadAnswer,
    ContainerFacts,
    DockerEngine,
    DockerEngineError,
    EngineTimeout,
)
from agent.display import shown
from agent.edge.rate_limit import RateLimiter

log = logging.getLogger("nvidia-docker-plugin.attribution")

MESOS_DOCKER_PREFIX = "mesos-"
BUSY_RETRY_S = 5.0  # a container its engine holds (starting, stopping): asked again after


@dataclass(frozen=True, slots=True)
class ProcessOwner:
    """What a GPU process runs in; the fields that do not apply (or are not known) are None."""

    kind: OwnerKind
    container_id: str | None = None
    container_name: str | None = None
    image: str | None = None
    mesos_container: str | None = None
    labels: tuple[tuple[str, str], ...] = ()  # the engines' wanted labels (ContainerFacts)

    @property
    def in_container(self) -> bool:
        return self.kind not in (OwnerKind.HOST, OwnerKind.UNKNOWN)

    @property
    def key(self) -> tuple[OwnerKind, str | None, str | None]:
        """Two processes with the same key run in the same container."""
        return (self.kind, self.container_id, self.mesos_container)


_Key = tuple[OwnerKind, str]  # (engine, container id)


@dataclass(slots=True)
class _Entry:
    facts: ContainerFacts | None  # None: the engine does not know this id
    expires_at: float


class Attributor:
    """Maps PIDs to their owners; one per agent, used from the event loop."""

    def __init__(
        self,
        engine: DockerEngine | None,
        *,
        podman: DockerEngine | None = None,
        proc: Path = Path("/proc"),
        max_containers: int = 4096,
        ttl_s: float = 300.0,
        missing_ttl_s: float = 30.0,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = {
            kind: client
            for kind, client in ((OwnerKind.DOCKER, engine), (OwnerKind.PODMAN, podman))
            if client is not None
        }
        self.proc = proc
        self.max_containers = max_containers
        self.ttl_s = ttl_s
        self.missing_ttl_s = missing_ttl_s
        self.retry_s = retry_s
        self._clock = clock
        self._cache: OrderedDict[_Key, _Entry] = OrderedDict()
        self._pending: dict[_Key, asyncio.Future[ContainerFacts | None]] = {}
        self._engine_down_until: dict[OwnerKind, float] = {}
        self._bad_answer_lines = RateLimiter(retry_s, clock=clock)  # keyed by engine
        self.lookups = 0  # requests to the engines that ended (answered or failed)
        self.lookup_failures = 0  # of which failed (engine unreachable, timeout, bad answer)

    async def owners(self, pids: Iterable[int]) -> dict[int, ProcessOwner]:
        """The owner of every PID (each read once); never raises."""
        places = {pid: read_place(pid, self.proc) for pid in dict.fromkeys(pids)}
        keys = {
            (p.kind, p.container_id)
            for p in places.values()
            if p.kind in (OwnerKind.DOCKER, OwnerKind.PODMAN) and p.container_id
        }
        facts = await self._facts(keys)
        return {
            pid: _owner(place, facts.get((place.kind, place.container_id or "")))
            for pid, place in places.items()
        }

    async def container(self, container_id: str) -> tuple[OwnerKind, ContainerFacts] | None:
        """A container's engine and facts, by its id (a lease's container), from the cache
        or the engines (Docker's first); None when no engine knows it (or none answers)."""
        for kind in self.engines:
            facts = (await self._facts([(kind, container_id)])).get((kind, container_id))
            if facts is not None:
                return kind, facts
        return None

    async def _facts(self, keys: Iterable[_Key]) -> dict[_Key, ContainerFacts]:
        now = self._clock()
        known: dict[_Key, ContainerFacts] = {}
        missing: list[_Key] = []
        for key in keys:
            entry = self._cache.get(key)
            if entry is not None and entry.expires_at > now:
                self._cache.move_to_end(key)
                if entry.facts is not None:
                    known[key] = entry.facts
            else:
                if entry is not None and entry.facts is not None:
                    known[key] = entry.facts  # stale, but better than nothing
                if key[0] in self.engines and not self._engine_down(key[0], now):
                    missing.append(key)
        if missing:
            answers = await asyncio.gather(*(self._ask(key) for key in missing))
            for key, facts in zip(missing, answers, strict=True):
                if facts is not None:
                    known[key] = facts
                else:
                    known.pop(key, None)
        return known

    def _engine_down(self, kind: OwnerKind, now: float) -> bool:
        return now < self._engine_down_until.get(kind, now)

    async def _ask(self, key: _Key) -> ContainerFacts | None:
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(key))
            self._pending[key] = pending
            pending.add_done_callback(lambda _f: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    async def _lookup(self, key: _Key) -> ContainerFacts | None:
        """Ask the engine about one container; counted in ``lookups`` when it ends, as its
        failures are, so that ``lookups - lookup_failures`` (the answered ones, a Prometheus
        counter) never goes down while a lookup is still in flight."""
        facts = await self._lookup_once(key)
        self.lookups += 1
        return facts

    async def _lookup_once(self, key: _Key) -> ContainerFacts | None:
        kind, container_id = key
        engine = self.engines[kind]
        try:
            facts = await _inspect_or_list(engine, container_id)
        except _ContainerBusy:
            return self._busy(key)
        except BadAnswer as err:
            self._log_bad_answer(kind, str(err))
            return self._failed(key)
        except DockerEngineError as err:
            self.lookup_failures += 1
            if kind not in self._engine_down_until:
                log.warning(
                    "%s: GPU processes in %s containers are shown with their container "
                    "id only (no name, no image); asking again every %g s",
                    err,
                    kind.value.capitalize(),
                    self.retry_s,
                )
            self._engine_down_until[kind] = self._clock() + self.retry_s
            cached = self._cache.get(key)
            return cached.facts if cached is not None else None
        except Exception as err:  # a bug here, not the engine's doing: never cost the scrape
            log.debug("Asking %s about container %s failed", engine.what, container_id,
                      exc_info=True)  # fmt: skip
            self._log_bad_answer(
                kind,
                f"asking {engine.where} about container {container_id[:12]} failed "
                f"unexpectedly ({type(err).__name__}: {shown(str(err))}; please report it, "
                "NV_DEBUG=1 logs its traceback)",
            )
            return self._failed(key)
        if self._engine_down_until.pop(kind, None) is not None:
            log.info("%s answers again: containers are named", engine.what.capitalize())
        ttl = self.ttl_s if facts is not None else self.missing_ttl_s
        self._remember(key, _Entry(facts, self._clock() + ttl))
        return facts

    def _busy(self, key: _Key) -> ContainerFacts | None:
        """A container the engine holds (starting or stopping) while the engine answers:
        counted as failed, not logged, asked again after ``BUSY_RETRY_S``; the engine is
        not taken as down (what was known of the container, if anything, is kept)."""
        self.lookup_failures += 1
        self._engine_down_until.pop(key[0], None)  # it answers: no outage (or its end)
        cached = self._cache.get(key)
        facts = cached.facts if cached is not None else None
        self._remember(key, _Entry(facts, self._clock() + BUSY_RETRY_S))
        return facts

    def _failed(self, key: _Key) -> ContainerFacts | None:
        """A lookup the engine answered unusably: counted, and not asked again for
        ``retry_s`` (what was known of the container, if anything, is kept until then)."""
        self.lookup_failures += 1
        self._engine_down_until.pop(key[0], None)  # it answers: no outage (or its end)
        cached = self._cache.get(key)
        facts = cached.facts if cached is not None else None
        self._remember(key, _Entry(facts, self._clock() + self.retry_s))
        return facts

    def _log_bad_answer(self, kind: OwnerKind, message: str) -> None:
        held_back = self._bad_answer_lines.allow(kind.value)
        if held_back is None:
            return
        more = ""
        if held_back:
            answers = "answer" if held_back == 1 else "answers"
            more = f"; {held_back} more such {answers} since the last line"
        log.warning(
            "%s; the container is shown with its id only (no name, no image), asked again "
            "in %g s%s",
            message,
            self.retry_s,
            more,
        )

    def _remember(self, key: _Key, entry: _Entry) -> None:
        self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_containers:
            self._cache.popitem(last=False)

    @property
    def cached_containers(self) -> int:
        return len(self._cache)

    async def close(self) -> None:
        for pending in list(self._pending.values()):
            pending.cancel()
        for engine in self.engines.values():
            await engine.close()


class _ContainerBusy(Exception):
    """Neither the inspect nor the list of one container was answered in time, but the
    engine answers its ping: it holds that container (a start, a stop)."""


async def _inspect_or_list(engine: DockerEngine, container_id: str) -> ContainerFacts | None:
    """The container's facts by its inspect, else by the engine's list (see the module);
    ``_ContainerBusy`` when neither answers in time and the engine answers its ping."""
    try:
        return await engine.inspect(container_id)
    except EngineTimeout:
        pass
    alive = asyncio.ensure_future(engine.answers_ping())
    try:
        return await engine.listed(container_id)
    except EngineTimeout:
        if await alive:
            raise _ContainerBusy from None
        raise
    finally:
        alive.cancel()


def _owner(place: CgroupPlace, facts: ContainerFacts | None) -> ProcessOwner:
    mesos = place.mesos_container
    if facts is not None and mesos is None and facts.name:
        mesos = mesos_container_of(facts.name)
    return ProcessOwner(
        kind=place.kind,
        container_id=place.container_id,
        container_name=facts.name if facts else None,
        image=facts.image if facts else None,
        mesos_container=mesos,
        labels=facts.labels if facts else (),
    )


def mesos_container_of(docker_name: str) -> str | None:
    """The Mesos container id in the name the Mesos Docker containerizer gives a container."""
    if not docker_name.startswith(MESOS_DOCKER_PREFIX):
        return None
    rest = docker_name[len(MESOS_DOCKER_PREFIX) :].removesuffix(".executor")
    container_id = rest.rpartition(".")[2]  # drop "<agent id>." of older Mesos versions
    return container_id or None
