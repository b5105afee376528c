"""An engine's containers as the lease table takes them (``agent.leases.containers.Container``).

``list_containers`` asks ``GET /containers/json?all=1`` (``docker ps -a``) for the ids, then
``GET /containers/<id>/json`` (``docker inspect``) of each, at most ``INSPECTS_AT_ONCE`` at
a time so that attribution's lookups to the same engine always find a free request slot. A
container removed between the two answers 404 and is left out; one whose inspect times out
while the list shows it not running (dockerd holds a container that is starting) is taken
as the list shows it (``listed_container``). Docker and Podman's API service answer both
requests the same way.

Of each container the table gets its id, whether it runs (``State``: running, paused or
restarting), its lease label (``read_label`` of ``Config.Labels``) and the GPUs it was given
by other means than a lease, with how (``given_devices``, a pure function of the inspect
answer):

- ``HostConfig.Devices`` whose ``PathOnHost`` is a GPU's device file (``/dev/nvidia3``:
  ``--device``) or a MIG capability file (``/dev/nvidia-caps/nvidia-cap12``, which says
  which MIG devices of a GPU named by its file it gets); or a CDI name
  (``nvidia.com/gpu=0``, or of the agent's own kind under ``--cdi-kind``:
  ``nvidia-docker.com/gpu=0``), where an engine shows CDI devices there. Not ``nvidiactl``,
  ``nvidia-uvm`` or ``nvidia-modeset``: every GPU container has them, they name no GPU;
- ``HostConfig.DeviceRequests`` of NVIDIA's device driver (``--gpus``: driver ``nvidia``, or
  no driver and a set of NVIDIA's capabilities only, as ``gpu``): ``all`` for a count of -1, the
  first N GPUs (``0`` to ``N-1``, as dockerd hands them out) for a count of N, else its
  ``DeviceIDs`` (indices, UUIDs, MIG devices) as given; and of the ``cdi`` driver (Docker
  25+: ``--device nvidia.com/gpu=0``), the names of a GPU kind (``<vendor>/gpu=``);
- ``NVIDIA_VISIBLE_DEVICES`` in ``Config.Env`` (its last value) when the container runs
  with NVIDIA's runtime (``HostConfig.Runtime`` names ``nvidia``: nvidia-container-runtime
  reads it; ``visible_devices_env`` says otherwise for an engine that runs NVIDIA's hook for
  every runtime): ``all``, or the entries it lists (``none``, ``void`` and empty give none).
  A ``--gpus`` request overrides it (dockerd sets it from the request), so it is then not
  read.

``created_container`` reads a create body (``POST /containers/create``, which the
authorization plugin sees before the container exists) the same way: its ``Labels``,
``Env`` and ``HostConfig`` are an inspect answer's ``Config`` and ``HostConfig``.

Devices are given in the forms ``NodeUnits.given`` reads; the table keeps what names GPUs of
the node. Bounded, failing safe: a container that names more than ``MAX_DEVICES`` entries
(or more GPUs by count) is given ``all``; an entry longer than ``MAX_DEVICE_CHARS``, or not
printable, names nothing and is left out; ``how`` (``--device /dev/nvidia1 --gpus all``) is
at most ``MAX_HOW_CHARS``, printable. A list of more than ``max_containers`` containers is
refused, not cut: a resync with a partial list would end the leases of those left out.

Not seen: a privileged container (it sees every device file, but may use none: its GPU
processes make it a holder when a status sweep sees them), and devices an engine does not
show in its inspect answer (Podman 4's CDI devices, and its device files outside ``/dev``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from agent.engines.http import (
    MIB,
    BadAnswer,
    EngineClient,
    EngineError,
    EngineTimeout,
    bounded_text,
    parse_answer,
)
from agent.leases.containers import Container
from agent.leases.labels import read_label
from agent.leases.units import cdi_device

MAX_CONTAINERS = 4096  # containers in one list (a resync)
# The list's answer: a real entry is about 1 KB (its labels, mounts and networks); 16 MiB is
# 4096 large ones. Of each entry only its Id is kept while it is parsed, so that its items
# cost no objects beyond that: 1 M of them (plain ids) are a few tens of MB at most.
MAX_LIST_BYTES = 16 * MIB
MAX_LIST_ITEMS = 1_048_576
LIST_TIMEOUT_S = 60.0  # the whole list: its answer and every inspect
INSPECTS_AT_ONCE = 2  # of the engine client's MAX_CONCURRENT requests
MAX_DEVICES = 512  # device entries of one container (64 GPUs of 7 MIG devices, and room)
MAX_DEVICE_CHARS = 128  # a UUID is 40; "nvidia.com/gpu=MIG-" and a UUID fit
MAX_HOW_CHARS = 256

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# The capabilities dockerd's NVIDIA device driver answers for (a request without a driver
# goes to the driver that has all the capabilities of one of its sets).
NVIDIA_CAPABILITIES = frozenset(
    {"gpu", "nvidia", "compute", "compat32", "graphics", "utility", "video", "display"}
)
_DEVICE_FILE = re.compile(r"/dev/nvidia[0-9]{1,4}")
_CAPABILITY_FILE = re.compile(r"/dev/nvidia-caps/nvidia-cap[0-9]{1,6}")
_ID = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")  # an id or a name, as Container takes
_RUNNING = frozenset({"running", "paused", "restarting"})
_NO_DEVICES = frozenset({"", "none", "void"})
_LIST_PATH = "/containers/json?all=1"
_LIST_ABOUT = "to its container list"


@dataclass(frozen=True, slots=True)
class GivenDevices:
    """The GPU devices a container was given, in ``NodeUnits.given``'s forms, and how (its
    flags, as words for the table's lines: ``--device /dev/nvidia1 --gpus all``; empty when
    it has none)."""

    devices: tuple[str, ...] = ()
    how: str = ""


class _Found:
    def __init__(self) -> None:
        self.devices: dict[str, None] = {}
        self.flags: dict[str, None] = {}
        self.too_many = False

    def add(self, entries: Iterable[str], flag: str) -> None:
        named = False
        for entry in entries:
            if not 0 < len(entry) <= MAX_DEVICE_CHARS or not entry.isprintable():
                continue  # names nothing the table knows
            named = True
            if entry not in self.devices:
                if len(self.devices) >= MAX_DEVICES:
                    self.too_many = True
                    break
                self.devices[entry] = None
        if named:
            self.flags[flag] = None

    def given(self) -> GivenDevices:
        if not self.devices and not self.too_many:
            return GivenDevices()
        devices = ("all",) if self.too_many else tuple(self.devices)
        how = bounded_text(" ".join(self.flags), MAX_HOW_CHARS) or ""
        return GivenDevices(devices, how)


def given_devices(
    inspect: Mapping[str, object], *, visible_devices_env: bool | None = None
) -> GivenDevices:
    """The GPU devices an inspect answer (``GET /containers/<id>/json``) says the container
    was given, and how; fields of other types than the engines' are read as absent.

    ``visible_devices_env``: whether ``NVIDIA_VISIBLE_DEVICES`` gives GPUs; None (the
    default): when its runtime is NVIDIA's."""
    host = _object(inspect.get("HostConfig"))
    config = _object(inspect.get("Config"))
    found = _Found()
    for entry in _array(host.get("Devices")):
        path = _object(entry).get("PathOnHost")
        if isinstance(path, str) and (
            _DEVICE_FILE.fullmatch(path)
            or _CAPABILITY_FILE.fullmatch(path)
            or cdi_device(path) is not None
        ):
            found.add([path], f"--device {path}")
    nvidia_request = False
    for raw in _array(host.get("DeviceRequests")):
        request = _object(raw)
        driver = request.get("Driver") or ""
        ids = [
            part.strip()
            for one in _array(request.get("DeviceIDs"))
            if isinstance(one, str)
            for part in one.split(",")
        ]
        if driver == "cdi":
            cdi = [name for name in ids if cdi_device(name) is not None]
            for name in cdi:
                found.add([name], f"--device {name}")
        elif driver == "nvidia" or (driver == "" and _nvidia_capabilities(request)):
            nvidia_request = True
            _add_request(found, request.get("Count"), ids)
    runtime = host.get("Runtime")
    env_gives = (
        visible_devices_env
        if visible_devices_env is not None
        else isinstance(runtime, str) and "nvidia" in runtime.lower()
    )
    if env_gives and not nvidia_request:
        value = _env_value(config.get("Env"), VISIBLE_DEVICES)
        if value is not None and value.strip().lower() not in _NO_DEVICES:
            entries = ["all"] if value.strip() == "all" else value.split(",")
            found.add((e.strip() for e in entries), f"{VISIBLE_DEVICES}={value}")
    return found.given()


def _nvidia_capabilities(request: Mapping[str, object]) -> bool:
    """Whether a request without a driver goes to NVIDIA's: one of its capability sets is
    all NVIDIA's (dockerd hands a request to the first driver that has every capability of
    one of its sets)."""
    sets = [_array(one_set) for one_set in _array(request.get("Capabilities"))]
    return any(
        one_set and all(isinstance(c, str) and c in NVIDIA_CAPABILITIES for c in one_set)
        for one_set in sets
    )


def _add_request(found: _Found, count: object, ids: list[str]) -> None:
    """A ``--gpus`` request, as dockerd's NVIDIA driver hands it out: its IDs, else its
    count (-1: all; N: the first N GPUs)."""
    if ids:
        found.add(ids, f"--gpus device={','.join(ids)}")
    elif isinstance(count, int) and not isinstance(count, bool) and count != 0:
        if count < 0:
            found.add(["all"], "--gpus all")
        elif count > MAX_DEVICES:
            found.too_many = True
            found.flags[f"--gpus {count}"] = None
        else:
            found.add([str(i) for i in range(count)], f"--gpus {count}")


def _env_value(env: object, name: str) -> str | None:
    value = None
    for entry in _array(env):
        if isinstance(entry, str) and entry.startswith(f"{name}="):
            value = entry.partition("=")[2]
    return value


def container_of(
    container_id: str, inspect: Mapping[str, object], *, visible_devices_env: bool | None = None
) -> Container:
    """The ``Container`` an inspect answer describes: its ``Id`` (``container_id`` when the
    answer's is not a 64-hex id), whether it runs, its lease label and its GPU devices."""
    full_id = inspect.get("Id")
    state = _object(inspect.get("State"))
    status = state.get("Status")
    labels = {
        key: value
        for key, value in _object(_object(inspect.get("Config")).get("Labels")).items()
        if isinstance(value, str)
    }
    given = given_devices(inspect, visible_devices_env=visible_devices_env)
    return Container(
        full_id if isinstance(full_id, str) and _ID.fullmatch(full_id) else container_id,
        running=state.get("Running") is True or (isinstance(status, str) and status in _RUNNING),
        lease=read_label(labels),
        devices=given.devices,
        how=given.how or "its devices",
    )


def created_container(name: str | None, body: Mapping[str, object]) -> Container:
    """The ``Container`` a create body (``POST /containers/create``: ``Labels`` and ``Env``
    at its top, ``HostConfig`` as inspect shows it) would make, before the engine makes it:
    not running, named ``name`` (``new`` when it has none the table takes, or one that looks
    like another container's full id), its lease label and GPU devices read as
    ``container_of`` reads an inspect answer's."""
    inspect = {
        "Config": {"Labels": body.get("Labels"), "Env": body.get("Env")},
        "HostConfig": body.get("HostConfig"),
    }
    if name is None or not _NAME.fullmatch(name) or _ID.fullmatch(name):
        name = "new"
    return container_of(name, inspect)


async def inspect_container(
    engine: EngineClient,
    container_id: str,
    *,
    visible_devices_env: bool | None = None,
    timeout_s: float | None = None,
) -> Container | None:
    """The container ``container_id`` (an id or a name) of ``engine``; None when the engine
    has no such container (any more). ``EngineError`` (``BadAnswer``) as the client raises,
    within ``timeout_s`` (else the client's); ``ValueError`` for what is no container id or
    name."""
    if not _NAME.fullmatch(container_id):
        raise ValueError(f"not a container id: {container_id[:80]!r}")
    about = f"about container {container_id[:12]}"
    path = f"/containers/{quote(container_id, safe='')}/json"
    body = await engine.get(path, about, timeout_s=timeout_s)
    if body is None:
        return None
    answer = parse_answer(body, engine.bad_answer(about))
    if not isinstance(answer, dict):
        raise BadAnswer(f"{engine.bad_answer(about)}: it is not a JSON object (a container)")
    return container_of(container_id, answer, visible_devices_env=visible_devices_env)


async def listed_container(
    engine: EngineClient, container_id: str, *, timeout_s: float | None = None
) -> Container | None:
    """The container ``container_id`` as ``engine``'s list tells it (``EngineClient.
    list_entry``: dockerd's list does not wait for a container that is starting, as an
    inspect does): its id, whether it runs and its lease label, not its devices (the list
    has none); None when the list has no such container. Raises as the client does."""
    about = f"about container {container_id[:12]} (its list)"
    item = await engine.list_entry(container_id, about, timeout_s=timeout_s)
    if item is None:
        return None
    as_inspected = {
        "Id": item.get("Id"),
        "State": {"Status": item.get("State")},
        "Config": {"Labels": item.get("Labels")},
    }
    return container_of(container_id, as_inspected)


async def list_containers(
    engine: EngineClient,
    *,
    max_containers: int = MAX_CONTAINERS,
    timeout_s: float = LIST_TIMEOUT_S,
    visible_devices_env: bool | None = None,
) -> list[Container]:
    """Every container of ``engine``, running or not, in the engine's order, each inspected.

    Within ``timeout_s`` in all, else ``EngineError``; ``BadAnswer`` when an answer breaks
    a bound or the engine has more than ``max_containers`` containers (a list is never
    cut: the table would end the leases of the containers left out)."""
    try:
        async with asyncio.timeout(timeout_s):
            ids = await _listed_ids(engine, max_containers, timeout_s)
            found = await _inspect_all(engine, ids, visible_devices_env)
    except TimeoutError:
        raise EngineError(
            f"{engine.where} did not list its containers within {timeout_s:g} s"
        ) from None
    return [container for container in found if container is not None]


async def _inspect_all(
    engine: EngineClient, ids: list[str], visible_devices_env: bool | None
) -> list[Container | None]:
    """Each container inspected, ``INSPECTS_AT_ONCE`` at a time; the first failure ends
    them all (the others are cancelled) and is raised.

    An inspect that times out is asked of the list instead (``listed_container``): dockerd
    holds a container that is starting (or stopping) and its inspect waits, while its list
    answers. A container the list shows not running is taken from it: of a container that
    does not run a resync reads its id, state and lease label, which the list has (its
    devices count when it runs, and its start event, which follows, is inspected). One the
    list shows running fails the list with the inspect's timeout: its devices may make it a
    holder. So does a list that times out too (Podman's waits as its inspect does)."""
    slots = asyncio.Semaphore(INSPECTS_AT_ONCE)

    async def inspect(container_id: str) -> Container | None:
        async with slots:
            try:
                return await inspect_container(
                    engine, container_id, visible_devices_env=visible_devices_env
                )
            except EngineTimeout:
                listed = await listed_container(engine, container_id)
                if listed is not None and listed.running:
                    raise
                return listed

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(inspect(container_id)) for container_id in ids]
    except ExceptionGroup as failed:
        first = next((e for e in failed.exceptions if isinstance(e, EngineError)), None)
        if first is None:
            raise
        raise first from None
    return [task.result() for task in tasks]


async def _listed_ids(engine: EngineClient, max_containers: int, timeout_s: float) -> list[str]:
    bad = engine.bad_answer(_LIST_ABOUT)
    body = await engine.get(_LIST_PATH, _LIST_ABOUT, timeout_s=timeout_s, max_bytes=MAX_LIST_BYTES)
    if body is None:
        raise EngineError(f"{engine.where} answered HTTP 404 {_LIST_ABOUT}")
    listed = parse_answer(body, bad, max_items=MAX_LIST_ITEMS, object_pairs_hook=_ids_only)
    del body
    if not isinstance(listed, list):
        raise BadAnswer(f"{bad}: it is not a JSON array (of containers)")
    ids: dict[str, None] = {}
    for entry in listed:
        container_id = entry.get("Id") if isinstance(entry, dict) else None
        if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
            raise BadAnswer(f"{bad}: one of its containers has no 64-hex Id")
        ids[container_id] = None
        if len(ids) > max_containers:
            raise BadAnswer(f"{bad}: it lists more than {max_containers} containers")
    return list(ids)


def _ids_only(pairs: list[tuple[str, Any]]) -> object:
    """An object of the list as the parser builds it: only its ``Id``, if it has one (so
    that labels, mounts and networks cost no memory)."""
    found = None
    for key, value in pairs:
        if key == "Id":
            found = value
    return None if found is None else {"Id": found}


def _object(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _array(value: object) -> list[object]:
    return value if isinstance(value, list) else []
