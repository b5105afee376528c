"""Everything read from an engine is bounded: the client against answers at and past each bound.

A small asyncio server on a unix socket of the test answers what each test says; the agent
as a real process under a memory limit is tests/e2e/test_engine_hostile.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agent.attribution.cgroup import OwnerKind
from agent.attribution.docker_engine import (
    MAX_ANSWER_BYTES,
    MAX_CONCURRENT,
    MAX_DEPTH,
    MAX_HEAD_BYTES,
    MAX_IMAGE_CHARS,
    MAX_ITEMS,
    MAX_NAME_CHARS,
    BadAnswer,
    ContainerFacts,
    DockerEngine,
    DockerEngineError,
    bounded_text,
    parse_answer,
)
from agent.attribution.owners import Attributor, ProcessOwner
from tests.support.unix_server import Handler, serving

ID = "8f3c2b1a" * 8
OTHER = "0123abcd" * 8


@asynccontextmanager
async def engine_at(tmp_path: Path, handler: Handler) -> AsyncIterator[DockerEngine]:
    """A client of a server on a unix socket that answers each request with ``handler``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await handler(reader, writer)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client hung up: what these tests expect of a bad answer

    async with serving(tmp_path / "engine.sock", serve):
        engine = DockerEngine(tmp_path / "engine.sock", timeout_s=10)
        try:
            yield engine
        finally:
            await engine.close()


def answering(*pieces: bytes) -> Handler:
    async def handler(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()

    return handler


def body_of(size: int, name: str = "/trainer") -> bytes:
    """A container answer of exactly ``size`` bytes (padded in an ignored field)."""
    start = json.dumps({"Id": ID, "Name": name, "Config": {"Image": "trainer:1"}, "Pad": ""})
    body = start[:-2] + "a" * (size - len(start)) + start[-2:]
    assert len(body) == size
    return body.encode()


def chunked(body: bytes, piece: int = 65536) -> bytes:
    pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


OK = ContainerFacts(ID, "trainer", "trainer:1")
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
TO_THE_END = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"


async def inspect(tmp_path: Path, *pieces: bytes) -> ContainerFacts | None:
    async with engine_at(tmp_path, answering(*pieces)) as engine:
        return await engine.inspect(ID)


async def refusal(tmp_path: Path, *pieces: bytes) -> str:
    with pytest.raises(BadAnswer) as refused:
        await inspect(tmp_path, *pieces)
    message = str(refused.value)
    assert message.startswith(f"the Docker engine at unix://{tmp_path}/engine.sock gave no ")
    assert message.isprintable()
    return message.partition(f"about container {ID[:12]}: ")[2]


# -- the answer's size, however it is framed ------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [
        lambda body: [LENGTH % len(body), body],
        lambda body: [CHUNKED, chunked(body)],
        lambda body: [TO_THE_END, body],
    ],
    ids=["content-length", "chunked", "to-the-end"],
)
async def test_an_answer_of_the_bound_is_read_one_byte_more_is_not(
    tmp_path: Path, framing: Callable[[bytes], list[bytes]]
) -> None:
    # chunk framing counts in the bound: the largest chunked body is a little smaller
    largest = MAX_ANSWER_BYTES - (1024 if framing(b"")[0] == CHUNKED else 0)
    assert await inspect(tmp_path, *framing(body_of(largest))) == OK
    too_large = await refusal(tmp_path, *framing(body_of(MAX_ANSWER_BYTES + 1)))
    assert too_large.startswith("it is larger than 4 MiB")


async def test_a_content_length_past_the_bound_is_refused_before_any_body(tmp_path: Path) -> None:
    """The server sends the head only, and waits: a client that read on would time out."""
    for length in (MAX_ANSWER_BYTES + 1, 10**30):

        async def head_only(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(LENGTH % length)  # noqa: B023 (awaited within the iteration)
            await writer.drain()
            await asyncio.Event().wait()

        async with engine_at(tmp_path, head_only) as engine:
            with pytest.raises(BadAnswer) as refused:
                await engine.inspect(ID)
        shown = "a 31-digit number" if length == 10**30 else f"{length} bytes"
        assert str(refused.value).endswith(
            f"it is larger than 4 MiB (its Content-Length says {shown})"
        )


async def test_an_endless_chunked_answer_stops_at_the_bound(tmp_path: Path) -> None:
    async def endless(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED)
        while True:
            writer.write((b"64\r\n" + b"a" * 100 + b"\r\n") * 100)  # small: framing counts
            await writer.drain()

    async with engine_at(tmp_path, endless) as engine:
        with pytest.raises(BadAnswer, match="it is larger than 4 MiB"):
            await engine.inspect(ID)


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ([CHUNKED, b"f" * 17 + b"\r\n"], "one of its chunks is malformed"),
        ([CHUNKED, b"zz\r\n"], "one of its chunks is malformed"),
        ([CHUNKED, b"2\r\n{}XX0\r\n\r\n"], "one of its chunks is malformed"),
        ([CHUNKED, b"1;" + b"x" * MAX_HEAD_BYTES], "one of its chunks is malformed"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"], "not chunked"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n"], "is not a number"),
        (
            [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"],
            "two different Content-Lengths",
        ),
        ([LENGTH % 1000, b'{"Name": "/tr'], "it ended early"),
        ([b"HTTP/1.1 200 OK\r\n"], "it ended early"),
        ([b"SSH-2.0-OpenSSH_9.2p1\r\n\r\n"], "it is not HTTP"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "one of its headers is malformed"),
    ],
)
async def test_a_broken_answer_is_one_line_saying_what(
    tmp_path: Path, pieces: list[bytes], why: str
) -> None:
    assert why in await refusal(tmp_path, *pieces)


async def test_the_head_is_bounded(tmp_path: Path) -> None:
    status = b"HTTP/1.1 200 OK\r\n"
    filler = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    fits = (
        status + filler * ((MAX_HEAD_BYTES - 200) // len(filler)) + b"Content-Length: 2\r\n\r\n{}"
    )
    assert len(fits) < MAX_HEAD_BYTES
    assert await inspect(tmp_path, fits) == ContainerFacts(ID, None, None)
    for head in (
        status + filler * 100,
        status + b"X-N: 1\r\n" * 100_000,
        b"HTTP/1.1 200 " + b"K" * 10**6,
    ):
        assert await refusal(tmp_path, head) == "its headers are larger than 64 KiB"  # fmt: skip


async def test_what_is_not_a_bad_answer(tmp_path: Path) -> None:
    """No such container, and an engine that says it failed: not bounds of this module."""
    assert await inspect(tmp_path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n") is None
    with pytest.raises(DockerEngineError, match=r"answered HTTP 500$") as failed:
        await inspect(tmp_path, b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n")
    assert not isinstance(failed.value, BadAnswer)


async def test_a_trickling_answer_times_out(tmp_path: Path) -> None:
    async def trickle(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(LENGTH % 100)
        await writer.drain()
        await asyncio.Event().wait()  # never more: the client's timeout ends it

    async with engine_at(tmp_path, trickle) as engine:
        engine.timeout_s = 0.2
        with pytest.raises(DockerEngineError, match=r"did not answer within 0\.2 s"):
            await engine.inspect(ID)


async def test_at_most_a_few_requests_to_one_engine_at_a_time(tmp_path: Path) -> None:
    in_flight, most = 0, 0
    full = asyncio.Event()

    async def held(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == MAX_CONCURRENT:
            full.set()
        await full.wait()  # every slot taken: a request past the bound would be here now
        body = body_of(200)
        writer.write(LENGTH % len(body) + body)
        await writer.drain()
        in_flight -= 1

    async with engine_at(tmp_path, held) as engine:
        answers = await asyncio.gather(*(engine.inspect(ID) for _ in range(3 * MAX_CONCURRENT)))
    assert answers == [OK] * (3 * MAX_CONCURRENT)
    assert most == MAX_CONCURRENT


# -- the JSON ------------------------------------------------------------------------------


def nested(levels: int, opening: str = "[", closing: str = "]") -> bytes:
    return (opening * levels + closing * levels).encode()


def test_depth_up_to_the_bound() -> None:
    assert parse_answer(nested(MAX_DEPTH)) is not None
    assert parse_answer(nested(MAX_DEPTH, '{"a":', "}").replace(b"}", b"1}", 1)) is not None
    for deep in (nested(MAX_DEPTH + 1), nested(MAX_DEPTH + 1, '{"a":', "}"), nested(60_000)):
        with pytest.raises(BadAnswer, match=f"its JSON nests deeper than {MAX_DEPTH} levels"):
            parse_answer(deep)


def test_brackets_in_strings_are_no_structure() -> None:
    text = {"Name": "[[[[" * 100 + '\\"{{{{' * 100, "Labels": {"x": "]]]]" * 100}}
    assert parse_answer(json.dumps(text).encode()) == text


def test_items_up_to_the_bound() -> None:
    # an object holding a list: 2 brackets; n items in the list: n - 1 commas, + 0 brackets
    fits = b'{"a": [%s]}' % b",".join([b"0"] * (MAX_ITEMS - 1))
    assert len(parse_answer(fits)["a"]) == MAX_ITEMS - 1  # type: ignore[index]
    with pytest.raises(BadAnswer, match=f"it has more than {MAX_ITEMS} JSON items"):
        parse_answer(b'{"a": [%s]}' % b",".join([b"[]"] * MAX_ITEMS))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"Name": "/\xff"}', "it is not UTF-8 (at byte 11)"),
        (b"\xef\xbb\xbf{}", "it is not valid JSON (line 1, column 1)"),  # a BOM
        (b'{"Name": 1%s}' % (b"2" * 5000), "it is not valid JSON (a value is too large)"),
        (b"]" * MAX_ANSWER_BYTES, "it is not valid JSON (more brackets close than open)"),
        (b"[" * 30 + b'"' + b'\\"' * 10**6, "it is not valid JSON (line 1, column 31)"),
        (b'{"a": "unterminated', "it is not valid JSON (line 1, column 7)"),
    ],
    ids=["not-utf-8", "bom", "long-number", "closes", "escaped-quotes", "unterminated"],
)
def test_what_no_parser_sees(raw: bytes, why: str) -> None:
    """Each refused as one line; the escaped quotes in linear time (a backtracking scan of
    them takes hours, past this test's time limit)."""
    with pytest.raises(BadAnswer) as refused:
        parse_answer(raw, "answer")
    assert str(refused.value) == f"answer: {why}"


async def test_not_a_container(tmp_path: Path) -> None:
    for body in (b"[1, 2, 3]", b'"trainer"', b"null"):
        assert await refusal(tmp_path, LENGTH % len(body), body) == (
            "it is not a JSON object (a container)"
        )


# -- the fields ----------------------------------------------------------------------------


def test_bounded_text() -> None:
    assert bounded_text("trainer", 8) == "trainer"
    assert bounded_text("", 8) is None
    assert bounded_text("trainers", 8) == "trainers"
    assert bounded_text("trainers!", 8) == "trainer…"
    assert bounded_text("a\nb", 8) == r"a\x0ab"
    assert bounded_text("ab\ncd", 8) == r"ab\x0acd"  # 8 characters, escape included
    assert bounded_text("abc\nd", 7) == "abc…"  # never cut inside an escape ("abc\x0…")
    assert bounded_text("\u2028\u202e\x85\U000e0001", 40) == r"\u2028\u202e\x85\U000e0001"
    long = bounded_text("\x1b" * 10**6, MAX_NAME_CHARS)
    assert long is not None
    assert len(long) <= MAX_NAME_CHARS
    assert long.isprintable()


@pytest.mark.parametrize(
    ("answer", "facts"),
    [
        (
            {"Id": ID, "Name": "/" + "n" * 10**5, "Config": {"Image": "i" * 10**5}},
            ContainerFacts(ID, "n" * (MAX_NAME_CHARS - 1) + "…", "i" * (MAX_IMAGE_CHARS - 1) + "…"),
        ),
        (
            {
                "Id": ID,
                "Name": "/" + "n" * MAX_NAME_CHARS,
                "Config": {"Image": "i" * MAX_IMAGE_CHARS},
            },
            ContainerFacts(ID, "n" * MAX_NAME_CHARS, "i" * MAX_IMAGE_CHARS),
        ),
        (
            {"Id": ID, "Name": "/evil\r\n# TYPE x counter", "Config": {"Image": "img\x1b[31m"}},
            ContainerFacts(ID, r"evil\x0d\x0a# TYPE x counter", r"img\x1b[31m"),
        ),
        (
            {"Id": {"x": 1}, "Name": 42, "Config": {"Image": ["trainer:1"]}},
            ContainerFacts(ID, None, None),
        ),
        ({"Id": "x" * 64, "Name": "/", "Config": "trainer:1"}, ContainerFacts(ID, None, None)),
        ({"Id": OTHER, "Name": ["/trainer"]}, ContainerFacts(OTHER, None, None)),
    ],
    ids=["huge", "at-the-bound", "control-characters", "not-strings", "odd", "other-id"],
)
async def test_fields_are_cut_escaped_or_left_out(
    tmp_path: Path, answer: dict[str, object], facts: ContainerFacts
) -> None:
    body = json.dumps(answer).encode()
    assert await inspect(tmp_path, LENGTH % len(body), body) == facts


# -- what the attributor makes of a bad answer ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedEngine(DockerEngine):
    """An engine whose answers the test sets per container id (raise, or facts)."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path / "scripted.sock")
        self.answers: dict[str, ContainerFacts | Exception] = {}
        self.asked: list[str] = []

    async def inspect(self, container_id: str) -> ContainerFacts | None:
        self.asked.append(container_id)
        answer = self.answers[container_id]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    for pid, cid in ((10, ID), (11, OTHER)):
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(f"0::/docker/{cid}\n")
    return root


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_bad_answer_costs_its_container_only_and_is_logged_once_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = ScriptedEngine(tmp_path)
    clock = Clock()
    attributor = Attributor(engine, proc=_proc(tmp_path), ttl_s=20, retry_s=30, clock=clock)
    bad = BadAnswer("the Docker engine gave no usable answer about container 8f3c: too deep")
    engine.answers = {ID: bad, OTHER: ContainerFacts(OTHER, "other", "other:1")}
    owners = await attributor.owners([10, 11])  # t=1000: ID bad (a line), OTHER named
    assert owners[10] == ProcessOwner(OwnerKind.DOCKER, container_id=ID)
    assert owners[11].container_name == "other"  # the engine is not down for the others
    assert (attributor.lookups, attributor.lookup_failures) == (2, 1)
    await attributor.owners([10, 11])
    assert sorted(engine.asked) == sorted([ID, OTHER])  # a bad one is not asked at once
    clock.now += 31  # both are asked again (ttl_s, retry_s), and both answers are bad:
    engine.answers[OTHER] = bad  # a line for the first, the second held back
    owners = await attributor.owners([10, 11])
    assert owners[11].container_name == "other"  # what was known is kept
    await attributor.owners([10, 11])
    assert (attributor.lookups, attributor.lookup_failures) == (4, 3)
    clock.now += 31  # both bad again: a line that says one was held back, one held back
    await attributor.owners([10, 11])
    assert (attributor.lookups, attributor.lookup_failures) == (6, 5)
    await attributor.close()
    line = (
        f"{bad}; the container is shown with its id only (no name, no image), asked again in 30 s"
    )
    assert _warnings(caplog) == [line, line, f"{line}; 1 more such answer since the last line"]


async def test_an_unexpected_error_is_one_line_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    engine = ScriptedEngine(tmp_path)
    engine.answers = {ID: RecursionError("maximum recursion depth\nexceeded"), OTHER: OK}
    attributor = Attributor(engine, proc=_proc(tmp_path), clock=Clock())
    owners = await attributor.owners([10])
    await attributor.close()
    assert owners[10] == ProcessOwner(OwnerKind.DOCKER, container_id=ID)
    assert attributor.lookup_failures == 1
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.exc_info is None
    assert warning.getMessage().isprintable()
    assert "failed unexpectedly (RecursionError: maximum recursion depth\\x0aexceeded" in (
        warning.getMessage()
    )
    debug = [r for r in caplog.records if r.name.endswith(".attribution") and r.levelno == 10]
    assert [r.exc_info is not None for r in debug] == [True]
