"""Plugin bodies parsed within bounds: depth checked without recursion, our own messages."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.json_body import MAX_DEPTH, BodyError, parse_json

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=40,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=_JSON)
def test_within_the_depth_it_is_what_json_loads_says(value: object) -> None:
    raw = json.dumps(value).encode()
    if _depth(value) <= MAX_DEPTH:
        assert parse_json(raw) == json.loads(raw)
    else:
        with pytest.raises(BodyError, match="nests deeper"):
            parse_json(raw)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=400) | st.text(alphabet='[]{}"\\,:1 a', max_size=400).map(str.encode))
def test_any_bytes_are_a_value_or_a_body_error(raw: bytes) -> None:
    message = ""
    try:
        parse_json(raw)
    except BodyError as err:
        message = str(err)
    assert message == "" or message.startswith("the body ")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 2000, "the body nests deeper than 32 levels"),
        (b"[" * 33 + b"]" * 33, "the body nests deeper than 32 levels"),
        (b'{"Name": "' + b"[" * 5000 + b'"}', None),  # brackets inside a string are text
        (b"[" * 32 + b"]" * 32, None),
        (b"9" * 4400, "the body is not valid JSON (a value is too large)"),
        (b'{"Name": 1,}', "the body is not valid JSON (line 1, column 12)"),
        (b"\xff", "the body is not valid JSON (not UTF-8 at byte 0)"),
    ],
)
def test_examples(raw: bytes, message: str | None) -> None:
    if message is None:
        parse_json(raw)
    else:
        with pytest.raises(BodyError) as refused:
            parse_json(raw)
        assert str(refused.value) == message


def test_escaped_quotes_after_an_open_string_are_scanned_in_linear_time() -> None:
    """200,000 escaped quotes after an unterminated string: the former pattern backtracked
    over them (8 s for 20,000, growing with the square); the pytest timeout guards this."""
    body = b"[" * 40 + b'"' + b'\\"' * 200_000
    with pytest.raises(BodyError, match="nests deeper than 32 levels"):
        parse_json(body)
    assert parse_json(b'["' + b'\\"' * 200_000 + b'"]') == ['"' * 200_000]
