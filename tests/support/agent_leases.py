"""The lease REST API of a test's agent on loopback (docs/leases.md, "The REST API"): ask
for a lease, read the table, release a lease, see which container holds one. A mixin for a
test's node, which has the agent as ``agent`` (``tests.support.lease_node.LeaseNode`` and the
start gates' end-to-end tests)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from tests.support.agent_process import AgentProcess


class AgentLeases:
    agent: AgentProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    def ask(self, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
        """POST /leases; its answer, of HTTP ``status``."""
        request = urllib.request.Request(
            f"{self.url}/leases",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                code, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            code, raw = err.code, err.read()
        assert code == status, raw
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def table(self) -> dict[str, Any]:
        """GET /leases/json."""
        with urllib.request.urlopen(f"{self.url}/leases/json", timeout=10) as resp:
            table: dict[str, Any] = json.loads(resp.read())
        return table

    def release(self, lease_id: str) -> None:
        """DELETE /leases/<id> (a pending lease, or a stopped container's)."""
        request = urllib.request.Request(f"{self.url}/leases/{lease_id}", method="DELETE")
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
