"""The simulation contract: a node file's new events and flags, delivered as NVML would."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import nodefile
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck
from agent.gpu.model import LOST_DEVICE_STATUS
from agent.gpu.simulated import SimulatedBackend


def builtin(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(nodefile.resolve(name).read_text())
    data.pop("timing", None)
    return data


def rewrite(path: Path, data: dict[str, Any]) -> None:
    """Write a new version of the file and rename it into place, as the contract asks."""
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


@pytest.fixture
def node_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.json"
    rewrite(path, builtin("hgx-h200-8"))
    return path


def test_events_already_in_the_file_at_start_are_history(node_file: Path) -> None:
    data = json.loads(node_file.read_text())
    data["events"] = [{"id": "old", "gpu": 3, "kind": "xid", "xid": 79}]
    rewrite(node_file, data)
    backend = SimulatedBackend.from_file(str(node_file))
    assert backend.event_watch().wait(0.05) == []
    assert backend.device_status(3) != LOST_DEVICE_STATUS


def test_a_new_event_is_delivered_once(node_file: Path) -> None:
    backend = SimulatedBackend.from_file(str(node_file))
    watch = backend.event_watch()
    assert watch.wait(0.05) == []
    data = json.loads(node_file.read_text())
    data["events"] = [
        {"id": 1, "gpu": 0, "kind": "double_bit_ecc"},
        {"id": 2, "gpu": 5, "kind": "xid", "xid": 13},
    ]
    rewrite(node_file, data)
    events = watch.wait(2.0)
    assert [(e.index, e.kind, e.xid) for e in events] == [(0, DOUBLE_BIT_ECC, None), (5, XID, 13)]
    assert all(e.at_s > 0 for e in events)
    data["events"].append({"id": 3, "gpu": 1, "kind": "xid", "xid": 94})
    rewrite(node_file, data)
    assert [(e.index, e.xid) for e in watch.wait(2.0)] == [(1, 94)]  # 1 and 2 not again


def test_xid_79_makes_the_gpu_lost_until_it_answers_again(node_file: Path) -> None:
    backend = SimulatedBackend.from_file(str(node_file))
    watch = backend.event_watch()
    data = json.loads(node_file.read_text())
    data["events"] = [{"id": "a", "gpu": 3, "kind": "xid", "xid": 79}]
    rewrite(node_file, data)
    assert [e.xid for e in watch.wait(2.0)] == [79]
    assert backend.device_status(3) == LOST_DEVICE_STATUS
    assert backend.health_check(3).answering is False
    assert backend.device_status(2) != LOST_DEVICE_STATUS

    data["events"].append({"id": "b", "gpu": 3, "kind": "answers_again"})
    rewrite(node_file, data)
    assert watch.wait(0.5) == []  # not an NVML event: the GPU just answers again
    assert backend.device_status(3) != LOST_DEVICE_STATUS
    # As a reset looks to the health sweep: not answering once, then answering.
    assert backend.health_check(3).answering is False
    assert backend.health_check(3).answering is True


def test_answers_again_after_a_double_bit_error_is_a_reset_too(node_file: Path) -> None:
    backend = SimulatedBackend.from_file(str(node_file))
    watch = backend.event_watch()
    data = json.loads(node_file.read_text())
    data["events"] = [{"id": 1, "gpu": 0, "kind": "answers_again"}]
    rewrite(node_file, data)
    watch.wait(0.3)
    assert [backend.health_check(0).answering for _ in range(2)] == [False, True]


def test_health_flags_and_statuses_follow_the_file(node_file: Path) -> None:
    backend = SimulatedBackend.from_file(str(node_file))
    watch = backend.event_watch()
    assert backend.health_check(4) == DeviceCheck(volatile_dbe=0)
    data = json.loads(node_file.read_text())
    data["devices"][4]["row_remap_pending"] = True
    data["devices"][4]["status"]["temperature_c"] = 88
    rewrite(node_file, data)
    watch.wait(0.3)
    assert backend.health_check(4).row_remap_pending is True
    assert backend.device_status(4).temperature_c == 88


def test_a_bad_new_version_keeps_what_the_file_said_before(
    node_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SimulatedBackend.from_file(str(node_file))
    watch = backend.event_watch()
    data = json.loads(node_file.read_text())
    data["events"] = [{"id": 1, "gpu": 99, "kind": "xid", "xid": 79}]
    rewrite(node_file, data)
    assert watch.wait(0.3) == []
    assert "events[0].gpu: expected a device index from 0 to 7" in caplog.text
    assert backend.health_check(0).answering is True


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ({"id": 1}, "events: expected a list"),
        ([{"gpu": 0, "kind": "xid", "xid": 79}], "events[0].id: expected a string or an integer"),
        ([{"id": 1, "gpu": 0, "kind": "reboot"}], "events[0].kind: expected one of xid"),
        ([{"id": 1, "gpu": 0, "kind": "xid"}], "events[0].xid: expected the XID number"),
        ([{"id": 1, "gpu": -1, "kind": "double_bit_ecc"}], "events[0].gpu: expected a device"),
        (
            [{"id": 7, "gpu": 0, "kind": "answers_again"}] * 2,
            "events[1].id: 7 is used twice",
        ),
    ],
)
def test_bad_events_are_one_line_naming_the_entry(events: object, error: str) -> None:
    data = builtin("h200")
    data["events"] = events
    with pytest.raises(nodefile.NodeFileError, match=r"^" + error.replace("[", r"\[")):
        nodefile.parse(data)


def test_a_bad_health_flag_is_one_line() -> None:
    data = builtin("h200")
    data["devices"][0]["row_remap_failure"] = "yes"
    with pytest.raises(nodefile.NodeFileError, match=r"devices\[0\].row_remap_failure: expected"):
        nodefile.parse(data)
