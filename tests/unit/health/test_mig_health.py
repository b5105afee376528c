"""Health per MIG device: an XID of one GPU instance withdraws its MIG devices alone, and
what hands devices out (the selection, the lease table, /gpu/health) follows."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from agent.gpu import nodefile
from agent.gpu import worker_protocol as wp
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck, HealthEvent
from agent.gpu.model import NodeInfo
from agent.gpu.worker_client import WorkerClient
from agent.health.monitor import HealthMonitor
from agent.health.render import health_json, health_text
from agent.health.rule import HEALTHY, DeviceHealth, HealthTracker
from agent.health.selection import UnhealthyDevice, select_usable
from agent.leases.asks import Ask
from agent.leases.table import LeaseTable
from agent.node.facts import NodeFacts

NODE = nodefile.load("h200x2-mig").info  # GPU 0: MIG 0:0 (GI 1), 0:1 (GI 5), 0:2, 0:3
OK = DeviceCheck()


def tracker() -> HealthTracker:
    return HealthTracker(2, mig_layout=[d.mig_devices for d in NODE.devices])


def xid(gpu: int, number: int, gi: int | None = None, ci: int | None = None) -> HealthEvent:
    return HealthEvent(gpu, XID, number, 100.0, gpu_instance_id=gi, compute_instance_id=ci)


def test_an_xid_of_one_gpu_instance_withdraws_its_mig_device_only() -> None:
    health = tracker()
    (note,) = health.event(xid(0, 94, gi=5, ci=0))
    assert note.warning
    assert note.text == (
        "MIG device 0:1 is unhealthy: XID 94 (contained ECC error) (GPU 0 (GPU instance 5, "
        "compute instance 0)); it is no longer handed out until a GPU reset or driver "
        "reload; GPU 0 and its other MIG devices stay in service"
    )
    gpu0, gpu1 = health.health()
    assert gpu0.healthy
    assert gpu0.unhealthy_migs == (1,)
    assert gpu0.of_mig(1) == DeviceHealth(False, "XID 94 (contained ECC error)", 94, 100.0)
    assert gpu0.of_mig(0) == HEALTHY
    assert gpu0.of_mig(None) is gpu0
    assert gpu1 == HEALTHY


def test_an_instance_without_compute_instance_means_all_of_its_mig_devices() -> None:
    layout = [d.mig_devices for d in NODE.devices]
    health = HealthTracker(2, mig_layout=layout)
    health.event(xid(0, 48, gi=13))  # GPU instance 13: MIG device 0:2
    assert health.health()[0].unhealthy_migs == (2,)


def test_an_unknown_instance_or_none_holds_the_whole_gpu() -> None:
    health = tracker()
    (note,) = health.event(xid(0, 79, gi=99))  # an instance this node does not list
    assert not health.health()[0].healthy
    assert note.text.startswith("GPU 0 is unhealthy: XID 79")
    health = tracker()
    health.event(xid(0, 79))
    assert not health.health()[0].healthy
    assert not health.health()[0].of_mig(1).healthy  # a MIG device falls with its GPU


def test_application_xids_of_an_instance_change_nothing() -> None:
    health = tracker()
    (note,) = health.event(xid(0, 13, gi=1, ci=0))
    assert "an application's error" in note.text
    assert health.health() == (HEALTHY, HEALTHY)


def test_a_gpu_reset_clears_its_mig_devices_even_between_sweeps() -> None:
    health = tracker()
    health.checks([OK, OK], 1.0)
    health.event(HealthEvent(0, DOUBLE_BIT_ECC, None, 2.0, gpu_instance_id=1, resets=0))
    assert health.health()[0].unhealthy_migs == (0,)
    assert health.checks([OK, OK], 3.0) == []
    (note,) = health.checks([DeviceCheck(resets=1), OK], 4.0)  # the worker saw a reset
    assert note.text == "MIG device 0:0 healthy again after a reset of GPU 0"
    assert health.health() == (HEALTHY, HEALTHY)


def test_a_mig_device_that_left_the_node_is_forgotten() -> None:
    health = tracker()
    health.event(xid(0, 94, gi=5, ci=0))
    gpu0 = NODE.devices[0]
    health.relayout([gpu0.mig_devices[:1], ()])  # MIG reconfigured: 0:1 is gone
    assert health.health() == (HEALTHY, HEALTHY)


def test_a_gpu_level_problem_hides_nothing_and_the_mig_event_stays() -> None:
    health = tracker()
    health.event(xid(0, 94, gi=5, ci=0))
    health.checks([DeviceCheck(row_remap_pending=True), OK], 5.0)
    assert not health.health()[0].healthy
    assert health.health()[0].reason == "row remapping pending (needs a GPU reset)"
    health.checks([OK, OK], 6.0)  # a pending remap gone is no reset here (the worker counts)
    assert health.health()[0].unhealthy_migs == (1,)


def _sick_mig_health() -> tuple[DeviceHealth, ...]:
    health = tracker()
    health.event(xid(0, 94, gi=5, ci=0))
    return health.health()


def test_the_default_selection_leaves_the_mig_device_out_and_naming_it_is_refused() -> None:
    health = _sick_mig_health()
    chosen = select_usable(NODE.devices, None, health)
    assert [(t.gpu.index, t.mig.index if t.mig else None) for t in chosen] == [
        (0, 0), (0, 2), (0, 3), (1, None),
    ]  # fmt: skip
    assert len(select_usable(NODE.devices, "0:0 0:3", health)) == 2
    with pytest.raises(UnhealthyDevice) as refused:
        select_usable(NODE.devices, "0:1", health)
    assert str(refused.value) == (
        f"unhealthy device: 0:1: MIG device 0:1 ({NODE.devices[0].mig_devices[1].uuid}) is "
        "unhealthy since 1970-01-01T00:01:40Z: XID 94 (contained ECC error); choose another GPU"
    )
    assert refused.value.mig == 1
    with pytest.raises(UnhealthyDevice, match="MIG device 0:1"):
        select_usable(NODE.devices, "0", health)  # the whole GPU includes it


def test_node_facts_say_which_mig_devices_are_withdrawn() -> None:
    facts = NodeFacts(NODE, (), _sick_mig_health())
    assert facts.unhealthy == frozenset()
    assert facts.unhealthy_migs == frozenset({(0, 1)})
    cli = json.loads(facts.docker_cli_cdi(None, None, as_json=True))
    sick, well = (str(NODE.devices[0].mig_devices[i].uuid) for i in (1, 0))
    assert sick not in json.dumps(cli)
    assert well in json.dumps(cli)


def test_the_lease_table_does_not_lease_the_sick_mig_device() -> None:
    table = LeaseTable(NODE, list(_sick_mig_health()), now_s=1000.0)
    units = {u.name: u for u in table.view().units}
    assert units["0:1"].healthy is False
    assert units["0:1"].health_reason == "XID 94 (contained ECC error)"
    assert units["0:0"].healthy is True
    assert units["1"].healthy is True
    refused = table.ask(Ask(devices="0:1"), 1001.0).answer
    assert "unhealthy" in str(refused)


def test_health_json_and_text_show_the_mig_devices() -> None:
    health = _sick_mig_health()
    doc = json.loads(health_json(NODE.devices, health))
    gpu0, gpu1 = doc["Devices"]
    assert gpu0["Healthy"] is True
    assert [m["Healthy"] for m in gpu0["MIG"]] == [True, False, True, True]
    assert gpu0["MIG"][1] == {
        "Index": 1, "UUID": NODE.devices[0].mig_devices[1].uuid, "Healthy": False,
        "Reason": "XID 94 (contained ECC error)", "XID": 94, "Since": "1970-01-01T00:01:40Z",
    }  # fmt: skip
    assert "MIG" not in gpu1  # a GPU not in MIG mode: the body of before
    assert health_text(NODE.devices, health).decode().splitlines() == [
        "Device #0: healthy",
        "Device #0:1: unhealthy since 1970-01-01T00:01:40Z: XID 94 (contained ECC error)",
        "Device #1: healthy",
    ]


class StubWorker:
    def __init__(self, node: NodeInfo) -> None:
        self._node = node
        self.push: Any = None

    def node_info(self) -> NodeInfo:
        return self._node

    def set_push_handler(self, handler: Any) -> None:
        self.push = handler


def test_the_monitor_maps_the_instances_of_its_workers_node() -> None:
    changes: list[int] = []
    monitor = HealthMonitor(2, on_change=lambda: changes.append(1), on_driver_error=print)
    worker = StubWorker(NODE)
    monitor.follow(cast(WorkerClient, worker))
    event = HealthEvent(0, XID, 94, 5.0, gpu_instance_id=5, compute_instance_id=0, resets=0)
    worker.push({"push": wp.PUSH_EVENT, "event": wp.encode_event(event)})
    assert changes == [1]
    assert monitor.health[0].unhealthy_migs == (1,)
    assert monitor.last_xids == (94, 0)


def test_a_new_worker_of_the_same_driver_counts_resets_from_zero() -> None:
    monitor = HealthMonitor(2, on_change=lambda: None, on_driver_error=print)
    first = StubWorker(NODE)
    monitor.follow(cast(WorkerClient, first))
    event = HealthEvent(1, XID, 79, 5.0, resets=3)  # the old worker had seen 3 resets
    first.push({"push": wp.PUSH_EVENT, "event": wp.encode_event(event)})
    assert not monitor.health[1].healthy
    second = StubWorker(NODE)
    monitor.follow(cast(WorkerClient, second))  # restarted: same driver, counts from 0
    checks = [wp.encode_check(c) for c in (OK, DeviceCheck(resets=0))]
    second.push({"push": wp.PUSH_CHECKS, "checks": checks})
    assert not monitor.health[1].healthy
    checks = [wp.encode_check(c) for c in (OK, DeviceCheck(resets=1))]  # its first reset
    second.push({"push": wp.PUSH_CHECKS, "checks": checks})
    assert monitor.health[1] == HEALTHY
