"""The node file's MIG attribution and recovery action, as the simulated backend serves them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import nodefile
from agent.gpu.health import XID
from agent.gpu.resets import ResetCounter
from agent.gpu.simulated import SimulatedBackend


def _builtin(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(nodefile.resolve(name).read_text())
    data.pop("timing", None)
    return data


def _rewrite(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def test_an_event_with_mig_carries_that_mig_devices_instances(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    data = _builtin("h200x2-mig")
    _rewrite(path, data)
    backend = SimulatedBackend.from_file(str(path))
    watch = backend.event_watch()
    assert watch.wait(0.05) == []
    data["events"] = [
        {"id": 1, "gpu": 0, "kind": "xid", "xid": 94, "mig": 1},
        {"id": 2, "gpu": 1, "kind": "xid", "xid": 79},
    ]
    _rewrite(path, data)
    events = watch.wait(2.0)
    assert [(e.index, e.kind, e.xid, e.gpu_instance_id, e.compute_instance_id) for e in events] == [
        (0, XID, 94, 5, 0),  # MIG device 0:1 is GPU instance 5, compute instance 0
        (1, XID, 79, None, None),
    ]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"id": 1, "gpu": 0, "kind": "xid", "xid": 94, "mig": 9},
         "events[0].mig: expected the index of one of GPU 0's MIG devices (0, 1, 2, 3)"),
        ({"id": 1, "gpu": 1, "kind": "xid", "xid": 94, "mig": 0},
         "events[0].mig: expected the index of one of GPU 1's MIG devices (none)"),
        ({"id": 1, "gpu": 0, "kind": "answers_again", "mig": 0}, "events[0].mig: expected"),
        ({"id": 1, "gpu": 0, "kind": "xid", "xid": 94, "mig": True}, "events[0].mig: expected"),
    ],
)  # fmt: skip
def test_a_bad_mig_is_refused_in_one_line(event: dict[str, Any], message: str) -> None:
    data = _builtin("h200x2-mig")
    data["events"] = [event]
    with pytest.raises(nodefile.NodeFileError, match=re.escape(message)):
        nodefile.parse(data)


@pytest.mark.parametrize("value", [-1, "1", True, 2**32])
def test_a_bad_recovery_action_is_refused(value: object) -> None:
    data = _builtin("h200")
    data["devices"][0]["recovery_action"] = value
    with pytest.raises(nodefile.NodeFileError, match=r"devices\[0\]\.recovery_action: expected"):
        nodefile.parse(data)


def test_a_recovery_action_cleared_by_a_new_version_is_a_reset(tmp_path: Path) -> None:
    """What the worker sees of a reset no sweep saw the GPU down for."""
    path = tmp_path / "node.json"
    data = _builtin("h200")
    data["devices"][0]["recovery_action"] = 1
    _rewrite(path, data)
    backend = SimulatedBackend.from_file(str(path))
    watch = backend.event_watch()
    counter = ResetCounter(1)
    assert counter.observe(0, backend.health_check(0)).recovery_action == 1
    data["devices"][0]["recovery_action"] = 0
    _rewrite(path, data)
    watch.wait(0.3)  # the watch follows the file
    check = counter.observe(0, backend.health_check(0))
    assert (check.answering, check.recovery_action, check.resets) == (True, 0, 1)


def test_files_without_the_new_fields_load_as_before() -> None:
    node = nodefile.load("h200x2")  # dumped before telemetry, profiling, recovery actions
    assert all(d.recovery_action is None for d in node.devices)
    assert all(d.status.telemetry.profiling.graphics_pct is None for d in node.devices)
    assert all(d.status.telemetry.mig_devices == () for d in node.devices)
