"""The usage routes (agent.api.usage) over a real ledger file: what ``GET /usage/json`` and
``GET /usage/idle/json`` answer (docs/usage.md, "The REST API")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
from aiohttp import web

from agent.api.usage import USAGE, make_routes
from agent.usage.ledger import UsageLedger, UsageSettings
from agent.usage.store import LedgerBusy
from tests.unit.usage import GPUS, T0, batch, delta, hold, open_store

if TYPE_CHECKING:  # types only: generic from aiohttp 3.11 / pytest-aiohttp 1.1 (above the floors)
    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    Client = TestClient[web.Request, web.Application]


def ledger_of(path: Path, *, with_store: bool) -> UsageLedger:
    """A ledger whose sweeps are not run: its store (or none, as on an agent whose file
    another agent holds), its accounting and idle tracker as the routes read them."""
    store = open_store(path) if with_store else None
    return UsageLedger(
        UsageSettings(path=path),
        cast(Any, None),
        cast(Any, None),
        cast(Any, None),
        store,
        off_reason=None if with_store else str(LedgerBusy(f"usage ledger {path} is in use")),
    )


async def client_of(ledger: UsageLedger, aiohttp_client: AiohttpClient) -> Client:
    app = web.Application()
    app[USAGE] = ledger
    for method, path, handler in make_routes("node-1"):
        app.router.add_route(method, path, handler)
    return await aiohttp_client(app)


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[UsageLedger]:
    made = ledger_of(tmp_path / "usage.db", with_store=True)
    yield made
    await made.close()


async def test_by_gpu_rows_carry_the_gpus_index(
    ledger: UsageLedger, aiohttp_client: AiohttpClient
) -> None:
    assert ledger.store is not None
    ledger.store.submit(
        batch(
            hold("lease-1", gpu=3, started=T0, ended=T0 + 600),
            deltas=(delta(T0, "gpu", GPUS[3], 600), delta(T0, "gpu", GPUS[5], 60)),
        )
    )
    client = await client_of(ledger, aiohttp_client)
    resp = await client.get("/usage/json", params={"since": str(T0), "until": str(T0 + 3600)})
    answer = await resp.json()
    assert resp.status == 200, answer
    assert [(row["gpu"], row["index"]) for row in answer["rows"]] == [
        (GPUS[3], 3),
        (GPUS[5], None),  # no hold of the ledger says its index
    ]


async def test_an_iso_zone_whose_plus_the_url_made_a_space_is_read(
    ledger: UsageLedger, aiohttp_client: AiohttpClient
) -> None:
    client = await client_of(ledger, aiohttp_client)
    # as curl sends it: the "+" unescaped, which a URL's query reads as a space
    resp = await client.get(
        "/usage/json?by=container&since=2026-01-01T01:00:00+01:00&until=2026-01-01T01:00:00Z"
    )
    answer = await resp.json()
    assert resp.status == 200, answer
    assert (answer["since"], answer["until"]) == (T0, T0 + 3600)


async def test_idle_gpus_are_listed_by_an_agent_whose_ledger_file_another_holds(
    tmp_path: Path, aiohttp_client: AiohttpClient
) -> None:
    ledger = ledger_of(tmp_path / "usage.db", with_store=False)
    client = await client_of(ledger, aiohttp_client)
    usage = await client.get("/usage/json")
    assert usage.status == 404
    assert "is in use" in (await usage.json())["Error"]
    idle = await client.get("/usage/idle/json")
    answer = await idle.json()
    assert idle.status == 200, answer
    assert answer == {"node": "node-1", "idle_after_s": 3600.0, "policy": "notify", "idle": []}


async def test_a_ledger_that_cannot_be_opened_is_said_once_in_the_log_and_the_404(
    tmp_path: Path, aiohttp_client: AiohttpClient, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "not-a-directory").write_text("")
    path = tmp_path / "not-a-directory" / "usage.db"
    ledger = UsageLedger.for_agent(
        UsageSettings(path=path),
        cast(Any, None),
        cast(Any, None),
        cast(Any, SimpleNamespace(engines={})),
    )
    await ledger._open_store()
    client = await client_of(ledger, aiohttp_client)
    resp = await client.get("/usage/json")
    said = (await resp.json())["Error"]
    assert resp.status == 404
    assert said == f"usage ledger {path}: its directory cannot be made: File exists"
    assert [r.getMessage().count(str(path)) for r in caplog.records] == [1]
