"""The usage routes' query parameters (agent.api.usage): times, groupings and limits."""

from __future__ import annotations

import pytest

from agent.api.usage import BadQuery, parse_by, parse_limit, parse_time

NOW = 1_764_633_600.0  # 2025-12-02T00:00:00Z


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("-24h", NOW - 86400),
        ("-7d", NOW - 7 * 86400),
        ("-30m", NOW - 1800),
        ("-90s", NOW - 90),
        ("-1.5h", NOW - 5400),
        ("1764547200", 1_764_547_200.0),
        ("1764547200.25", 1_764_547_200.25),
        ("2025-12-01T00:00:00Z", NOW - 86400),
        ("2025-12-01T01:00:00+01:00", NOW - 86400),
    ],
)
def test_times_are_unix_seconds_relative_or_iso(text: str, expected: float) -> None:
    assert parse_time("since", text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("yesterday", "give Unix seconds, -24h / -7d / -30m before now, or an ISO 8601 time"),
        ("2025-12-01T00:00:00", "give a time zone"),
        ("1e300", "out of range"),
        ("nan", "out of range"),
        ("-5y", "give Unix seconds"),
    ],
)
def test_a_bad_time_is_one_line_saying_what_to_give(text: str, said: str) -> None:
    with pytest.raises(BadQuery) as refused:
        parse_time("since", text, NOW)
    assert said in str(refused.value)
    assert str(refused.value).startswith(f"since={text!r}")
    assert "\n" not in str(refused.value)


def test_groupings() -> None:
    assert [parse_by(b) for b in ("gpu", "container", "image", "label:team")] == [
        "gpu", "container", "image", "label:team",
    ]  # fmt: skip
    for bad in ("user", "label:", "label:" + "k" * 129, "GPU"):
        with pytest.raises(BadQuery, match="group by gpu, container, image or label:KEY"):
            parse_by(bad)


def test_limits() -> None:
    assert parse_limit("1") == 1
    assert parse_limit("10000") == 10000
    for bad in ("0", "10001", "-1", "ten", "١٢"):
        with pytest.raises(BadQuery, match="a whole number from 1 to 10000"):
            parse_limit(bad)
