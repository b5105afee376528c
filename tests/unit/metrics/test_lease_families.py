"""The lease table's families: a holder shows with its container whether busy or idle, a
foreign holder is no lease, the exposition parses as Prometheus reads it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.leases.asks import Ask
from agent.leases.containers import Container
from agent.leases.table import LeaseTable
from agent.metrics.lease_families import MAX_OWNER_CHARS, Named, lease_families
from agent.metrics.service import render
from tests.unit.leases.nodes import T0, builtin, cid, granted, healthy, leased_container

Samples = list[dict[str, str]]


def _samples(table: LeaseTable, family: str, containers: dict[str, Named] | None = None) -> Samples:
    text = render(lease_families(table.view(), "node-7", containers)).decode()
    parse = cast(Callable[[str], Iterable[Metric]], text_string_to_metric_families)
    return [
        {**sample.labels, "value": str(sample.value)}
        for metric in parse(text)
        if metric.name == family
        for sample in metric.samples
    ]


def _table() -> LeaseTable:
    node = builtin("hgx-h200-8")
    return LeaseTable(node, healthy(node), now_s=T0)


def test_a_lease_is_one_sample_per_gpu_with_its_owner_then_its_container() -> None:
    table = _table()
    owner = (("job", "7"), ("user", "alice"))
    grant = granted(table.ask(Ask(count=2, owner=owner), T0))
    pending = _samples(table, "nvidia_docker_gpu_leased")
    assert [s["device"] for s in pending] == [u.name for u in grant.units]
    assert {s["state"] for s in pending} == {"pending"}
    assert {s["container_id"] for s in pending} == {""}
    assert {s["owner"] for s in pending} == {"job=7,user=alice"}
    assert {s["Hostname"] for s in pending} == {"node-7"}

    table.created(leased_container(1, grant.lease), T0 + 1)
    table.started(leased_container(1, grant.lease, running=True), T0 + 2)
    running = _samples(table, "nvidia_docker_gpu_leased")
    assert {(s["state"], s["container_id"]) for s in running} == {("running", cid(1))}
    assert {(s["container_name"], s["image"]) for s in running} == {("", "")}  # not known
    named = _samples(table, "nvidia_docker_gpu_leased", {cid(1): ("trainer", "pytorch:2.3")})
    assert {(s["container_name"], s["image"]) for s in named} == {("trainer", "pytorch:2.3")}

    table.destroyed(cid(1), T0 + 3)
    assert _samples(table, "nvidia_docker_gpu_leased") == []


def test_every_unit_has_its_state_and_a_foreign_holder_is_not_a_lease() -> None:
    table = _table()
    grant = granted(table.ask(Ask(count=1), T0))
    table.created(Container(cid(9), False, None, ("/dev/nvidia3",), "--device"), T0)
    table.started(Container(cid(9), True, None, ("/dev/nvidia3",), "--device"), T0)
    states = {s["device"]: s["state"] for s in _samples(table, "nvidia_docker_gpu_lease_state")}
    assert len(states) == 8
    assert states[grant.units[0].name] == "pending"
    assert states["3"] == "foreign"
    assert list(states.values()).count("free") == 6
    leased = _samples(table, "nvidia_docker_gpu_leased")
    assert [s["device"] for s in leased] == [grant.units[0].name]


def test_a_long_owner_is_cut_and_the_queue_is_counted() -> None:
    table = _table()
    owner = tuple((f"label{n}", "x" * 100) for n in range(4))  # 4 x 108 characters
    granted(table.ask(Ask(count=8, owner=owner), T0))
    table.ask(Ask(count=1, wait_s=30), T0)
    (first, *_) = _samples(table, "nvidia_docker_gpu_leased")
    assert len(first["owner"]) == MAX_OWNER_CHARS
    assert first["owner"].endswith("…")
    (waiting,) = _samples(table, "nvidia_docker_lease_waiting")
    assert waiting["value"] == "1.0"
