"""HTTP/1.1 heads as the engine socket reads them: framing found, hostile heads refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.engine_socket.heads import (
    MAX_HEAD_BYTES,
    Body,
    HeadError,
    chunk_size,
    parse_request_head,
    parse_response_head,
)


def test_a_create_with_a_length() -> None:
    head = parse_request_head(
        b"POST /v1.41/containers/create?name=a HTTP/1.1\r\nHost: api.moby.localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 42\r\n\r\n"
    )
    assert head.method == b"POST"
    assert head.target == b"/v1.41/containers/create?name=a"
    assert head.framing.body is Body.LENGTH
    assert head.framing.length == 42
    assert head.get(b"content-type") == b"application/json"


def test_chunked_and_upgrade() -> None:
    head = parse_request_head(
        b"POST /build HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: keep-alive, Upgrade\r\nUpgrade: tcp\r\n\r\n"
    )
    assert head.framing.body is Body.CHUNKED
    assert head.has_token(b"Connection", b"upgrade")
    assert not head.has_token(b"Connection", b"close")


def test_a_get_has_no_body_and_the_rewritten_head_one_length() -> None:
    head = parse_request_head(b"GET /_ping HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert head.framing.body is Body.CHUNKED  # framing is the head's, not the method's
    plain = parse_request_head(b"GET /_ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert plain.framing.body is Body.NONE
    again = parse_request_head(head.with_body_length(7))
    assert again.framing.length == 7
    assert again.get(b"transfer-encoding") is None


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /_ping HTTP/1.1\r\nHost: x\r\n", 400),  # no empty line: truncated
        (b"GET /_ping\r\n\r\n", 400),
        (b"GET /_ping HTTP/2.0\r\n\r\n", 505),
        (b"GET /a b HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 300 + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
    ],
)
def test_hostile_heads_are_refused_with_a_status(raw: bytes, status: int) -> None:
    with pytest.raises(HeadError) as caught:
        parse_request_head(raw)
    assert caught.value.status == status
    assert "\n" not in str(caught.value)


@given(st.binary(max_size=512))
def test_no_bytes_break_the_parser(raw: bytes) -> None:
    status = 200
    try:
        parse_request_head(raw + b"\r\n\r\n")
    except HeadError as err:
        status = err.status
    assert 200 <= status < 600


def test_response_framing() -> None:
    def framing(raw: bytes, method: bytes = b"GET") -> Body:
        return parse_response_head(raw, method=method).framing.body

    assert framing(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n") is Body.LENGTH
    assert framing(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"HEAD") is Body.NONE
    assert framing(b"HTTP/1.1 204 No Content\r\n\r\n") is Body.NONE
    assert framing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") is Body.CHUNKED
    hijacked = b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.docker.raw-stream\r\n\r\n"
    assert framing(hijacked) is Body.UNTIL_CLOSE
    upgraded = parse_response_head(
        b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n", method=b"POST"
    )
    assert upgraded.status == 101
    assert upgraded.framing.body is Body.NONE
    with pytest.raises(HeadError) as caught:
        parse_response_head(b"SSH-2.0-OpenSSH\r\n\r\n", method=b"GET")
    assert caught.value.status == 502


@pytest.mark.parametrize(
    ("line", "size"), [(b"0\r\n", 0), (b"1a\r\n", 26), (b"FF;ext=1\r\n", 255), (b"10 \r\n", 16)]
)
def test_chunk_sizes(line: bytes, size: int) -> None:
    assert chunk_size(line) == size


@pytest.mark.parametrize(
    "line", [b"\r\n", b"x\r\n", b"-1\r\n", b"10", b"1" * 16 + b"\r\n", b"0x10\r\n", b"a" * 2000]
)
def test_bad_chunk_sizes(line: bytes) -> None:
    with pytest.raises(HeadError):
        chunk_size(line)
