"""The REST API's query parameters at the edge: bounds, and the answers of today kept."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.api.query import MAX_ENTRIES, MAX_VALUE_CHARS, check_list
from agent.display import shown
from agent.node.selection import InvalidParameter, select_devices
from tests.unit.agent.conftest import CountingBackend

if TYPE_CHECKING:
    from tests.unit.agent.conftest import MakeClient

DEVICES = CountingBackend("hgx-h200-8").node_info().devices


@pytest.mark.parametrize(
    ("query", "body"),
    [
        ("dev=9", "invalid device: 9\n"),
        ("dev=0+GPU-zz", "invalid device: GPU-zz\n"),
        ("dev=%C2%B2", "invalid device: ²\n"),
        ("dev=%D9%A3", "invalid device: ٣\n"),  # an Arabic-Indic three: isdigit(), not ASCII
        ("dev=0:1", "invalid device: 0:1 (GPU 0 is not in MIG mode)\n"),
        ("dev=MIG-4f5e", "invalid device: MIG-4f5e\n"),
        ("dev=" + "9" * 4301, f"invalid device: {'9' * 80}... (4301 characters)\n"),
        (
            "dev=" + "0," * 129,
            f"invalid device: {('0,' * 40)}... (258 characters) (more than 128 entries)\n",
        ),
        ("dev=GPU-" + "a" * 93, f"invalid device: GPU-{'a' * 76}... (97 characters)\n"),
        ("dev=a%00b", "invalid device: a\\x00b\n"),
        ("vol=nvidia_gl", "invalid volume: nvidia_gl\n"),
        ("vol=" + "v" * 65, f"invalid volume: {'v' * 65}\n"),
        ("format=yaml", "invalid format: yaml (expected legacy or native)\n"),
        ("format=%1b%5b2J", "invalid format: \\x1b[2J (expected legacy or native)\n"),
    ],
)
async def test_refused_queries_get_one_line_naming_the_entry(
    make_client: MakeClient, query: str, body: str
) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    route = "/mesos/cli" if query.startswith("format") else "/docker/cli"
    resp = await client.get(f"{route}?{query}")
    assert resp.status == 400
    assert await resp.text() == body
    assert resp.headers["X-Invalid-Parameter"] == query.split("=", maxsplit=1)[0]
    assert len(resp.headers["X-Invalid-Value"]) <= 3 * 256


@pytest.mark.parametrize(
    "route",
    [
        "/gpu/info",
        "/gpu/info/json",
        "/gpu/status",
        "/gpu/status/json",
        "/docker/cli/json",
        "/mesos/cli",
    ],
)
async def test_every_route_refuses_unicode_digits(make_client: MakeClient, route: str) -> None:
    client = await make_client(CountingBackend("h200"))
    resp = await client.get(f"{route}?dev=%C2%B2")
    assert (resp.status, await resp.text()) == (400, "invalid device: ²\n")


async def test_good_queries_still_pass(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    for query in ("dev=0+7", "dev=0,1", "dev=*", "dev=", "vol=nvidia_driver", "x=%00", "dev=gpu-"):
        resp = await client.get(f"/docker/cli?{query}")
        assert resp.status == (400 if query == "dev=gpu-" else 200), query


def test_a_value_just_within_the_bounds_passes() -> None:
    check_list("dev", " ".join(["0"] * MAX_ENTRIES))
    check_list("dev", "0" + " " * (MAX_VALUE_CHARS - 1))
    with pytest.raises(InvalidParameter):
        check_list("dev", "0" + " " * MAX_VALUE_CHARS)


@settings(max_examples=300, deadline=None)
@given(value=st.text(max_size=200))
def test_any_dev_is_a_selection_or_an_invalid_parameter(value: str) -> None:
    """Nothing else escapes: the edge and the matcher refuse with InvalidParameter only,
    and its text is one printable line."""
    try:
        check_list("dev", value)
        chosen = select_devices(DEVICES, value)
    except InvalidParameter as err:
        text = str(err)
        assert text.startswith("invalid device: ")
        assert text.isprintable()
        assert len(text) < 200
    else:
        assert set(chosen) <= set(DEVICES)


def test_shown_keeps_printable_text_and_escapes_the_rest() -> None:
    assert shown("GPU-9f") == "GPU-9f"
    assert shown("²") == "²"
    assert shown("a\nb\x1b\u200b\U000e0001") == "a\\x0ab\\x1b\\u200b\\U000e0001"
    assert shown("x" * 81) == "x" * 80 + "... (81 characters)"
