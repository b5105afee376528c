"""A node's agent as ``nvidia-docker`` sees it, with GPU leases: a stand-in that speaks the
contract of docs/leases.md ("The REST API") and the routes the wrapper reads, for the
wrapper's unit tests (tests/unit/controller/test_wrapper_leases.py) and its benchmark
(tests/benchmarks/bench_wrapper.py) until the agent serves leases itself.

The node has four GPUs: GPUs 0 and 1 on NUMA node 0 (CPUs 0-7), GPU 2 on NUMA node 1 (CPUs
8-15), and GPU 3, on NUMA node 1, in MIG mode with two ``1g.18gb`` MIG devices (``3:0``,
``3:1``). Routes:

- ``GET /gpu/info/json``, ``GET /gpu/health/json`` (``unhealthy`` marks GPUs);
- ``GET /docker/cli`` (``dev``, ``vol``; ``format=cdi``), as the agent answers it, and 400
  with ``X-Invalid-Parameter``/``X-Invalid-Value`` for an unknown device; ``cli_status``
  makes it fail instead (a step after the grant that fails);
- ``POST /leases``, ``GET /leases/json``, ``DELETE /leases/{id}``: a small lease table
  (exclusive or shared leases of units; an ask that may wait is held open until it can be
  served or its ``wait_s`` ends: 408). The refusal lines are the agent's
  (docs/leases.md, "Refusals"), with the holders in the way. ``leases_route=False`` is an
  agent older than leases (404). ``forgetful``: grants hold nothing (the benchmark asks
  thousands of times).

Every request is recorded (``requests``, ``asks``, ``queries``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from aiohttp import web

from agent.api.engines import boot_id
from tests.support.services import free_port

SINCE = "2026-12-01T10:00:00Z"
DRIVER = "580.159.04"
CPUS = {0: "0-7", 1: "8-15"}
WAITABLE = ("not_enough", "taken", "others_waiting")


@dataclass(frozen=True)
class Unit:
    """A GPU not in MIG mode, or a MIG device."""

    key: str  # its UUID
    name: str  # "0", "3:0": a dev entry
    gpu: int
    mig: int | None
    profile: str | None
    numa: int
    files: tuple[str, ...]  # its device files, for the volume form

    @property
    def label(self) -> str:
        return f"GPU {self.name}" if self.mig is None else f"MIG {self.name}"


def _uuid(gpu: int, mig: int | None = None) -> str:
    if mig is None:
        return f"GPU-{gpu:x}{gpu:x}{gpu:x}{gpu:x}0000-1111-2222-3333-44445555666{gpu}"
    return f"MIG-{gpu:x}{mig:x}{gpu:x}{mig:x}0000-aaaa-bbbb-cccc-dddd{gpu}{mig}"


GPU_UUIDS = tuple(_uuid(i) for i in range(4))
UNITS = (
    Unit(GPU_UUIDS[0], "0", 0, None, None, 0, ("/dev/nvidia0",)),
    Unit(GPU_UUIDS[1], "1", 1, None, None, 0, ("/dev/nvidia1",)),
    Unit(GPU_UUIDS[2], "2", 2, None, None, 1, ("/dev/nvidia2",)),
    Unit(_uuid(3, 0), "3:0", 3, 0, "1g.18gb", 1, ("/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap21")),
    Unit(_uuid(3, 1), "3:1", 3, 1, "1g.18gb", 1, ("/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap30")),
)
MIG_GPUS = frozenset({3})


@dataclass
class Holder:
    lease: str
    exclusive: bool
    container: str | None = None  # bound to a container; None: pending
    foreign: str | None = None  # how a foreign container got it ("--device /dev/nvidia1")


class Invalid(Exception):
    def __init__(self, field: str, text: str) -> None:
        super().__init__(text)
        self.field = field


@dataclass
class Refused(Exception):
    kind: str
    line: str
    taken: list[dict[str, Any]]


@dataclass
class LeaseAgent:
    leases_route: bool = True
    forgetful: bool = False
    sharing: int = 1
    unhealthy: dict[int, str] = field(default_factory=dict)  # GPU index -> reason
    cli_status: int | None = None
    denied: str | None = None  # an agent kept out of an engine's socket: asks get 503
    requests: list[str] = field(default_factory=list)  # "POST /leases"
    asks: list[dict[str, Any]] = field(default_factory=list)
    queries: list[dict[str, str]] = field(default_factory=list)  # /docker/cli
    released: list[str] = field(default_factory=list)
    holders: dict[str, list[Holder]] = field(default_factory=dict)  # unit key -> holders
    next_lease: int = 1
    waits: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # GET /engines/json's rows (agent.api.engines): the engines the agent says it follows
    engines: list[dict[str, Any]] = field(default_factory=list)
    # and the boot id it says (None: this machine's; another: an agent of another machine)
    boot: str | None = None

    # --- the table -------------------------------------------------------------------------

    def hold(self, *names: str, container: str = "3f2a1b9c0d4e", foreign: str | None = None) -> str:
        """Units (dev entries) held by a container: its lease, or a foreign holder."""
        lease = "" if foreign else self._new_id()
        for unit in self._resolve(" ".join(names)):
            self.holders.setdefault(unit.key, []).append(
                Holder(lease, True, container=container, foreign=foreign)
            )
        return lease

    def _new_id(self) -> str:
        lease = f"lease-{self.next_lease}"
        self.next_lease += 1
        return lease

    def _resolve(self, devices: str) -> list[Unit]:
        chosen: list[Unit] = []
        for entry in devices.replace(",", " ").split():
            found = [
                u
                for u in UNITS
                if entry == u.name
                or (entry.isdigit() and int(entry) == u.gpu)
                or (entry.startswith(("GPU-", "MIG-")) and u.key.startswith(entry))
                or (entry.startswith("GPU-") and GPU_UUIDS[u.gpu].startswith(entry))
            ]
            if not found:
                raise Invalid("devices", f"invalid ask: invalid device: {entry}")
            chosen += [u for u in found if u not in chosen]
        return chosen

    def _free_for(self, unit: Unit, exclusive: bool) -> bool:
        if unit.gpu in self.unhealthy:
            return False
        held = self.holders.get(unit.key, [])
        if exclusive:
            return not held
        return all(not h.exclusive for h in held) and len(held) < self.sharing

    def _taken(self, units: list[Unit]) -> tuple[str, list[dict[str, Any]]]:
        """``GPU 0, GPU 1 by container 3f2a1b9c0d4e (lease-1) since …Z; GPU 4 pending for
        lease-2 since …Z, until …Z``, one entry per holder, and the Taken list."""
        by: dict[tuple[str, str | None, str | None], list[Unit]] = {}
        taken: list[dict[str, Any]] = []
        for unit in units:
            for holder in self.holders.get(unit.key, []):
                by.setdefault((holder.lease, holder.container, holder.foreign), []).append(unit)
                taken.append(
                    {
                        "Unit": unit.label,
                        "Lease": holder.lease or None,
                        "Container": holder.container,
                        "Since": SINCE,
                        "Until": None,
                    }
                )
        parts = []
        for (lease, container, foreign), held in by.items():
            names = ", ".join(u.label for u in held)
            if foreign:
                parts.append(f"{names} by foreign container {container} ({foreign}) since {SINCE}")
            elif container:
                parts.append(f"{names} by container {container} ({lease}) since {SINCE}")
            else:
                parts.append(f"{names} pending for {lease} since {SINCE}, until {_expires()}")
        for unit in units:
            if unit.gpu in self.unhealthy:
                parts.append(f"{unit.label} unhealthy since {SINCE}: {self.unhealthy[unit.gpu]}")
        return "; ".join(parts), taken

    def _pick(self, body: dict[str, Any]) -> list[Unit]:
        """The units an ask gets now; ``Invalid`` or ``Refused``."""
        exclusive = body.get("exclusive", True) is not False
        devices, profile = body.get("devices"), body.get("mig_profile")
        if devices is not None and profile is not None:
            raise Invalid("devices", "invalid ask: name devices or a MIG profile, not both")
        if devices is not None:
            units = self._resolve(str(devices))
            sick = [u for u in units if u.gpu in self.unhealthy]
            if sick:
                line, taken = self._taken(sick)
                raise Refused("unhealthy", f"unhealthy device: {line}; choose another GPU", taken)
            busy = [u for u in units if not self._free_for(u, exclusive)]
            if busy:
                line, taken = self._taken(busy)
                raise Refused(
                    "taken",
                    f"devices taken: {line}; ask for other devices, for a count, or ask to wait",
                    taken,
                )
            return units
        count = body.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= 64:
            raise Invalid("count", f"invalid ask: count must be 1 to 64: {count}")
        if profile is not None:
            pool = [u for u in UNITS if u.profile == profile]
            what = f"MIG {profile}"
            if len(pool) < count:
                raise Refused(
                    "impossible",
                    f"asked for {what} x{count}: this node has {len(pool)} MIG devices of that "
                    "profile (its profiles: 1g.18gb)",
                    [],
                )
        else:
            pool = [u for u in UNITS if u.mig is None]
            what = f"{count} GPU" + ("s" if count != 1 else "")
            if len(pool) < count:
                raise Refused(
                    "impossible",
                    f"asked for {what}: this node has {len(pool)} GPUs to lease (in MIG mode: "
                    "GPU 3; ask for a MIG profile: 1g.18gb)",
                    [],
                )
        free = [u for u in pool if self._free_for(u, exclusive)]
        if len(free) < count:
            line, taken = self._taken([u for u in pool if u not in free])
            names = ", ".join(u.label for u in free)
            raise Refused(
                "not_enough",
                f"not enough free GPUs: asked for {count}, {len(free)} free ({names or 'none'}); "
                f"taken: {line}; ask for fewer, or ask to wait",
                taken,
            )
        return free[:count]

    def _grant(self, body: dict[str, Any], units: list[Unit]) -> dict[str, Any]:
        exclusive = body.get("exclusive", True) is not False
        lease = self._new_id()
        if not self.forgetful:
            for unit in units:
                self.holders.setdefault(unit.key, []).append(Holder(lease, exclusive))
        nodes = sorted({u.numa for u in units})
        cpuset = body.get("cpuset", True) is not False
        owner = body.get("owner") or {}
        labels = {
            "nvidia-docker.lease": lease,
            "nvidia-docker.lease.devices": ",".join(u.key for u in units),
            "nvidia-docker.lease.mode": "exclusive" if exclusive else "shared",
            "nvidia-docker.lease.owner": json.dumps(owner, separators=(",", ":")),
        }
        plural = "s" if len(units) != 1 else ""
        text = (
            f"granted {lease} ({len(units)} GPU{plural}): {', '.join(u.label for u in units)}; "
            f"NUMA node {', '.join(map(str, nodes))}; create its container with its labels "
            "within 60 s"
        )
        return {
            "Lease": lease,
            "State": "pending",
            "Dev": " ".join(u.key for u in units),
            "Devices": [
                {
                    "Name": u.name,
                    "UUID": u.key,
                    "GPU": u.gpu,
                    "MIG": u.mig,
                    "Profile": u.profile,
                    "Path": u.files[0],
                    "Sharing": 1 if exclusive else self.sharing,
                    "Sharers": len(self.holders.get(u.key, [])) or 1,
                }
                for u in units
            ],
            "NumaNodes": nodes if cpuset else None,
            "CpusetCpus": ",".join(CPUS[n] for n in nodes) if cpuset else None,
            "CpusetMems": ",".join(map(str, nodes)) if cpuset else None,
            "Labels": labels,
            "Expires": _expires(),
            "Text": text,
        }

    # --- the routes ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/gpu/info/json", self._info)
        app.router.add_get("/gpu/health/json", self._health)
        app.router.add_get("/docker/cli", self._cli)
        app.router.add_get("/engines/json", self._engines)
        if self.leases_route:
            app.router.add_post("/leases", self._ask)
            app.router.add_get("/leases/json", self._list)
            app.router.add_delete("/leases/{id}", self._release)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        response: web.StreamResponse = await handler(request)
        return response

    def application(self) -> web.Application:
        app = self.app()
        app.middlewares.append(self._record)
        return app

    async def _info(self, _: web.Request) -> web.Response:
        devices = [
            {"UUID": uuid, "Path": f"/dev/nvidia{i}", "CPUAffinity": 0 if i < 2 else 1}
            for i, uuid in enumerate(GPU_UUIDS)
        ]
        return _json({"Version": {"Driver": DRIVER, "CUDA": "13.0"}, "Devices": devices})

    async def _engines(self, _: web.Request) -> web.Response:
        return _json({"BootId": self.boot or boot_id(), "Engines": self.engines})

    async def _health(self, _: web.Request) -> web.Response:
        entries = [
            {
                "UUID": uuid,
                "Healthy": i not in self.unhealthy,
                "Reason": self.unhealthy.get(i),
                "XID": None,
                "Since": SINCE if i in self.unhealthy else None,
            }
            for i, uuid in enumerate(GPU_UUIDS)
        ]
        return _json({"Devices": entries})

    async def _cli(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        self.queries.append(query)
        if self.cli_status is not None:
            return web.Response(status=self.cli_status, text="the agent broke\n")
        try:
            units = self._resolve(query.get("dev", "")) or list(UNITS)
        except Invalid:
            entry = query.get("dev", "")
            headers = {"X-Invalid-Parameter": "dev", "X-Invalid-Value": quote(entry, safe="")}
            return web.Response(status=400, text=f"invalid device: {entry}\n", headers=headers)
        if query.get("format") == "cdi":
            return web.Response(text=" ".join(f"--device=nvidia.com/gpu={u.key}" for u in units))
        files = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
        for unit in units:
            files += [f for f in unit.files if f not in files]
        args = [
            "--volume-driver=nvidia-docker",
            f"--volume=nvidia_driver_{DRIVER}:/usr/local/nvidia:ro",
            *(f"--device={f}" for f in files),
        ]
        return web.Response(text=" ".join(args) + "\n")

    async def _ask(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _json({"Error": "the body is not JSON", "Field": None}, 400)
        if not isinstance(body, dict):
            return _json({"Error": "the body is not a JSON object", "Field": None}, 400)
        self.asks.append(body)
        if self.denied is not None:
            return _refused(503, "no_engine_access", self.denied, [])
        wait_s = body.get("wait_s", 0)
        if not isinstance(wait_s, int | float) or not 0 <= wait_s <= 600:
            return _json({"Error": f"invalid ask: wait_s must be 0 to 600: {wait_s}"}, 400)
        deadline = time.monotonic() + wait_s
        ticket = None
        while True:
            try:
                units = self._pick(body)
            except Invalid as err:
                return _json({"Error": str(err), "Field": err.field}, 400)
            except Refused as err:
                left = deadline - time.monotonic()
                if err.kind not in WAITABLE or wait_s <= 0:
                    return _refused(409, err.kind, err.line, err.taken)
                if ticket is None:
                    self.waits += 1
                    ticket = f"wait-{self.waits}"
                if left <= 0:
                    what = body.get("devices") or f"{body.get('count', 1)} GPUs"
                    line = f"{ticket} waited {wait_s:g} s for {what} and got none: {err.line}"
                    return _refused(408, "timed_out", line, err.taken)
                self.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=left)
                continue
            return _json(self._grant(body, units), 201)

    async def _list(self, _: web.Request) -> web.Response:
        leases: dict[str, list[str]] = {}
        for key, holders in self.holders.items():
            for holder in holders:
                if holder.lease:
                    leases.setdefault(holder.lease, []).append(key)
        return _json({"Leases": [{"Lease": k, "Units": v} for k, v in leases.items()]})

    async def _release(self, request: web.Request) -> web.Response:
        lease = request.match_info["id"]
        self.released.append(lease)
        found = False
        for holders in self.holders.values():
            kept = [h for h in holders if h.lease != lease]
            found = found or len(kept) != len(holders)
            holders[:] = kept
        if not found:
            return _json({"Error": f"no lease {lease!r} on this node"}, 404)
        self.changed.set()
        return _json({"Released": lease})


def _expires() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(body) + "\n", content_type="application/json"
    )


def _refused(status: int, kind: str, line: str, taken: list[dict[str, Any]]) -> web.Response:
    return _json({"Error": line, "Refusal": kind, "Taken": taken}, status)


@contextlib.contextmanager
def served_in_thread(agent: LeaseAgent) -> Iterator[int]:
    """Serve ``agent`` on a free loopback port from a thread of its own (for a caller that
    has no event loop, like the benchmark); yields the port."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port = free_port()
    runner = web.AppRunner(agent.application())

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="lease-agent", daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
