"""A hostile container engine against the real agent, under a 256 MB memory cgroup.

Issue 11, item 4: an engine socket's answer could kill the agent (a 100 MB container name
got it killed out of memory, the plugin socket with it), a 1 MB name made every scrape
164 MB, JSON nested deep logged a traceback per lookup. Here a fake engine
(``tests.support.hostile_engine``) serves both the Docker and the Podman socket of a real
agent process whose simulated GPUs run two processes placed in a Docker and a Podman
container's cgroup; each case gives the agent one kind of bad answer: huge (by
Content-Length, chunked, to the end of the connection), endless, slow, a huge head, deep or
crowded JSON, fields that are huge, full of control characters or not strings.

Whatever the answer, the agent runs on inside 256 MB (no OOM kill in its cgroup, which
holds its GPU worker too), both its servers answer, its log has no traceback and at most
one line per engine, and what reaches /metrics and /gpu/processes/json is bounded and
printable: the containers by id, with their name and image only where the answer allowed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.agent_process import AgentProcess, running_agent
from tests.support.hostile_engine import Answer, container_process, hostile_engine
from tests.support.memory_cgroup import memory_cgroup
from tests.support.node_files import with_processes

pytestmark = pytest.mark.e2e

MEMORY_LIMIT = 256 * 1024 * 1024
MAX_NAME_CHARS, MAX_IMAGE_CHARS = 256, 512  # docs/metrics.md, "What the agent reads ..."
DOCKER_ID = "d0c4e7" + "1" * 58
PODMAN_ID = "90d3a4" + "2" * 58
MB = 1_000_000
PIECE = 64 * 1024
TRICKLE_S = 0.05  # between two bytes of a trickling answer: 2 s (the timeout) is 40 bytes


# -- answers ------------------------------------------------------------------------------


def repeated(unit: bytes, total: int) -> Iterator[bytes]:
    """``total`` bytes of ``unit`` repeated, in pieces of about 64 KiB (never held whole)."""
    piece = unit * max(1, PIECE // len(unit))
    while total > 0:
        yield piece[:total]
        total -= len(piece)


def forever(piece: bytes) -> Iterator[bytes]:
    while True:
        yield piece


def head(*headers: str, status: str = "200 OK") -> bytes:
    return "".join(f"{line}\r\n" for line in (f"HTTP/1.1 {status}", *headers, "")).encode()


def container(name: object, image: object) -> bytes:
    return json.dumps({"Id": DOCKER_ID, "Name": name, "Config": {"Image": image}}).encode()


def with_length(body: bytes) -> Answer:
    return lambda _path: [head(f"Content-Length: {len(body)}"), body]


def huge_name(size: int) -> tuple[int, Callable[[], Iterator[bytes]]]:
    """A container whose name is ``size`` bytes: its length, and its pieces."""
    start, end = b'{"Name": "/', b'", "Config": {"Image": "trainer:1"}}'

    def pieces() -> Iterator[bytes]:
        yield start
        yield from repeated(b"n", size)
        yield end

    return len(start) + size + len(end), pieces


def chunked(pieces: Iterable[bytes]) -> Iterator[bytes]:
    yield head("Transfer-Encoding: chunked")
    for piece in pieces:
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def name_by_content_length(_path: str) -> Iterator[bytes]:
    size, pieces = huge_name(100 * MB)
    yield head(f"Content-Length: {size}")
    yield from pieces()


def content_length_beyond_any(_path: str) -> Iterator[bytes]:
    yield head("Content-Length: 99999999999999999999999999")
    yield container("/trainer", "trainer:1")


def name_chunked(_path: str) -> Iterator[bytes]:
    yield from chunked(huge_name(100 * MB)[1]())


def chunks_forever(_path: str) -> Iterator[bytes]:
    yield from chunked(forever(b"a" * PIECE))


def small_chunks_forever(_path: str) -> Iterator[bytes]:
    yield from chunked(forever(b'"a",' * 256))


def array_to_the_end(_path: str) -> Iterator[bytes]:
    yield head("Connection: close")  # no length, no chunks: the body ends with the connection
    yield b"["
    yield from repeated(b"0,", 100 * MB)


def array_chunked(_path: str) -> Iterator[bytes]:
    yield from chunked([b"[", *repeated(b"[],", 100 * MB), b"[]]"])


def huge_header_line(_path: str) -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\nX-Junk: "
    yield from repeated(b"j", 100 * MB)
    yield b"\r\nContent-Length: 2\r\n\r\n{}"


def many_headers(_path: str) -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\n"
    yield from repeated(b"X-N: 1\r\n", 1_000_000 * 8)


def huge_status_line(_path: str) -> Iterator[bytes]:
    yield b"HTTP/1.1 200 "
    yield from repeated(b"K", 100 * MB)


def trickled(at_once: bytes, slowly: bytes) -> Answer:
    """``at_once``, then ``slowly`` one byte every TRICKLE_S."""

    def answer(_path: str) -> Iterator[bytes]:
        yield at_once
        for index in range(len(slowly)):
            time.sleep(TRICKLE_S)
            yield slowly[index : index + 1]

    return answer


def deep(opening: bytes, closing: bytes, levels: int) -> Answer:
    body = b'{"Name": "/trainer", "Config": {"Image": %s}}' % (opening * levels + closing * levels)
    return with_length(body)


def many_items(count: int) -> Answer:
    body = b'{"Name": "/trainer", "Config": {"Image": "x"}, "Junk": [%s]}' % b",".join(
        [b"[]"] * count
    )
    return with_length(body)


def not_http(_path: str) -> Iterator[bytes]:
    yield b"SSH-2.0-OpenSSH_9.2p1\r\n\r\n"


def ends_early(_path: str) -> Iterator[bytes]:
    yield head("Content-Length: 1000")
    yield b'{"Name": "/tr'


def chunk_size_beyond_any(_path: str) -> Iterator[bytes]:
    yield head("Transfer-Encoding: chunked")
    yield b"f" * 40 + b"\r\n"
    yield from repeated(b"a", 10 * MB)


# -- cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    answer: Answer
    refused: str | None = None  # what the log line of each engine says; None: answered
    name: str | None = None  # what the answered container is called, then
    image: str | None = None


CONTROL_NAME = "/evil\n# TYPE DCGM_FI_DEV_GPU_UTIL counter\r\x1b[31m\x00\x7f\x85"
CONTROL_IMAGE = "img\u2028\u202e:1\t"

CASES = [
    # huge answers, framed each way HTTP allows
    Case("content-length-100MB-name", name_by_content_length, "it is larger than 4 MiB (its "
         f"Content-Length says {huge_name(100 * MB)[0]} bytes)"),
    Case("content-length-beyond-any", content_length_beyond_any, "it is larger than 4 MiB"),
    Case("chunked-100MB-name", name_chunked, "it is larger than 4 MiB"),
    Case("chunked-never-ends", chunks_forever, "it is larger than 4 MiB"),
    Case("chunked-small-chunks-never-end", small_chunks_forever, "it is larger than 4 MiB"),
    Case("chunk-size-beyond-any", chunk_size_beyond_any, "one of its chunks is malformed"),
    Case("array-100MB-to-the-end", array_to_the_end, "it is larger than 4 MiB"),
    Case("array-100MB-chunked", array_chunked, "it is larger than 4 MiB"),
    # huge heads
    Case("header-line-100MB", huge_header_line, "its headers are larger than 64 KiB"),
    Case("headers-1M", many_headers, "its headers are larger than 64 KiB"),
    Case("status-line-100MB", huge_status_line, "its headers are larger than 64 KiB"),
    # deep and crowded JSON
    Case("arrays-40k-deep", deep(b"[", b"]", 40_000), "its JSON nests deeper than 32 levels"),
    Case("objects-40k-deep", deep(b'{"a":', b"}", 40_000),
         "its JSON nests deeper than 32 levels"),
    Case("arrays-200k-deep", deep(b"[", b"]", 200_000), "it has more than 65536 JSON items"),
    Case("items-100k", many_items(100_000), "it has more than 65536 JSON items"),
    # slow, broken, not JSON, not HTTP
    Case("trickled-body", trickled(head("Content-Length: 100"), b"{" * 100),
         "did not answer within 2 s"),
    Case("trickled-head", trickled(b"", head("Content-Length: 2") + b"{}"),
         "did not answer within 2 s"),
    Case("not-http", not_http, "it is not HTTP (is this an engine's API socket?)"),
    Case("ends-early", ends_early, "it ended early"),
    Case("not-utf-8", with_length(b'{"Name": "/\xff\xfe"}'), "it is not UTF-8 (at byte 11)"),
    Case("number-of-5000-digits", with_length(b'{"Name": 1%s}' % (b"2" * 5000)),
         "it is not valid JSON (a value is too large)"),
    Case("not-an-object", with_length(b"[1, 2, 3]"), "it is not a JSON object (a container)"),
    # fields: cut, escaped, or left out
    Case("name-and-image-1MB", with_length(container("/" + "n" * MB, "i" * MB)),
         name="n" * (MAX_NAME_CHARS - 1) + "…", image="i" * (MAX_IMAGE_CHARS - 1) + "…"),
    Case("control-characters", with_length(container(CONTROL_NAME, CONTROL_IMAGE)),
         name=r"evil\x0a# TYPE DCGM_FI_DEV_GPU_UTIL counter\x0d\x1b[31m\x00\x7f\x85",
         image=r"img\u2028\u202e:1\x09"),
    Case("not-strings", with_length(json.dumps(
        {"Id": {"x": 1}, "Name": 42, "Config": {"Image": ["trainer:1"]}}).encode())),
]  # fmt: skip


# -- the agent ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Containers:
    docker_pid: int
    podman_pid: int


@pytest.fixture(scope="module")
def containers() -> Iterator[Containers]:
    with (
        container_process(f"docker-{DOCKER_ID}.scope") as docker_pid,
        container_process(f"libpod-{PODMAN_ID}.scope") as podman_pid,
    ):
        yield Containers(docker_pid, podman_pid)


@dataclass
class Seen:
    """What the agent did with one hostile answer, read while it ran."""

    metrics: tuple[int, bytes] | str  # status and body, or why there was none
    processes: tuple[int, bytes] | str
    plugin: int | str
    alive: bool
    log: str
    oom_kills: int = -1
    peak_bytes: int | None = None  # of the agent's cgroup, where the kernel says it
    docker_asked: tuple[str, ...] = ()
    podman_asked: tuple[str, ...] = ()


def _get(agent: AgentProcess, path: str) -> tuple[int, bytes] | str:
    try:
        status, _headers, body = agent.get(path, timeout_s=30)
    except OSError as err:
        return f"no answer: {err}"
    return status, body


def _observe(agent: AgentProcess) -> Seen:
    metrics = _get(agent, "/metrics")
    processes = _get(agent, "/gpu/processes/json")
    try:
        plugin: int | str = agent.plugin("Plugin.Activate", timeout_s=30)[0]
    except (OSError, ValueError) as err:
        plugin = f"no answer: {err}"
    return Seen(metrics, processes, plugin, agent.alive(), agent.log())


def run_case(base: Path, containers: Containers, answer: Answer) -> Seen:
    """Start an agent under 256 MB with both engine sockets answering ``answer``, and see
    what it serves after the first scrape has asked both engines."""
    processes = {
        0: [(containers.docker_pid, "python3", 1000)],
        1: [(containers.podman_pid, "python3", 2000)],
    }
    node = with_processes("hgx-h200-8", processes, base / "node.json")
    docker_socket, podman_socket = base / "docker.sock", base / "podman.sock"
    with (
        memory_cgroup(MEMORY_LIMIT) as group,
        hostile_engine(docker_socket, answer) as docker,
        hostile_engine(podman_socket, answer) as podman,
    ):
        with running_agent(
            base / "agent",
            "--docker-socket", str(docker_socket), "--podman-socket", str(podman_socket),
            simulate=str(node),
            preexec=group.enter,
        ) as agent:  # fmt: skip
            seen = _observe(agent)
        seen.oom_kills = group.oom_kills
        seen.peak_bytes = group.peak_bytes
        seen.docker_asked = tuple(docker.asked())
        seen.podman_asked = tuple(podman.asked())
    return seen


# What the lease table's engine feed asks every engine (agent/leasing/engine_feed.py), and
# the Docker socket's too: its version, its CDI dirs and daemon events where it is dockerd
# (agent/engines/facts.py).
FEED_PATHS = frozenset(
    {
        "/events?filters=%7B%22type%22%3A%5B%22container%22%5D%7D",
        "/containers/json?all=1",
    }
)
DOCKER_FACTS_PATHS = frozenset(
    {
        "/version",
        "/info",
        "/events?filters=%7B%22type%22%3A%5B%22container%22%2C%22daemon%22%5D%7D",
    }
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def listed_path(container: str) -> str:
    """The container list asked for one container (``docker ps -a --filter id=...``)."""
    filters = json.dumps({"id": [container]}, separators=(",", ":"))
    return f"/containers/json?all=1&filters={quote(filters, safe='')}"


def labels_of(line: str) -> dict[str, str]:
    """The labels of one exposition line, unescaped as Prometheus reads them."""
    return {
        name: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], value)
        for name, value in _LABEL.findall(line.partition("} ")[0])
    }


def _lookups(text: str, outcome: str) -> float:
    (line,) = [
        line for line in text.splitlines()
        if line.startswith("nvidia_docker_container_lookups_total{") and f'"{outcome}"' in line
    ]  # fmt: skip
    return float(line.rpartition(" ")[2])


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_answer(tmp_path: Path, containers: Containers, case: Case) -> None:
    seen = run_case(tmp_path, containers, case.answer)
    # alive, within its memory, both servers answering, and the engines were asked
    assert seen.alive, f"the agent died; its log ends:\n{seen.log[-3000:]}"
    assert seen.oom_kills == 0
    assert isinstance(seen.metrics, tuple), seen.metrics
    assert seen.metrics[0] == 200
    assert isinstance(seen.processes, tuple), seen.processes
    assert seen.processes[0] == 200
    assert seen.plugin == 200
    # the scrape inspected each engine's container (and, where the inspect was not answered
    # in time, asked the list for it and pinged the engine); the lease table's feed listed
    # and followed their containers (the same hostile answer), and asked nothing else
    for asked, container, facts in (
        (seen.docker_asked, DOCKER_ID, DOCKER_FACTS_PATHS),
        (seen.podman_asked, PODMAN_ID, frozenset()),
    ):
        inspect = f"/containers/{container}/json"
        assert inspect in asked
        busy = {listed_path(container), "/_ping"}
        assert set(asked) <= {inspect, *busy, *FEED_PATHS, *facts}, asked
    # the log: no traceback, at most one line per engine and reader (the scrape's lookup,
    # the feed), each one printable line
    assert "Traceback" not in seen.log
    for engine in ("docker.sock", "podman.sock"):
        lines = [line for line in seen.log.splitlines() if str(tmp_path / engine) in line]
        assert len(lines) <= 2, lines
        assert all(len(line) < 1000 and line.isprintable() for line in lines)
    # what is served: the containers by id; bounded, printable names where answered
    body = seen.metrics[1]
    assert len(body) < 256 * 1024  # 44 KB on this node without names
    assert re.search(rb"[\x00-\x09\x0b-\x1f\x7f]", body) is None
    text = body.decode()
    info = [labels_of(line) for line in text.splitlines()
            if line.startswith("nvidia_docker_gpu_process_info{")]  # fmt: skip
    by_id = {labels["container_id"]: labels for labels in info if "container_id" in labels}
    assert set(by_id) == {DOCKER_ID, PODMAN_ID}
    devices = json.loads(seen.processes[1])["Devices"]
    (docker,), (podman,) = devices[0]["Processes"], devices[1]["Processes"]
    assert (docker["Owner"], docker["ContainerID"]) == ("docker", DOCKER_ID)
    assert (podman["Owner"], podman["ContainerID"]) == ("podman", PODMAN_ID)
    for process in (docker, podman):
        labels = by_id[process["ContainerID"]]
        assert labels.get("container") == process["ContainerName"] == case.name
        assert labels.get("image") == process["Image"] == case.image
    if case.refused is None:
        assert (_lookups(text, "answered"), _lookups(text, "failed")) == (2, 0)
        return
    assert (_lookups(text, "answered"), _lookups(text, "failed")) == (0, 2)
    for engine, socket_name in (
        ("the Docker engine", "docker"),
        ("Podman's API service", "podman"),
    ):
        where = f"{engine} at unix://{tmp_path / socket_name}.sock"
        lookups = [line for line in seen.log.splitlines() if where in line]
        (line,) = [line for line in lookups if "container events" not in line]  # the scrape's
        assert case.refused in line, line
