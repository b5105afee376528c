"""Leases and holds belong to their container's engine: an engine's list (``resync``) ends
only what its own containers held. Docker's list after a restart keeps the leases of
Podman's containers while Podman is down, and Podman's list, when it comes, ends those of
its containers removed meanwhile. A lease of an unknown engine (an older agent's snapshot,
an engine no longer followed) is kept until an engine lists its container, or for the
grace time after a list that lacks it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.health.rule import utc_text
from agent.leases.answers import ChangeKind, Outcome, Refusal, Refused
from agent.leases.asks import Ask
from agent.leases.containers import Container
from agent.leases.holders import Lease, LeaseState
from agent.leases.snapshot import snapshot_from_json, snapshot_to_json
from agent.leases.table import LeaseTable
from agent.leases.view import UnitState

from .nodes import T0, build_node, cid, granted, healthy, leased_container

DOCKER, PODMAN = "/run/docker.sock", "/run/podman/podman.sock"
NODE = build_node([0, 0, 1, 1])
FOREIGN = Container(cid(5), True, devices=("/dev/nvidia1",), how="--device /dev/nvidia1")


def _kinds(outcome: Outcome[object]) -> list[ChangeKind]:
    return [c.kind for c in outcome.changes]


def _states(table: LeaseTable) -> list[UnitState]:
    return [u.state for u in table.view().units]


def _run(table: LeaseTable, n: int, device: str, engine: str, now_s: float = T0) -> Container:
    """Container ``n`` of ``engine``, created and started with a lease of ``device``."""
    lease = granted(table.ask(Ask(devices=device), now_s)).lease
    container = leased_container(n, lease, running=True, engine=engine)
    table.created(container, now_s)
    table.started(container, now_s)
    return container


def _node_of_two_engines() -> tuple[LeaseTable, dict[int, Container]]:
    """GPU 0 leased to Docker's container 1, GPUs 2 and 3 to Podman's containers 3 and 4,
    GPU 1 held by Podman's foreign container 5 (``--device /dev/nvidia1``): all running."""
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    containers = {
        1: _run(table, 1, "0", DOCKER),
        3: _run(table, 3, "2", PODMAN),
        4: _run(table, 4, "3", PODMAN),
        5: Container(**{**_fields(FOREIGN), "engine": PODMAN}),
    }
    table.started(containers[5], T0)
    assert _states(table) == [UnitState.LEASED, UnitState.FOREIGN] + [UnitState.LEASED] * 2
    return table, containers


def _fields(container: Container) -> dict[str, Any]:
    return {name: getattr(container, name) for name in Container.__slots__}


def _bound(table: LeaseTable) -> dict[str, tuple[LeaseState, str | None, float | None]]:
    """Container id -> its lease's state, engine and end."""
    return {
        x.container_id: (x.state, x.engine, x.until_s)
        for x in table.view().leases
        if x.container_id is not None
    }


def _restarted(table: LeaseTable, now_s: float, older_agent: bool = False) -> LeaseTable:
    """A new table from ``table``'s snapshot through JSON (``older_agent``: without the
    engines, as an agent before them wrote it), told which engines it follows."""
    saved = json.loads(json.dumps(snapshot_to_json(table.snapshot())))
    if older_agent:
        for entry in saved["leases"] + saved["foreign"]:
            del entry["engine"]
        for entry in saved["foreign"]:
            del entry["until_s"]
    restarted = LeaseTable(NODE, healthy(NODE), now_s=now_s)
    restarted.restore(snapshot_from_json(saved), now_s)
    restarted.followed([DOCKER, PODMAN], now_s)
    return restarted


def test_each_lease_and_container_hold_is_its_containers_engines() -> None:
    table, _ = _node_of_two_engines()
    assert _bound(table) == {
        cid(1): (LeaseState.RUNNING, DOCKER, None),
        cid(3): (LeaseState.RUNNING, PODMAN, None),
        cid(4): (LeaseState.RUNNING, PODMAN, None),
    }
    (hold,) = table.view().foreign
    assert (hold.holder, hold.engine, hold.until_s) == (cid(5), PODMAN, None)


def test_an_engines_list_ends_only_what_its_own_containers_held() -> None:
    table, containers = _node_of_two_engines()
    assert table.resync(DOCKER, [containers[1]], T0 + 1).changes == ()  # as it was

    dockers = table.resync(DOCKER, [], T0 + 2)  # Docker's container 1 removed unseen
    assert [c.text for c in dockers.changes] == [
        "lease-1 ended: container 0001abababab is gone (not in its engine's container list); "
        "GPU 0 is free again"
    ]
    assert set(_bound(table)) == {cid(3), cid(4)}
    assert _states(table) == [UnitState.FREE, UnitState.FOREIGN] + [UnitState.LEASED] * 2

    podmans = table.resync(PODMAN, [containers[3]], T0 + 3)  # 4 and 5 removed unseen
    assert _kinds(podmans) == [ChangeKind.ENDED, ChangeKind.FOREIGN_GONE]
    assert podmans.changes[1].text == (
        "container 0005abababab is gone (not in its engine's container list): GPU 1 no longer "
        "held by it"
    )
    assert set(_bound(table)) == {cid(3)}
    assert _states(table) == [UnitState.FREE, UnitState.FREE, UnitState.LEASED, UnitState.FREE]


def test_after_a_restart_dockers_list_keeps_podmans_leases_until_podman_lists() -> None:
    """The agent restarts while Podman's service is down (its socket gone): Docker lists at
    once, Podman only later. Container 4 and the foreign 5 were removed meanwhile."""
    old, containers = _node_of_two_engines()
    table = _restarted(old, T0 + 100)

    assert table.resync(DOCKER, [containers[1]], T0 + 100).changes == ()
    assert _bound(table) == {
        cid(1): (LeaseState.RUNNING, DOCKER, None),
        cid(3): (LeaseState.RUNNING, PODMAN, None),
        cid(4): (LeaseState.RUNNING, PODMAN, None),
    }
    refused = table.ask(Ask(devices="3"), T0 + 101).answer  # still Podman's container's
    assert isinstance(refused, Refused)
    assert refused.kind is Refusal.TAKEN
    assert "GPU 3 by container 0004abababab (lease-3)" in refused.text
    assert isinstance(table.ask(Ask(count=1), T0 + 101).answer, Refused)  # nothing is free

    podmans = table.resync(PODMAN, [containers[3]], T0 + 200)
    assert [c.text for c in podmans.changes] == [
        "lease-3 ended: container 0004abababab is gone (not in its engine's container list); "
        "GPU 3 is free again",
        "container 0005abababab is gone (not in its engine's container list): GPU 1 no longer "
        "held by it",
    ]
    assert set(_bound(table)) == {cid(1), cid(3)}
    assert [x.name for x in granted(table.ask(Ask(count=2), T0 + 201)).units] == ["1", "3"]


def test_an_older_agents_snapshot_is_kept_until_an_engine_lists_it_or_for_the_grace_time() -> None:
    old, containers = _node_of_two_engines()
    table = _restarted(old, T0 + 100, older_agent=True)
    assert {x.engine for x in table.view().leases} | {h.engine for h in table.view().foreign} == {
        None
    }

    dockers = table.resync(DOCKER, [containers[1]], T0 + 100)
    until = utc_text(T0 + 700)
    assert [(c.kind, c.text) for c in dockers.changes] == [
        (
            ChangeKind.UNLISTED,
            "lease-2: container 0003abababab, of an unknown engine, is not in the container "
            f"list of the engine at {DOCKER}: it keeps GPU 2 until {until} unless an engine "
            "lists it",
        ),
        (
            ChangeKind.UNLISTED,
            "lease-3: container 0004abababab, of an unknown engine, is not in the container "
            f"list of the engine at {DOCKER}: it keeps GPU 3 until {until} unless an engine "
            "lists it",
        ),
        (
            ChangeKind.UNLISTED,
            "container 0005abababab, of an unknown engine, is not in the container list of "
            f"the engine at {DOCKER}: it holds GPU 1 until {until} unless an engine lists it",
        ),
        (
            ChangeKind.LISTED,
            f"lease-1: container 0001abababab found by the engine at {DOCKER}, whose container "
            "list alone can end the lease from now on",
        ),
    ]
    refused = table.ask(Ask(devices="2"), T0 + 101).answer
    assert isinstance(refused, Refused)
    assert f"GPU 2 by container 0003abababab (lease-2) since {utc_text(T0)}, until {until}" in (
        refused.text
    )
    assert table.next_deadline_s() == T0 + 700

    # Podman lists container 3 (not 4, nor 5): 3 is Podman's from now on; 4 and 5 may be
    # of another engine still, and keep their GPUs until the bound.
    podmans = table.resync(PODMAN, [containers[3]], T0 + 200)
    assert _kinds(podmans) == [ChangeKind.LISTED]
    assert _bound(table) == {
        cid(1): (LeaseState.RUNNING, DOCKER, None),
        cid(3): (LeaseState.RUNNING, PODMAN, None),
        cid(4): (LeaseState.RUNNING, None, T0 + 700),
    }
    assert table.tick(T0 + 699).changes == ()

    ended = table.tick(T0 + 700)
    assert [c.text for c in ended.changes] == [
        "lease-3 ended: container 0004abababab, of an unknown engine, was in no engine's "
        "container list within 600 s; GPU 3 is free again",
        "container 0005abababab of an unknown engine was in no engine's container list within "
        "600 s: GPU 1 no longer held by it",
    ]
    assert _states(table) == [UnitState.LEASED, UnitState.FREE, UnitState.LEASED, UnitState.FREE]


def test_an_unknown_engines_container_is_claimed_by_its_events() -> None:
    old, containers = _node_of_two_engines()
    table = _restarted(old, T0 + 100, older_agent=True)
    table.resync(DOCKER, [containers[1]], T0 + 100)  # 3, 4 and 5 wait for an engine

    started = table.started(containers[3], T0 + 110)  # Podman's event: it runs
    assert _kinds(started) == [ChangeKind.LISTED]
    held = table.started(containers[5], T0 + 110)
    assert [c.text for c in held.changes] == [
        f"container 0005abababab found by the engine at {PODMAN}, whose container list alone "
        "can end its hold from now on"
    ]
    assert table.died(cid(4), T0 + 120).changes[0].kind is ChangeKind.STOPPED  # its grace
    assert _bound(table) == {
        cid(1): (LeaseState.RUNNING, DOCKER, None),
        cid(3): (LeaseState.RUNNING, PODMAN, None),
        cid(4): (LeaseState.STOPPED, None, T0 + 720),
    }
    assert (table.view().foreign[0].engine, table.view().foreign[0].until_s) == (PODMAN, None)
    assert table.resync(DOCKER, [containers[1]], T0 + 130).changes == ()  # 3, 5: Podman's


def test_leases_of_an_engine_not_followed_any_more_are_of_an_unknown_engine() -> None:
    """The agent restarted with another --docker-socket: the old path's leases are kept
    until an engine lists their containers (here, the same dockerd at its new path)."""
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    old_path = _run(table, 1, "0", "/var/run/docker.sock")
    table.started(Container(**{**_fields(FOREIGN), "engine": "/var/run/docker.sock"}), T0)

    unfollowed = table.followed([DOCKER, PODMAN], T0 + 1)
    assert [c.text for c in unfollowed.changes] == [
        "lease-1: container 0001abababab is of the engine at /var/run/docker.sock, which this "
        "agent does not follow: its engine is unknown now",
        "container 0005abababab is of the engine at /var/run/docker.sock, which this agent "
        "does not follow: its engine is unknown now",
    ]
    assert table.followed([DOCKER, PODMAN], T0 + 2).changes == ()
    assert _bound(table) == {cid(1): (LeaseState.RUNNING, None, None)}

    relisted = [Container(**{**_fields(c), "engine": DOCKER}) for c in (old_path, FOREIGN)]
    assert _kinds(table.resync(DOCKER, relisted, T0 + 3)) == [ChangeKind.LISTED] * 2
    assert _bound(table) == {cid(1): (LeaseState.RUNNING, DOCKER, None)}
    assert table.view().foreign[0].engine == DOCKER


def test_a_pending_lease_is_no_engines_and_expires_as_before() -> None:
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    assert table.resync(DOCKER, [], T0 + 1).changes == ()
    assert table.resync(PODMAN, [], T0 + 2).changes == ()
    assert table.lease(lease.id) == lease  # pending, no engine, its expiry as granted
    assert lease.engine is None
    (expired,) = table.tick(T0 + 60).changes
    assert expired.kind is ChangeKind.EXPIRED

    other: Lease = granted(table.ask(Ask(devices="1"), T0 + 61)).lease
    table.created(leased_container(2, other, engine=PODMAN), T0 + 62)
    assert _bound(table) == {cid(2): (LeaseState.STOPPED, PODMAN, T0 + 662)}
    assert table.resync(DOCKER, [], T0 + 63).changes == ()  # not Docker's to end


def test_a_list_holds_its_engines_containers_and_an_engine_has_a_name() -> None:
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    podmans = Container(cid(1), engine=PODMAN)
    with pytest.raises(ValueError, match=r"container 0001abababab of engine '/run/podman"):
        table.resync(DOCKER, [podmans], T0)
    with pytest.raises(ValueError, match="not an engine name"):
        Container(cid(1), engine="a\nb")
    with pytest.raises(ValueError, match="not an engine name"):
        table.followed(["x" * 300], T0)
    assert table.view().leases == ()
