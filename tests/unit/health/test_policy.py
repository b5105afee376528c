"""``--health-checks``: what it accepts, what it refuses, and what each form counts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from agent.config import Config
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck, HealthEvent
from agent.health.policy import (
    APPLICATION_XIDS,
    DEFAULT_POLICY,
    HealthPolicy,
    parse_health_checks,
)
from agent.health.rule import HEALTHY, HealthTracker

DEVICE_PLUGIN_SKIPS = {13, 31, 43, 45, 68, 109}  # NVIDIA's device plugin, internal/rm/health.go


def test_the_default_ignores_the_device_plugins_application_xids() -> None:
    assert set(APPLICATION_XIDS) == DEVICE_PLUGIN_SKIPS
    assert Config().health_checks == DEFAULT_POLICY == parse_health_checks("all")
    assert str(DEFAULT_POLICY) == "all"
    for xid in DEVICE_PLUGIN_SKIPS:
        assert not DEFAULT_POLICY.counts_xid(xid)
    assert DEFAULT_POLICY.counts_xid(79)
    assert DEFAULT_POLICY.counts_xid(None)  # an XID event whose number NVML did not give
    assert DEFAULT_POLICY.checks


@pytest.mark.parametrize(
    ("text", "canonical", "counted", "ignored", "checks"),
    [
        ("", "all", {79, 48}, {13}, True),
        ("XIDS", "xids", {79}, {13, 31}, False),
        ("none", "none", set(), {79, 48, 13}, False),
        ("xids,-48,+13", "xids,-48,+13", {13, 79}, {48, 31}, False),
        (" all , -79 ", "all,-79", {48}, {79, 13}, True),
        ("none,+79", "none,+79", {79}, {48, 13}, False),
        ("-13,+13", "all,+13", {13}, {31}, True),  # the last word about an XID wins
        ("+74 -74", "all,-74", {48}, {74}, True),  # spaces separate too
        ("all,all", "all", {79}, {13}, True),
    ],
)
def test_each_form(
    text: str, canonical: str, counted: set[int], ignored: set[int], checks: bool
) -> None:
    policy = parse_health_checks(text)
    assert str(policy) == canonical
    assert parse_health_checks(str(policy)) == policy
    assert all(policy.counts_xid(x) for x in counted)
    assert not any(policy.counts_xid(x) for x in ignored)
    assert policy.checks is checks


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("xids,none", "give at most one of all, xids, none"),
        ("48", "expected all, xids, none, -XID (ignore it) or +XID (count it)"),
        ("-abc", "expected all, xids, none"),
        ("+0", "an XID is a number from 1 to 65535"),
        ("+99999", "an XID is a number from 1 to 65535"),
        ("+1234567", "expected all, xids, none"),
        ("dbe", "expected all, xids, none"),
    ],
)
def test_a_bad_value_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        parse_health_checks(text)
    assert "\n" not in str(refused.value)


def _tracker(text: str) -> HealthTracker:
    return HealthTracker(1, policy=parse_health_checks(text))


def test_xids_counts_xid_events_only() -> None:
    tracker = _tracker("xids")
    tracker.event(HealthEvent(0, DOUBLE_BIT_ECC, None, 1.0))
    tracker.checks([DeviceCheck(answering=False)], 2.0)
    tracker.checks([DeviceCheck(row_remap_pending=True, recovery_action=1)], 3.0)
    assert tracker.health() == (HEALTHY,)
    (note,) = tracker.event(HealthEvent(0, XID, 79, 4.0))
    assert note.warning
    assert tracker.health()[0].xid == 79


def test_none_counts_nothing_and_says_why() -> None:
    tracker = _tracker("none")
    (note,) = tracker.event(HealthEvent(0, XID, 79, 1.0))
    assert note.text == (
        "GPU 0: XID 79 (GPU has fallen off the bus): ignored (--health-checks none); the GPU "
        "stays healthy"
    )
    tracker.checks([DeviceCheck(answering=False)], 2.0)
    assert tracker.health() == (HEALTHY,)


def test_plus_counts_an_application_xid_and_minus_ignores_a_critical_one() -> None:
    tracker = _tracker("-79,+43")
    tracker.event(HealthEvent(0, XID, 79, 1.0))
    assert tracker.health() == (HEALTHY,)
    tracker.event(HealthEvent(0, XID, 43, 2.0))
    assert tracker.health()[0].reason == "XID 43 (GPU stopped processing)"


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_bad_value_stops_the_agent_before_it_starts(how: str) -> None:
    env = {**os.environ, "NVIDIA_DOCKER_PLUGIN_HEALTH_CHECKS": "xid"}
    args = ["--health-checks", "xid"] if how == "flag" else []
    proc = subprocess.run(
        [sys.executable, "-m", "agent.daemon", "--simulate", "h200", *args],
        capture_output=True, text=True, timeout=30, check=False,
        env=env if how == "environment" else None,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "health-checks" in proc.stderr.lower()
    assert "expected all, xids, none" in proc.stderr


def test_policies_compare_by_value() -> None:
    assert HealthPolicy() == parse_health_checks("all,-13")  # 13 is ignored anyway
