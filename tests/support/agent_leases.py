"""The lease REST API of a test's agent on loopback (docs/leases.md, "The REST API"): ask
for a lease, read the table, see which container holds a lease. A mixin for a test's node,
which has the agent as ``agent``."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from tests.support.agent_process import AgentProcess


class AgentLeases:
    agent: AgentProcess

    def lease(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /leases: the 201 answer."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.agent.port}/leases",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 201
            answer: dict[str, Any] = json.loads(resp.read())
        return answer

    def table(self) -> dict[str, Any]:
        """GET /leases/json."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.agent.port}/leases/json", timeout=10
        ) as resp:
            table: dict[str, Any] = json.loads(resp.read())
        return table

    def release(self, lease_id: str) -> None:
        """DELETE /leases/<id> (a pending lease, or a stopped container's)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.agent.port}/leases/{lease_id}", method="DELETE"
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200

    def bound_and_running(self, lease_id: str, container_id: str) -> bool:
        """Whether ``lease_id`` is bound to ``container_id`` and the agent has seen it start
        (a create event binds a lease, its start event makes it ``running``)."""
        return any(
            lease["Lease"] == lease_id
            and lease["Container"] == container_id
            and lease["State"] == "running"
            for lease in self.table()["Leases"]
        )

    def holder(self, lease_id: str) -> str | None:
        """The container ``lease_id`` is bound to; "" for a lease the table no longer has."""
        leases: dict[str, str | None] = {
            lease["Lease"]: lease["Container"] for lease in self.table()["Leases"]
        }
        return leases.get(lease_id, "")
