"""Which fleets the ctl spreads over worker processes, and the frames they talk in.

The workers themselves (forked by the real ctl, asking real agents over TLS, Ctrl-C, a killed
ctl, a killed worker) are tested end to end in ``tests/e2e/test_fleet.py``: forking this
test process, which may run other threads, is what ``workers_for`` refuses to do.
"""

from __future__ import annotations

import threading

import pytest

from controller.fleet import workers
from controller.fleet.query import FleetNode
from controller.fleet.workers import MIN_NODES, _frame, _Frames, workers_for
from controller.transport.endpoint import parse_endpoint


def _nodes(count: int, scheme: str = "https") -> list[FleetNode]:
    return [
        FleetNode(f"n{i}", parse_endpoint(f"{scheme}://10.0.{i // 250}.{i % 250 + 1}"))
        for i in range(count)
    ]


def _ssh_nodes(count: int) -> list[FleetNode]:
    return [FleetNode(f"s{i}", parse_endpoint(f"ssh://ops@10.1.0.{i + 1}:")) for i in range(count)]


@pytest.fixture
def cpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    seen = {"cpus": 2}
    monkeypatch.setattr(workers, "usable_cpus", lambda: seen["cpus"])
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # this process alone
    return seen


def test_one_worker_per_cpu_for_a_fleet_of_http_nodes(cpus: dict[str, int]) -> None:
    assert workers_for(_nodes(MIN_NODES), 64) == 2
    assert workers_for(_nodes(10_000, "http"), 64) == 2
    cpus["cpus"] = 16
    assert workers_for(_nodes(MIN_NODES), 64) == 16


def test_no_workers_for_small_fleets_one_cpu_or_only_ssh(cpus: dict[str, int]) -> None:
    assert workers_for(_nodes(MIN_NODES - 1), 64) == 0
    assert workers_for(_ssh_nodes(200), 64) == 0  # SSH logins stay in the ctl's own process
    assert workers_for([*_ssh_nodes(200), *_nodes(MIN_NODES - 1)], 64) == 0
    assert workers_for([*_ssh_nodes(200), *_nodes(MIN_NODES)], 64) == 2
    cpus["cpus"] = 1
    assert workers_for(_nodes(10_000), 64) == 0


def test_no_more_workers_than_nodes_at_a_time(cpus: dict[str, int]) -> None:
    cpus["cpus"] = 16
    assert workers_for(_nodes(1000), 4) == 4
    assert workers_for(_nodes(1000), 1) == 0  # --parallel 1: one node at a time, here


def test_no_workers_while_another_thread_runs(
    cpus: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forking then could copy a lock another thread holds: the nodes are asked here."""
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert workers_for(_nodes(10_000), 64) == 0


def test_frames_are_read_whole_however_the_bytes_arrive() -> None:
    got: list[object] = []
    ended: list[Exception | None] = []
    frames = _Frames(got.append, ended.append)
    batch = [(3, {"info": {"Devices": [1, 2]}}, None, None, 0.25, None, None)]
    wire = _frame([1, 2, 3]) + _frame(batch) + _frame([])
    for size in (1, 2, 5, len(wire)):  # byte by byte, in pieces, all at once
        got.clear()
        for start in range(0, len(wire), size):
            frames.data_received(wire[start : start + size])
        assert got == [[1, 2, 3], batch, []]
    frames.connection_lost(None)
    assert ended == [None]
