"""The engine socket's forwarding, against an in-process fake engine on a unix socket:
bytes unchanged both ways (chunked bodies, streamed answers, a hijack with its half close),
hostile requests answered without reaching the engine, GPU creates leased and rewritten,
and a lease given back when the engine refuses the create."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.api.leases import Cpusets
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.site import EngineSocket, serve_engine_socket
from agent.leases.answers import Granted
from agent.leases.asks import Ask
from agent.leases.holders import Lease
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from tests.support.unix_server import Handler, serving
from tests.unit.leases.nodes import build_node, healthy

NODE = build_node([0, 0, 1, 1])


@dataclass
class FakeEngine:
    """Records every byte it reads; answers with ``handler``."""

    path: Path
    handler: Handler
    seen: bytearray = field(default_factory=bytearray)
    connections: int = 0


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[FakeEngine, EngineSocket, LeaseService]]:
    engine = FakeEngine(tmp_path / "engine.sock", handler=lambda r, w: asyncio.sleep(0))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.connections += 1
        await engine.handler(reader, writer)

    async with serving(engine.path, serve):
        leases = LeaseService.open(NODE, healthy(NODE), LeaseSettings(), None)
        facts = NodeFacts(NODE, ("/dev/nvidiactl", "/dev/nvidia-uvm"))
        creates = GpuCreates(leases, lambda: facts, Cpusets(tmp_path / "no-sysfs"))
        site = await serve_engine_socket(
            tmp_path / "ours.sock", engine.path, creates, head_timeout_s=2.0, max_connections=64
        )
        yield engine, site, leases
        await site.close()
        await leases.close()


async def exchange(site: EngineSocket, data: bytes, *, half_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(data)
    if half_close:
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_the_socket_takes_the_engines_mode(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world
    assert site.path.stat().st_mode & 0o777 == engine.path.stat().st_mode & 0o777


async def test_a_chunked_request_and_a_streamed_answer_pass_unchanged(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world
    request = (
        b"POST /build?t=x HTTP/1.1\r\nHost: docker\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext\r\nhello\r\n3\r\n!!!\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{}\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.seen += await reader.readexactly(len(request))
        writer.write(answer)
        await writer.drain()

    engine.handler = handler
    assert await exchange(site, request) == answer
    assert bytes(engine.seen) == request


async def test_keep_alive_requests_share_one_engine_connection(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
            await writer.drain()

    engine.handler = handler
    ping = b"GET /_ping HTTP/1.1\r\nHost: docker\r\n\r\n"
    answers = await exchange(site, ping * 3)
    assert answers.count(b"HTTP/1.1 200 OK") == 3
    assert engine.connections == 1


async def test_a_hijack_pumps_both_ways_and_passes_the_half_close_on(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
        while data := await reader.read(1024):  # echo, then a last word after the EOF
            writer.write(data)
        writer.write(b"[the end]")
        await writer.drain()

    engine.handler = handler
    attach = (
        b"POST /containers/x/attach?stream=1&stdin=1 HTTP/1.1\r\nConnection: Upgrade\r\n"
        b"Upgrade: tcp\r\n\r\nGET / HTTP/1.1 is just stdin here\r\n\r\n"
    )
    answer = await exchange(site, attach)
    assert answer.endswith(b"\r\n\r\nGET / HTTP/1.1 is just stdin here\r\n\r\n[the end]")


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n", b"400"),  # truncated, then EOF
        (b"GET / HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", b"431"),
        (b"BREW / HTCPCP/1.0\r\n\r\n", b"505"),
        (b"POST /containers/create HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope", b"400"),
        (b"POST /containers/create HTTP/1.1\r\nContent-Length: 5000000\r\n\r\n", b"413"),
        (
            b"POST /v1.41/containers/create HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"400",
        ),
    ],
)
async def test_hostile_requests_never_reach_the_engine(
    world: tuple[FakeEngine, EngineSocket, LeaseService], data: bytes, status: bytes
) -> None:
    engine, site, _ = world
    answer = await exchange(site, data)
    assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:80]
    assert b'{"message": "' in answer
    assert engine.connections == 0


async def test_bad_chunked_framing_mid_stream_closes_the_connection(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.seen += await reader.read()

    engine.handler = handler
    await exchange(site, b"POST /build HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX")
    assert engine.connections == 1  # the head went on; the broken chunk ended it


async def test_a_head_that_never_ends_times_out_alone(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
        await writer.drain()
        writer.close()  # closed here, not left to the collector (an unclosed-socket warning)
        await writer.wait_closed()

    engine.handler = handler
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(b"GET /_ping HTTP/1.1\r\n")  # and no more
    other = await exchange(site, b"GET /_ping HTTP/1.1\r\n\r\n")
    assert other.startswith(b"HTTP/1.1 200 OK")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the head timeout
    writer.close()
    await writer.wait_closed()


def create(body: object) -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST /v1.41/containers/create?name=job HTTP/1.1\r\nHost: docker\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw
    )


GPUS_2 = {"Image": "x", "HostConfig": {"DeviceRequests": [{"Count": 2, "Capabilities": [["gpu"]]}]}}


def creates_every_container(engine: FakeEngine) -> list[dict[str, object]]:
    """The engine answers each create 201; the bodies it was sent, as they come."""
    bodies: list[dict[str, object]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        bodies.append(json.loads(body))
        writer.write(b'HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\n{"Id":"a"}')
        await writer.drain()

    engine.handler = handler
    return bodies


def lease_labels(lease: Lease) -> dict[str, str]:
    """The labels a create through the socket named ``job`` gets for ``lease``."""
    return {
        "nvidia-docker.lease": lease.id,
        "nvidia-docker.lease.devices": ",".join(lease.units),
        "nvidia-docker.lease.mode": "exclusive",
        "nvidia-docker.lease.owner": '{"via":"engine-socket","name":"job"}',
    }


async def test_a_gpu_create_is_leased_and_rewritten(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    bodies = creates_every_container(engine)
    answer = await exchange(site, create(GPUS_2))
    assert answer.startswith(b"HTTP/1.1 201 ")
    (lease,) = leases.view().leases
    host = bodies[0]["HostConfig"]
    assert isinstance(host, dict)
    assert host["DeviceRequests"] is None
    devices = [d["PathOnHost"] for d in host["Devices"]]
    assert devices[:2] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert len(devices) == 4
    assert bodies[0]["Labels"] == lease_labels(lease)


async def test_a_create_without_gpus_passes_unchanged(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    request = create({"Image": "x", "HostConfig": {"Memory": 1}})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        engine.seen += head + body
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    engine.handler = handler
    await exchange(site, request)
    assert bytes(engine.seen) == request
    assert not leases.view().leases


async def test_an_engine_refusal_gives_the_lease_back(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    refusal = b'HTTP/1.1 404 Not Found\r\nContent-Length: 27\r\n\r\n{"message":"No such image"}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(refusal)
        await writer.drain()

    engine.handler = handler
    assert await exchange(site, create(GPUS_2)) == refusal
    assert not leases.view().leases


async def test_a_create_that_cannot_get_its_gpus_is_answered_here(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, _ = world
    five = {"Image": "x", "HostConfig": {"DeviceRequests": [{"Driver": "nvidia", "Count": 5}]}}
    answer = await exchange(site, create(five))
    assert answer.startswith(b"HTTP/1.1 409 Conflict\r\n")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert message.startswith("nvidia-docker: ")
    assert "\n" not in message
    assert engine.connections == 0


def waiting_create(seconds: str) -> bytes:
    return create({**GPUS_2, "Labels": {"nvidia-docker.lease.wait": seconds, "app": "train"}})


async def take_every_gpu(leases: LeaseService) -> Granted:
    granted = await leases.ask(Ask(count=4))
    assert isinstance(granted, Granted)
    return granted


async def queued(leases: LeaseService, count: int = 1) -> None:
    """Until ``count`` asks wait (5 s at most: the queue moves within a few loop turns)."""
    for _ in range(500):
        if len(leases.view().waiting) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waiting asks: {leases.view().waiting}")


async def test_a_create_that_may_wait_gets_the_gpus_another_gives_back(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    bodies = creates_every_container(engine)
    holder = await take_every_gpu(leases)
    # half closed after the create, as some clients do: still there, still waiting
    answering = asyncio.ensure_future(exchange(site, waiting_create("30")))
    await queued(leases)
    assert engine.connections == 0
    assert not answering.done()
    leases.release(holder.lease.id)
    answer = await asyncio.wait_for(answering, 10)
    assert answer.startswith(b"HTTP/1.1 201 ")
    (lease,) = leases.view().leases
    assert bodies[0]["Labels"] == {
        "nvidia-docker.lease.wait": "30",
        "app": "train",
        **lease_labels(lease),
    }


async def test_a_create_whose_wait_ends_is_answered_in_one_line(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    await take_every_gpu(leases)
    answer = await exchange(site, waiting_create("0.3"))
    assert answer.startswith(b"HTTP/1.1 409 Conflict\r\n")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert message.startswith("nvidia-docker: ")
    assert "waited" in message, message
    assert "\n" not in message
    assert engine.connections == 0
    assert not leases.view().waiting


async def test_a_client_that_leaves_while_its_create_waits_leaves_the_queue(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    engine, site, leases = world
    holder = await take_every_gpu(leases)
    _reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(waiting_create("60"))
    await queued(leases)
    writer.close()  # the docker CLI killed, say
    await writer.wait_closed()
    await queued(leases, 0)
    leases.release(holder.lease.id)
    assert engine.connections == 0  # nothing created for nobody
    assert not leases.view().leases


@pytest.mark.parametrize("seconds", ["soon", "-1", "601", "nan", "", "1e9"])
async def test_a_wait_label_that_is_not_seconds_is_refused_in_one_line(
    world: tuple[FakeEngine, EngineSocket, LeaseService], seconds: str
) -> None:
    engine, site, leases = world
    answer = await exchange(site, waiting_create(seconds))
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert message.startswith("nvidia-docker: the label nvidia-docker.lease.wait="), message
    assert "0 to 600" in message, message
    assert engine.connections == 0
    assert not leases.view().leases


async def test_an_engine_that_is_down_is_said_in_one_line(tmp_path: Path) -> None:
    site = await serve_engine_socket(
        tmp_path / "ours.sock",
        tmp_path / "nobody.sock",
        None,
        head_timeout_s=2.0,
        max_connections=64,
    )
    try:
        answer = await exchange(site, b"GET /_ping HTTP/1.1\r\n\r\n")
    finally:
        await site.close()
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert b"Cannot connect to the Docker daemon at unix://" in answer
    assert not (tmp_path / "ours.sock").exists()


async def test_a_client_that_leaves_while_the_engine_creates_keeps_the_lease(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """The docker CLI killed (Ctrl-C) after its create went on: the engine still creates
    the container, whose GPUs stay leased (not given to the next create)."""
    engine, site, leases = world
    client_left = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await client_left.wait()
        writer.write(b'HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\n{"Id":"a"}')
        await writer.drain()
        await reader.read()

    engine.handler = handler
    _reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(create(GPUS_2))
    for _ in range(500):
        if leases.view().leases:
            break
        await asyncio.sleep(0.01)
    writer.close()
    await writer.wait_closed()
    client_left.set()
    for _ in range(50):  # the proxy relays the answer to nobody, then ends the connection
        await asyncio.sleep(0.01)
    assert len(leases.view().leases) == 1


async def test_a_stream_the_engine_breaks_off_reaches_the_client_as_it_was_sent(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """dockerd stopped during ``docker events`` or ``logs -f``: the client gets the chunks
    the engine sent, then the end of the connection (as from the engine itself), never an
    answer of the socket's own inside the stream."""
    engine, site, _ = world
    sent = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sent)
        await writer.drain()

    engine.handler = handler
    assert await exchange(site, b"GET /v1.41/events HTTP/1.1\r\nHost: docker\r\n\r\n") == sent


async def test_a_device_entry_the_engine_would_refuse_gets_the_engines_answer(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """A GPU create whose ``HostConfig.Devices`` holds a ``PathOnHost`` that is not a
    string: the engine's own refusal reaches the client, and no lease is left."""
    engine, site, leases = world
    refusal = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 17\r\n\r\n{"message":"bad"}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(refusal)
        await writer.drain()

    engine.handler = handler
    requests = GPUS_2["HostConfig"]["DeviceRequests"]  # type: ignore[index]
    host = {"DeviceRequests": requests, "Devices": [{"PathOnHost": ["/dev/fuse"]}]}
    assert await exchange(site, create({"Image": "x", "HostConfig": host})) == refusal
    assert not leases.view().leases


async def test_a_client_that_leaves_a_quiet_stream_ends_the_engines_connection(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """``docker events`` (or ``logs -f``, ``wait``) killed while nothing comes: the engine's
    connection ends too (as when the client talks to the engine itself), and the client's
    connection is no longer counted against --engine-connections."""
    engine, site, _ = world
    engine_saw_the_end = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()  # nothing more to say until the client leaves
        engine_saw_the_end.set()

    engine.handler = handler
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(b"GET /v1.41/events HTTP/1.1\r\nHost: docker\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(engine_saw_the_end.wait(), 2)
    for _ in range(100):
        if site.open_connections == 0:
            break
        await asyncio.sleep(0.01)
    assert site.open_connections == 0


async def test_a_create_that_expects_100_continue_gets_it_then_its_answer(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """curl sends ``Expect: 100-continue`` with a large body and waits for it (a second)
    before it sends the body: the socket says ``100 Continue`` itself, and the engine gets
    the body with no ``Expect`` (it would answer another ``100``)."""
    engine, site, leases = world
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(b'HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\n{"Id":"a"}')
        await writer.drain()

    engine.handler = handler
    head, _, body = create(GPUS_2).partition(b"\r\n\r\n")
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(head + b"\r\nExpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.9)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 201 Created\r\n")
    assert b"expect" not in heads[0].lower()
    assert len(leases.view().leases) == 1


@pytest.mark.parametrize(
    "start",
    [b"POST /containers/create HTTP/1.1\r\nConnection: close", b"POST /containers/create HTTP/1.0"],
)
async def test_a_create_refused_here_closes_when_the_client_asked_for_it(
    world: tuple[FakeEngine, EngineSocket, LeaseService], start: bytes
) -> None:
    """A client that asks the connection to close after its answer (HTTP/1.0, or
    ``Connection: close``, and reads to the end) gets the end with the socket's own 409,
    not after the idle timeout."""
    _, site, _ = world
    raw = json.dumps({"HostConfig": {"DeviceRequests": [{"Driver": "nvidia", "Count": 5}]}})
    request = start + b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw.encode()
    answer = await asyncio.wait_for(exchange(site, request, half_close=False), 1)
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 409 Conflict\r\n")
    assert b"\r\nConnection: close" in head


async def test_a_create_too_large_gets_its_413_while_its_body_still_comes(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    """A client that sends its whole body before it reads (Python's http.client, docker-py)
    gets the 413, not a broken pipe: the socket reads and drops the rest of the body."""
    engine, site, _ = world
    size = 5 * 1024 * 1024
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(b"POST /containers/create HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % size)
    for _ in range(size // 65536):
        writer.write(b" " * 65536)
        await asyncio.wait_for(writer.drain(), 5)  # a broken pipe here without the fix
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 413 "), answer[:80]
    assert b"\r\nConnection: close" in head
    assert b"larger than 4194304 bytes" in answer
    assert engine.connections == 0


async def test_a_create_too_large_that_expects_100_continue_gets_only_the_413(
    world: tuple[FakeEngine, EngineSocket, LeaseService],
) -> None:
    _, site, _ = world
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(
        b"POST /containers/create HTTP/1.1\r\nContent-Length: 5000000\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    answer = await asyncio.wait_for(reader.read(), 1)  # its end comes with it
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413 ")
