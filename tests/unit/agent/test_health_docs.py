"""docs/api.md's /gpu/health table gives every form of reason the health sweep gives."""

from __future__ import annotations

from pathlib import Path

from agent.gpu.health import DeviceCheck
from agent.health.rule import check_problem

API = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def test_every_sweep_reason_is_in_the_reason_row() -> None:
    (row,) = [line for line in API.read_text(encoding="utf-8").splitlines()
              if line.startswith("| `Reason` |")]  # fmt: skip
    checks = [
        DeviceCheck(answering=False),
        DeviceCheck(row_remap_failure=True),
        DeviceCheck(row_remap_pending=True),
        DeviceCheck(retired_pages_pending=True),
        DeviceCheck(recovery_action=1),
    ]
    missing = [reason for reason in map(check_problem, checks) if f"`{reason}`" not in row]
    assert missing == []
