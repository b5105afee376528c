"""The lease service: the table's one owner in the event loop, its waiting asks, its timer
and its state file (<state dir>/leases.json), on nodes of tests.unit.leases.nodes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.gpu.model import NodeInfo
from agent.leases.answers import Granted, Hold, Refusal, Refused, Released
from agent.leases.asks import Ask, InvalidAsk
from agent.leases.containers import Container
from agent.leases.holders import LeaseState
from agent.leases.settings import LeaseSettings
from agent.leases.view import UnitState
from agent.leasing.service import MAX_STATE_BYTES, STATE_MODE, STATE_NAME, LeaseService
from tests.support.fake_engine import eventually
from tests.unit.leases.nodes import build_node, cid, healthy, leased_container, sick, uuid

LOGGER = "nvidia-docker-plugin.leases"
TWO_GPUS = build_node([0, 0])

Open = Callable[..., LeaseService]


@pytest.fixture
async def open_service(tmp_path: Path) -> AsyncIterator[Open]:
    """``open_service(node=TWO_GPUS, settings=LeaseSettings(), state_dir=tmp_path/"state")``:
    a service opened as the agent opens it (``numbered_above``: the usage ledger's highest lease
    number); every one is closed after the test."""
    opened: list[LeaseService] = []
    default_dir = tmp_path / "state"
    default_dir.mkdir(mode=0o700)

    def make(
        node: NodeInfo = TWO_GPUS,
        settings: LeaseSettings | None = None,
        state_dir: Path | None = default_dir,
        numbered_above: int = 0,
    ) -> LeaseService:
        service = LeaseService.open(
            node,
            healthy(node),
            settings or LeaseSettings(),
            state_dir,
            numbered_above=numbered_above,
        )
        opened.append(service)
        return service

    yield make
    for service in opened:
        await service.close()


def grant_of(answer: object) -> Granted:
    assert isinstance(answer, Granted), answer
    return answer


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 40]


# -- asks, the queue and releases -------------------------------------------------------------


async def test_an_ask_is_granted_a_pending_lease(open_service: Open) -> None:
    service = open_service()
    grant = grant_of(await service.ask(Ask(count=1, owner=(("user", "alice"),))))
    assert grant.lease.id == "lease-1"
    assert grant.lease.state is LeaseState.PENDING
    assert grant.dev == uuid(0)
    assert service.lease("lease-1") == grant.lease
    assert grant.lease.until_s is not None
    assert grant.lease.until_s == pytest.approx(grant.lease.since_s + 60)
    view = service.view()
    assert [u.state for u in view.units] == [UnitState.PENDING, UnitState.FREE]
    assert view.unit("0").holders[0].why == "user=alice"


async def test_an_invalid_ask_raises_and_changes_nothing(open_service: Open) -> None:
    service = open_service()
    with pytest.raises(InvalidAsk) as invalid:
        await service.ask(Ask(count=0))
    assert invalid.value.field == "count"
    assert service.view().leases == ()


async def test_a_waiting_ask_is_answered_when_a_release_frees_the_gpu(open_service: Open) -> None:
    service = open_service()
    both = grant_of(await service.ask(Ask(count=2)))
    waiter = asyncio.create_task(service.ask(Ask(count=1, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the ask waits")
    assert not waiter.done()
    released = service.release(both.lease.id)
    assert isinstance(released, Released)
    grant = grant_of(await asyncio.wait_for(waiter, 10))
    assert grant.lease.id == "lease-2"
    assert service.view().waiting == ()
    assert service.lease("lease-1") is None


async def test_a_waiting_ask_times_out_with_a_refusal(open_service: Open) -> None:
    """The 408 of the REST API: the ask waited as long as it asked and is told so (the QUEUED
    change once dropped the waiting future, and such an ask was never answered)."""
    service = open_service()
    await service.ask(Ask(count=2))
    loop = asyncio.get_running_loop()
    asked_at = loop.time()
    answer = await asyncio.wait_for(service.ask(Ask(count=1, wait_s=0.2)), 10)
    assert isinstance(answer, Refused), answer
    assert answer.kind is Refusal.TIMED_OUT
    assert "waited" in answer.text
    assert loop.time() - asked_at >= 0.15  # it did wait, not refused at once
    assert service.view().waiting == ()
    assert [t.lease_id for t in answer.taken] == ["lease-1", "lease-1"]


async def test_an_ask_not_asked_to_wait_is_refused_at_once(open_service: Open) -> None:
    service = open_service()
    await service.ask(Ask(count=2))
    answer = await asyncio.wait_for(service.ask(Ask(count=1)), 1)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.NOT_ENOUGH
    assert {t.hold for t in answer.taken} == {Hold.PENDING}


async def test_a_cancelled_waiter_leaves_the_queue(open_service: Open) -> None:
    service = open_service()
    both = grant_of(await service.ask(Ask(count=2)))
    waiter = asyncio.create_task(service.ask(Ask(count=1, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the ask waits")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert service.view().waiting == ()
    # Nothing was granted to the asker that left: the freed GPUs go to the next ask at once.
    service.release(both.lease.id)
    assert [lease.id for lease in service.view().leases] == []
    assert grant_of(await service.ask(Ask(count=2))).lease.id == "lease-2"


async def test_waiting_asks_are_served_first_come_first_served(open_service: Open) -> None:
    service = open_service()
    first = grant_of(await service.ask(Ask(count=1)))
    second = grant_of(await service.ask(Ask(count=1)))
    wants_two = asyncio.create_task(service.ask(Ask(count=2, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the first waits")
    wants_one = asyncio.create_task(service.ask(Ask(count=1, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 2, "the second waits")
    service.release(first.lease.id)  # one free GPU: not enough for the head of the line
    await asyncio.sleep(0.05)
    assert not wants_one.done()  # it does not overtake the ask for two
    service.release(second.lease.id)
    assert len(grant_of(await asyncio.wait_for(wants_two, 10)).units) == 2
    assert not wants_one.done()
    wants_one.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wants_one


async def test_close_cancels_the_asks_that_wait(open_service: Open) -> None:
    service = open_service()
    await service.ask(Ask(count=2))
    waiter = asyncio.create_task(service.ask(Ask(count=1, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the ask waits")
    await service.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 5)


async def test_nothing_happens_after_close(open_service: Open, tmp_path: Path) -> None:
    service = open_service(settings=LeaseSettings(pending_s=0.3))
    await service.ask(Ask(count=2))
    waiter = asyncio.create_task(service.ask(Ask(count=1, wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the ask waits")
    await service.settled()
    saves = service.saves
    await service.close()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0.6)  # past the pending lease's expiry
    assert service.lease("lease-1") is not None  # no timer after close: nothing expired
    assert service.saves == saves


# -- engine events, health ----------------------------------------------------------------------


async def test_container_events_bind_and_free_a_lease(open_service: Open) -> None:
    service = open_service()
    grant = grant_of(await service.ask(Ask(count=1)))
    container = leased_container(1, grant.lease)
    service.created(container)
    lease = service.lease(grant.lease.id)
    assert lease is not None
    assert (lease.state, lease.container_id) == (LeaseState.STOPPED, cid(1))
    service.started(leased_container(1, grant.lease, running=True))
    lease = service.lease(grant.lease.id)
    assert lease is not None
    assert (lease.state, lease.until_s) == (LeaseState.RUNNING, None)
    refused = service.release(grant.lease.id)
    assert isinstance(refused, Refused)
    assert refused.kind is Refusal.IN_USE
    service.died(cid(1))
    lease = service.lease(grant.lease.id)
    assert lease is not None
    assert lease.state is LeaseState.STOPPED
    service.destroyed(cid(1))
    assert service.lease(grant.lease.id) is None
    assert service.view().unit("0").state is UnitState.FREE


async def test_a_resync_rebuilds_a_lease_from_its_container(open_service: Open) -> None:
    service = open_service()
    grant = grant_of(await service.ask(Ask(count=1)))
    service.resync("", [leased_container(1, grant.lease, running=True)])
    lease = service.lease(grant.lease.id)
    assert lease is not None
    assert (lease.state, lease.container_id) == (LeaseState.RUNNING, cid(1))
    service.resync("", [])  # the container is gone
    assert service.lease(grant.lease.id) is None


async def test_a_gpu_that_turns_unhealthy_revokes_its_pending_lease(open_service: Open) -> None:
    service = open_service()
    grant = grant_of(await service.ask(Ask(devices="1")))
    service.set_health([healthy(TWO_GPUS)[0], sick()])
    assert service.lease(grant.lease.id) is None
    refused = await service.ask(Ask(devices="1"))
    assert isinstance(refused, Refused)
    assert refused.kind is Refusal.UNHEALTHY
    assert grant_of(await service.ask(Ask(count=1))).dev == uuid(0)


async def test_a_waiting_ask_for_a_gpu_that_left_the_node_is_dropped(open_service: Open) -> None:
    service = open_service()
    await service.ask(Ask(devices="1"))
    waiter = asyncio.create_task(service.ask(Ask(devices="1", wait_s=30)))
    await eventually(lambda: len(service.view().waiting) == 1, "the ask waits")
    one_gpu = build_node([0])
    service.set_node(one_gpu, healthy(one_gpu))
    answer = await asyncio.wait_for(waiter, 5)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.GONE


# -- the timer --------------------------------------------------------------------------------


async def test_a_pending_lease_expires_by_itself(
    open_service: Open, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    service = open_service(settings=LeaseSettings(pending_s=0.1))
    grant = grant_of(await service.ask(Ask(count=2)))
    await eventually(lambda: service.lease(grant.lease.id) is None, "the lease expires")
    assert all(u.state is UnitState.FREE for u in service.view().units)
    expired = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert len(expired) == 1
    assert expired[0].startswith("lease-1 expired")
    await service.settled()
    assert service.state_file is not None
    assert json.loads(service.state_file.read_text())["leases"] == []


async def test_an_expiry_serves_the_queue(open_service: Open) -> None:
    service = open_service(settings=LeaseSettings(pending_s=0.1))
    await service.ask(Ask(count=2))
    answer = await asyncio.wait_for(service.ask(Ask(count=2, wait_s=30)), 10)
    assert grant_of(answer).lease.id == "lease-2"


async def test_a_bound_lease_does_not_expire(open_service: Open) -> None:
    service = open_service(settings=LeaseSettings(pending_s=0.1, grace_s=30))
    grant = grant_of(await service.ask(Ask(count=1)))
    service.created(leased_container(1, grant.lease))
    await asyncio.sleep(0.3)
    lease = service.lease(grant.lease.id)
    assert lease is not None
    assert lease.state is LeaseState.STOPPED


# -- the state file ------------------------------------------------------------------------------


async def test_the_state_file_is_written_0600_after_a_change(open_service: Open) -> None:
    service = open_service()
    assert service.state_file is not None
    assert not service.state_file.exists()  # nothing changed yet: nothing written
    grant = grant_of(await service.ask(Ask(count=2, owner=(("job", "1234"),))))
    await service.settled()
    mode = service.state_file.stat().st_mode
    assert stat.S_IMODE(mode) == STATE_MODE == 0o600
    saved = json.loads(service.state_file.read_text())
    assert [lease["id"] for lease in saved["leases"]] == [grant.lease.id]
    assert saved["leases"][0]["owner"] == {"job": "1234"}


async def test_open_restores_the_leases_with_their_ids(open_service: Open) -> None:
    first = open_service()
    a = grant_of(await first.ask(Ask(count=1, owner=(("user", "alice"),))))
    b = grant_of(await first.ask(Ask(count=1)))
    first.created(leased_container(1, b.lease))
    await first.settled()
    await first.close()

    again = open_service()
    assert [lease.id for lease in again.view().leases] == [a.lease.id, b.lease.id]
    restored_a = again.lease(a.lease.id)
    assert restored_a is not None
    assert restored_a.units == a.lease.units
    assert restored_a.owner == (("user", "alice"),)
    restored_b = again.lease(b.lease.id)
    assert restored_b is not None
    assert (restored_b.state, restored_b.container_id) == (LeaseState.STOPPED, cid(1))
    assert "2 lease(s)" in again.describe()
    # A lease id is never given twice: the next is lease-3, not a restored one's.
    again.release(a.lease.id)
    assert grant_of(await again.ask(Ask(count=1))).lease.id == "lease-3"


async def test_new_leases_are_numbered_above_the_ledgers_and_the_state_files(
    open_service: Open,
) -> None:
    # No state file (deleted, or none kept): the ledger's lease-41 is not given again.
    fresh = open_service(state_dir=None, numbered_above=41)
    assert grant_of(await fresh.ask(Ask(count=1))).lease.id == "lease-42"
    first = open_service()
    for _ in range(3):
        first.release(grant_of(await first.ask(Ask(count=1))).lease.id)
    await first.close()  # its state file says lease-4 is next, above the ledger's lease-2
    again = open_service(numbered_above=2)
    assert grant_of(await again.ask(Ask(count=1))).lease.id == "lease-4"


async def test_the_state_is_written_atomically(open_service: Open) -> None:
    service = open_service()
    assert service.state_file is not None
    leases = [grant_of(await service.ask(Ask(count=1))) for _ in range(2)]
    for grant in leases:
        service.release(grant.lease.id)
    await service.settled()
    for _ in range(20):  # changes faster than the writes: folded, never a half file
        grant = grant_of(await service.ask(Ask(count=1)))
        service.release(grant.lease.id)
        json.loads(service.state_file.read_text())
        await asyncio.sleep(0)
    await service.settled()
    assert sorted(os.listdir(service.state_file.parent)) == [STATE_NAME]  # no temporary left
    assert json.loads(service.state_file.read_text())["leases"] == []
    assert 1 <= service.saves <= 44


async def test_without_a_state_dir_nothing_is_written(open_service: Open, tmp_path: Path) -> None:
    service = open_service(state_dir=None)
    assert service.state_file is None
    grant_of(await service.ask(Ask(count=1)))
    await service.settled()
    assert service.saves == 0


async def test_a_state_file_that_cannot_be_written_is_one_line(
    open_service: Open, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    service = open_service(state_dir=not_a_dir)
    grant_of(await service.ask(Ask(count=1)))
    await service.settled()
    (line,) = errors(caplog)
    assert str(not_a_dir / STATE_NAME) in line
    assert "not written" in line
    assert grant_of(await service.ask(Ask(count=1))).lease.id == "lease-2"  # it goes on


def _valid_snapshot() -> bytes:
    """A stopped container's lease, saved a moment ago (its grace time not over)."""
    now = time.time()
    return json.dumps(
        {
            "schema": "nvidia-docker-leases/1",
            "saved_s": now,
            "next_lease": 2,
            "leases": [
                {
                    "id": "lease-1",
                    "units": [uuid(0)],
                    "names": ["0"],
                    "exclusive": True,
                    "owner": {},
                    "asked": "1 GPU",
                    "since_s": now - 10,
                    "state": "stopped",
                    "container_id": cid(1),
                    "until_s": now + 600,
                }
            ],
            "foreign": [],
        }
    ).encode()


def _write_garbage(path: Path) -> None:
    path.write_bytes(b"\x00\xff{not json")


def _write_wrong_schema(path: Path) -> None:
    path.write_text('{"schema": "nvidia-docker-leases/9", "leases": []}')


def _write_too_big(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(MAX_STATE_BYTES + 1)


def _write_too_deep(path: Path) -> None:
    path.write_text("[" * 200_000 + "]" * 200_000)


def _write_list(path: Path) -> None:
    path.write_text("[]")


def _write_link(path: Path) -> None:
    target = path.parent / "elsewhere.json"
    target.write_bytes(_valid_snapshot())
    path.symlink_to(target)


def _write_directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    ("write", "why"),
    [
        (_write_garbage, "not JSON"),
        (_write_wrong_schema, "schema"),
        (_write_too_big, "more than"),
        (_write_too_deep, "not JSON"),
        (_write_list, "not"),
        (_write_link, "symbolic link"),
        (_write_directory, "directory"),
    ],
    ids=["not-json", "wrong-schema", "oversized", "too-deep", "not-an-object", "link", "dir"],
)
async def test_an_unusable_state_file_is_one_line_and_an_empty_table(
    open_service: Open,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    write: Callable[[Path], None],
    why: str,
) -> None:
    state_dir = tmp_path / "state"
    path = state_dir / STATE_NAME
    write(path)
    service = open_service()
    (line,) = errors(caplog)
    assert str(path) in line
    assert why in line
    assert service.view().leases == ()
    assert grant_of(await service.ask(Ask(count=1))).lease.id == "lease-1"  # the agent goes on


async def test_a_valid_state_file_is_read(open_service: Open, tmp_path: Path) -> None:
    """The snapshot the unusable-file cases link to is itself a good one."""
    (tmp_path / "state" / STATE_NAME).write_bytes(_valid_snapshot())
    service = open_service()
    lease = service.lease("lease-1")
    assert lease is not None
    assert lease.container_id == cid(1)


async def test_an_older_agents_state_file_is_read_its_engines_unknown_till_listed(
    open_service: Open, tmp_path: Path
) -> None:
    """A state file of an agent before engines (no ``engine`` fields): a running container's
    lease, and a foreign container's hold. Docker's list lacks both: they are kept for the
    grace time; Podman's list has them: they are Podman's, and the file says so."""
    now = time.time()
    older = {
        "schema": "nvidia-docker-leases/1",
        "saved_s": now,
        "next_lease": 2,
        "leases": [
            {
                "id": "lease-1",
                "units": [uuid(0)],
                "names": ["0"],
                "exclusive": True,
                "owner": {},
                "asked": "1 GPU",
                "since_s": now - 10,
                "state": "running",
                "container_id": cid(1),
                "until_s": None,
            }
        ],
        "foreign": [
            {
                "holder": cid(2),
                "source": "container",
                "units": [uuid(1)],
                "how": "--device /dev/nvidia1",
                "since_s": now - 10,
                "container": True,
            }
        ],
    }
    state_file = tmp_path / "state" / STATE_NAME
    state_file.write_text(json.dumps(older))
    service = open_service()
    lease = service.lease("lease-1")
    assert lease is not None
    assert (lease.state, lease.engine, lease.until_s) == (LeaseState.RUNNING, None, None)

    service.resync("/run/docker.sock", [])
    lease = service.lease("lease-1")
    assert lease is not None
    assert lease.until_s == pytest.approx(time.time() + 600, abs=5)  # kept, for a while
    assert [u.state for u in service.view().units] == [UnitState.LEASED, UnitState.FOREIGN]
    await service.settled()
    saved = json.loads(state_file.read_text())
    assert saved["leases"][0]["engine"] is None
    assert saved["leases"][0]["until_s"] == lease.until_s
    assert saved["foreign"][0]["until_s"] is not None

    podman = "/run/podman/podman.sock"
    foreign = Container(cid(2), True, devices=("1",), how="--device /dev/nvidia1", engine=podman)
    service.resync(podman, [leased_container(1, lease, running=True, engine=podman), foreign])
    await service.settled()
    saved = json.loads(state_file.read_text())
    assert [(x["engine"], x["until_s"]) for x in saved["leases"]] == [(podman, None)]
    assert [(h["engine"], h["until_s"]) for h in saved["foreign"]] == [(podman, None)]
    service.resync("/run/docker.sock", [])  # Docker's lists end them no more
    assert [u.state for u in service.view().units] == [UnitState.LEASED, UnitState.FOREIGN]


async def test_a_dangling_link_as_state_file_is_one_line(
    open_service: Open, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state" / STATE_NAME
    path.symlink_to(tmp_path / "nowhere.json")
    service = open_service()
    (line,) = errors(caplog)
    assert str(path) in line
    assert service.view().leases == ()


# -- describe -------------------------------------------------------------------------------


async def test_describe_says_units_sharing_and_timings(open_service: Open) -> None:
    service = open_service()
    assert service.describe() == (
        "2 GPUs (2 leasable devices), 1 shared lease(s) per GPU, pending 60 s, grace 600 s, "
        "0 lease(s) and 0 foreign holder(s) now"
    )
    await service.ask(Ask(count=1))
    assert service.describe().endswith("1 lease(s) and 0 foreign holder(s) now")


async def test_describe_counts_mig_devices_as_leasable(open_service: Open) -> None:
    node = build_node([0, 1], migs={1: ["1g.18gb", "1g.18gb", "2g.35gb"]})
    service = open_service(
        node=node, settings=LeaseSettings(pending_s=30, grace_s=120.5, sharing=4)
    )
    assert service.describe() == (
        "2 GPUs (4 leasable devices), 4 shared lease(s) per GPU, pending 30 s, "
        "grace 120.5 s, 0 lease(s) and 0 foreign holder(s) now"
    )
