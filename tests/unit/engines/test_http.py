"""The engine client's streams: lines by every framing, each bounded; and its shared bounds.

The exchange's bounds for one answer (head, body, JSON) are tested through attribution's
client in tests/unit/attribution/test_engine_bounds.py; here the stream ``GET /events``
needs, and the bounds a caller may choose (a larger body, more items, a parser hook).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agent.attribution import docker_engine
from agent.attribution.docker_engine import DockerEngine
from agent.engines.http import (
    MAX_CONCURRENT,
    MAX_LINE_BYTES,
    BadAnswer,
    EngineClient,
    EngineError,
    parse_answer,
)
from tests.support.fake_engine import CHUNKED_HEAD, chunk
from tests.support.unix_server import Handler, serving

PATH = "/events?filters=%7B%22type%22%3A%5B%22container%22%5D%7D"


@asynccontextmanager
async def served(tmp_path: Path, handler: Handler) -> AsyncIterator[EngineClient]:
    """A client of a unix socket whose every connection ``handler`` answers (after the
    request's head), and which is hung up when the test is done."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await handler(reader, writer)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass

    async with serving(tmp_path / "engine.sock", serve):
        yield EngineClient(tmp_path / "engine.sock", timeout_s=5)


def sending(*pieces: bytes, then_wait: bool = False) -> Handler:
    async def handler(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        if then_wait:
            await asyncio.Event().wait()

    return handler


async def lines_of(tmp_path: Path, *pieces: bytes) -> list[bytes]:
    async with served(tmp_path, sending(*pieces)) as client:
        stream = await client.stream(PATH, "in its event stream")
        try:
            return [line async for line in stream]
        finally:
            await stream.close()


async def stream_error(tmp_path: Path, *pieces: bytes) -> EngineError:
    with pytest.raises(EngineError) as failed:
        await lines_of(tmp_path, *pieces)
    message = str(failed.value)
    assert message.isprintable()
    assert "\n" not in message
    return failed.value


# -- lines, by every framing ----------------------------------------------------------------


LINES = [b'{"Action":"create"}', b'{"Action":"start"}', b'{"Action":"die"}']


async def test_chunked_lines_across_and_within_chunks(tmp_path: Path) -> None:
    text = b"\n".join(LINES) + b"\n"
    # one line split over three chunks, two lines in one chunk, CRLF and blank lines
    pieces = [text[:5], text[5:9], text[9:], b"\r\n\n\n", b'{"Action":"destroy"}\r\n']
    got = await lines_of(tmp_path, CHUNKED_HEAD, *map(chunk, pieces), b"0\r\n\r\n")
    assert got == [*LINES, b'{"Action":"destroy"}']


async def test_content_length_and_close_delimited_bodies(tmp_path: Path) -> None:
    body = b"\n".join(LINES)  # the last line without its newline: still a line
    length = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    assert await lines_of(tmp_path, length, body) == LINES
    to_the_end = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
    assert await lines_of(tmp_path, to_the_end, body) == LINES


async def test_a_line_of_the_bound_is_read_one_byte_more_is_not(tmp_path: Path) -> None:
    longest = b"a" * MAX_LINE_BYTES
    got = await lines_of(tmp_path, CHUNKED_HEAD, chunk(longest + b"\n"), b"0\r\n\r\n")
    assert got == [longest]
    got = await lines_of(tmp_path, CHUNKED_HEAD, chunk(longest + b"\r\n"), b"0\r\n\r\n")
    assert got == [longest]
    for pieces in (
        [chunk(longest + b"a\n")],  # a whole line in one chunk
        [chunk(b"a" * 1000)] * (MAX_LINE_BYTES // 1000 + 1),  # a line that never ends
    ):
        failed = await stream_error(tmp_path, CHUNKED_HEAD, *pieces)
        assert isinstance(failed, BadAnswer)
        assert str(failed).endswith(
            "gave no usable answer in its event stream: a line of it is longer than 64 KiB"
        )


async def test_an_endless_line_is_refused_without_waiting_for_its_end(tmp_path: Path) -> None:
    async def endless(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD)
        while True:
            writer.write(chunk(b"x" * 4096))
            await writer.drain()

    async with served(tmp_path, endless) as client:
        stream = await client.stream(PATH, "in its event stream")
        with pytest.raises(BadAnswer, match="longer than 64 KiB"):
            async for _line in stream:
                pass
        await stream.close()


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ([CHUNKED_HEAD, b"zz\r\n"], "one of its chunks is malformed"),
        ([CHUNKED_HEAD, b"2\r\n{}XX"], "one of its chunks is malformed"),
        ([CHUNKED_HEAD, b"1;" + b"x" * 70_000], "one of its chunks is malformed"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"], "is not chunked"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"], "is not a number"),
        ([b"SSH-2.0-OpenSSH_9.2p1\r\n\r\n"], "it is not HTTP"),
        ([b"HTTP/1.1 200 OK\r\n"], "it ended early"),
    ],
)
async def test_a_broken_stream_is_one_line_saying_what(
    tmp_path: Path, pieces: list[bytes], why: str
) -> None:
    failed = await stream_error(tmp_path, *pieces)
    assert isinstance(failed, BadAnswer)
    assert str(failed).startswith(
        f"the Docker engine at unix://{tmp_path}/engine.sock gave no usable answer in its "
        "event stream: "
    )
    assert why in str(failed)


async def test_an_engine_that_goes_away_mid_stream(tmp_path: Path) -> None:
    """A connection that ends inside a chunk, or before the last chunk: the engine went
    away (an EngineError, not a bad answer); the lines before it were read."""
    for pieces in ([chunk(b"{}\n"), b"20\r\n{}"], [chunk(b"{}\n")]):
        async with served(tmp_path, sending(CHUNKED_HEAD, *pieces)) as client:
            stream = await client.stream(PATH, "in its event stream")
            assert await anext(stream) == b"{}"
            with pytest.raises(EngineError, match=r"closed its stream$") as failed:
                await anext(stream)
            assert not isinstance(failed.value, BadAnswer)
            await stream.close()


async def test_what_is_not_a_stream(tmp_path: Path) -> None:
    for status in (b"404 Not Found", b"500 Oops"):
        answer = b"HTTP/1.1 %s\r\nContent-Length: 0\r\n\r\n" % status
        async with served(tmp_path, sending(answer)) as client:
            with pytest.raises(EngineError, match=rf"answered HTTP {status[:3].decode()}$"):
                await client.stream(PATH, "in its event stream")
    with pytest.raises(EngineError, match=r"^cannot reach the Docker engine at unix://"):
        await EngineClient(tmp_path / "none.sock").stream(PATH, "in its event stream")


async def test_opening_is_bounded_in_time_reading_is_not(tmp_path: Path) -> None:
    """No head: the open times out. A head, then silence: the stream waits (an idle engine
    is a blocked read), and the next line is read whenever it comes."""
    async with served(tmp_path, sending(then_wait=True)) as client:
        client.timeout_s = 0.2
        with pytest.raises(EngineError, match=r"did not answer within 0\.2 s$"):
            await client.stream(PATH, "in its event stream")
    later = asyncio.Event()

    async def quiet(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD)
        await writer.drain()
        await later.wait()
        writer.write(chunk(b"{}\n"))
        await writer.drain()
        await asyncio.Event().wait()

    async with served(tmp_path, quiet) as client:
        client.timeout_s = 0.2
        stream = await client.stream(PATH, "in its event stream")
        reading = asyncio.ensure_future(anext(stream))
        # twice the open's timeout: the read still waits, nothing came
        done, _ = await asyncio.wait({reading}, timeout=2 * client.timeout_s)
        assert not done
        later.set()
        assert await reading == b"{}"
        await stream.close()


async def test_streams_take_no_request_slot(tmp_path: Path) -> None:
    """More streams than MAX_CONCURRENT stay open, and a request still gets an answer."""

    body = b"{}"
    answers = iter([*([CHUNKED_HEAD] * (MAX_CONCURRENT + 1)), None])

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = next(answers)
        if head is None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + body)
            return
        await sending(head, then_wait=True)(reader, writer)

    async with served(tmp_path, handler) as client:
        streams = [
            await client.stream(PATH, "in its event stream") for _ in range(MAX_CONCURRENT + 1)
        ]
        answer = await client.get("/containers/json?all=1", "to its container list")
        assert answer is not None
        assert bytes(answer) == body
        for stream in streams:
            await stream.close()


# -- bounds a caller chooses ----------------------------------------------------------------


async def test_a_larger_body_when_the_caller_allows_it(tmp_path: Path) -> None:
    body = b"[" + b",".join([b'"%s"' % (b"a" * 1000)] * 6000) + b"]"  # about 6 MB
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    async with served(tmp_path, sending(answer, body)) as client:
        with pytest.raises(BadAnswer, match="it is larger than 4 MiB"):
            await client.get("/containers/json?all=1", "to its container list")
        got = await client.get("/containers/json?all=1", "to it", max_bytes=8 * 1024 * 1024)
        assert got is not None
        assert bytes(got) == body


def test_items_and_a_hook_the_caller_chooses() -> None:
    body = json.dumps([{"Id": "a", "Labels": {"x": "y"}}, {"Id": "b", "Mounts": [{}] * 10}])
    assert parse_answer(body.encode(), max_items=40) == json.loads(body)
    with pytest.raises(BadAnswer, match="it has more than 10 JSON items"):
        parse_answer(body.encode(), "answer", max_items=10)

    def ids_only(pairs: list[tuple[str, object]]) -> object:
        return dict(p for p in pairs if p[0] == "Id") or None

    assert parse_answer(body.encode(), object_pairs_hook=ids_only) == [{"Id": "a"}, {"Id": "b"}]


def test_attributions_client_is_the_engine_client() -> None:
    """One client per engine: the one the server builds for attribution is the one the
    lease wiring takes; its refusals are the same classes."""
    assert issubclass(DockerEngine, EngineClient)
    assert docker_engine.DockerEngineError is EngineError
    assert docker_engine.BadAnswer is BadAnswer
