"""Hostile input against the real daemon: the examples of issue 11, then random requests to
every REST route and plugin endpoint (hypothesis), bounded in count and time.

Whatever comes in, the daemon answers below 500, logs no traceback, changes nothing on disk
outside its volume directory, and is alive afterwards.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, quote_from_bytes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.agent_process import V12, AgentProcess, UnixHTTPConnection, running_agent
from tests.support.fake_driver import VERSION, FakeDriver

pytestmark = pytest.mark.e2e

VOLUME = f"nvidia_driver_{VERSION}"
REST_ROUTES = (
    "/gpu/info", "/gpu/info/json", "/gpu/status", "/gpu/status/json",
    "/docker/cli", "/docker/cli/json", "/mesos/cli",
)  # fmt: skip
PLUGIN_METHODS = (
    "Plugin.Activate", "VolumeDriver.Create", "VolumeDriver.Remove", "VolumeDriver.Mount",
    "VolumeDriver.Unmount", "VolumeDriver.Path", "VolumeDriver.Get", "VolumeDriver.List",
    "VolumeDriver.Capabilities",
)  # fmt: skip
EXAMPLES = 1000
DEADLINE_MS = 10_000  # per example: a hang fails, a slow shared machine does not


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, fake_driver: FakeDriver
) -> Iterator[AgentProcess]:
    with running_agent(
        tmp_path_factory.mktemp("hostile"), simulate="hgx-h200-8", driver=fake_driver
    ) as served:
        yield served


def snapshot(*roots: Path, skip: tuple[Path, ...] = ()) -> list[tuple[str, int, int, int, int]]:
    """Every path under ``roots`` with its mode, size, inode and mtime (but ``skip``)."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if any(path == s or s in path.parents for s in skip):
                continue
            st_ = path.lstat()
            found.append((str(path), st_.st_mode, st_.st_size, st_.st_ino, st_.st_mtime_ns))
    return found


class Watch:
    """What must hold after hostile input: checked by ``done()``."""

    def __init__(self, agent: AgentProcess, driver: FakeDriver) -> None:
        self.agent = agent
        self.roots = (agent.base, driver.root)
        self.skip = (agent.volume_dir, agent.log_path)
        self.before = snapshot(*self.roots, skip=self.skip)
        self.log_from = len(agent.log())

    def new_log(self) -> str:
        return self.agent.log()[self.log_from :]

    def done(self) -> None:
        assert self.agent.alive()
        assert self.agent.get("/gpu/info/json")[0] == 200
        assert self.agent.plugin("Plugin.Activate") == (
            200,
            {"Implements": ["VolumeDriver", "authz"]},
        )
        log = self.new_log()
        assert "Traceback" not in log
        assert "Error handling request" not in log  # aiohttp's line for a handler that raised
        assert snapshot(*self.roots, skip=self.skip) == self.before


@pytest.fixture
def watch(agent: AgentProcess, fake_driver: FakeDriver) -> Iterator[Watch]:
    watched = Watch(agent, fake_driver)
    yield watched
    watched.done()


# --- the examples -------------------------------------------------------------


@pytest.mark.parametrize("route", REST_ROUTES)
def test_unicode_digits_in_dev_are_a_400_naming_the_entry(watch: Watch, route: str) -> None:
    status, headers, body = watch.agent.get(f"{route}?dev=%C2%B2")  # "²": isdigit(), not int()
    assert status == 400
    assert body == "invalid device: ²\n".encode()
    assert (headers["X-Invalid-Parameter"], headers["X-Invalid-Value"]) == ("dev", "%C2%B2")
    assert b"invalid literal" not in body


@pytest.mark.parametrize("route", ["/gpu/info", "/gpu/status/json", "/docker/cli", "/mesos/cli"])
def test_a_dev_of_4301_nines_is_a_400_shown_bounded(watch: Watch, route: str) -> None:
    status, headers, body = watch.agent.get(f"{route}?dev={'9' * 4301}")
    assert status == 400
    assert body == f"invalid device: {'9' * 80}... (4301 characters)\n".encode()
    assert headers["X-Invalid-Value"] == "9" * 256


def test_control_characters_are_escaped_in_the_answer(watch: Watch) -> None:
    status, headers, body = watch.agent.get("/docker/cli?dev=GPU-%1b%5b31m")
    assert status == 400
    assert body == b"invalid device: GPU-\\x1b[31m\n"
    assert headers["X-Invalid-Value"] == "GPU-%1B%5B31m"


def test_mig_entries_of_a_node_without_mig_are_refused_in_one_line(watch: Watch) -> None:
    for entry, shown in (
        ("0:1", "0:1 (GPU 0 is not in MIG mode)"),
        ("MIG-4f5e6d7c", "MIG-4f5e6d7c"),
        ("0:99999999", "0:99999999"),
    ):
        status, _, body = watch.agent.get(f"/docker/cli?dev={quote(entry)}")
        assert (status, body) == (400, f"invalid device: {shown}\n".encode())


def test_a_deeply_nested_plugin_body_is_refused_with_one_line(watch: Watch) -> None:
    status, answer = watch.agent.plugin("VolumeDriver.Mount", b"[" * 2000)
    assert (status, answer) == (400, {"Err": "bad request: the body nests deeper than 32 levels"})
    status, answer = watch.agent.plugin("VolumeDriver.Create", {"Name": VOLUME, "Opts": {}})
    assert (status, answer) == (200, {"Err": ""})
    status, answer = watch.agent.plugin("VolumeDriver.Mount", {"Name": VOLUME, "ID": "x"})
    assert (status, answer["Err"]) == (200, "")


def _raw(connect: socket.socket, request: bytes) -> bytes:
    with connect as sock:
        sock.settimeout(10)
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def test_malformed_request_lines_get_400_and_one_warning_per_source(
    tmp_path: Path,
) -> None:
    bad = (b"GET /a b HTTP/1.1\r\n\r\n", b"GARBAGE / HTTP/9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01")
    with running_agent(tmp_path) as agent:
        for _ in range(40):
            for request in bad:
                tcp = socket.create_connection(("127.0.0.1", agent.port))
                assert _raw(tcp, request).startswith(b"HTTP/1.0 400 Bad Request\r\n")
                unix = socket.socket(socket.AF_UNIX)
                unix.connect(str(agent.socket_path))
                assert _raw(unix, request).startswith(b"HTTP/1.0 400 Bad Request\r\n")
        assert agent.get("/gpu/info/json")[0] == 200
        log = agent.log()
    warnings = [line for line in log.splitlines() if "Malformed HTTP request" in line]
    pattern = (
        r"nvidia-docker-plugin \| \S+ \S+ "
        r"Malformed HTTP request from (.+) on the (.+): .+; answered 400"
    )
    sources = [re.fullmatch(pattern, line) for line in warnings]
    assert [
        match.groups() if match else line for match, line in zip(sources, warnings, strict=True)
    ] == [
        ("127.0.0.1", "REST API"),
        ("a unix socket client", "plugin socket"),
    ]
    assert "Traceback" not in log
    assert "Error handling request" not in log


def _vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


NAMES_WARM_UP = 2_000
NAMES = 15_000  # a leak of 200 bytes each (what the old lock table took) is 3 MB


def test_removing_many_made_up_volumes_does_not_grow_the_daemon(tmp_path: Path) -> None:
    """Each Remove of a well-formed name once left a lock behind (10 MB per 50,000)."""

    def remove_all(agent: AgentProcess, names: range) -> None:
        conn = UnixHTTPConnection(agent.socket_path, 10)
        try:
            for n in names:
                body = json.dumps({"Name": f"nvidia_driver_{n}.{n}"}).encode()
                conn.request("POST", "/VolumeDriver.Remove", body=body, headers=V12)
                resp = conn.getresponse()
                assert json.loads(resp.read())["Err"].startswith("no such volume")
        finally:
            conn.close()

    with running_agent(tmp_path) as agent:
        remove_all(agent, range(NAMES_WARM_UP))  # the allocator's pools, aiohttp's caches
        before_kib = _vm_rss_kib(agent.proc.pid)
        remove_all(agent, range(NAMES_WARM_UP, NAMES_WARM_UP + NAMES))
        grown_kib = _vm_rss_kib(agent.proc.pid) - before_kib
    assert grown_kib < 1024, f"the daemon grew by {grown_kib} KiB for {NAMES} names"


# --- random requests ------------------------------------------------------------------

_ENTRIES = st.sampled_from(
    ["0", "7", "8", "01", "GPU-", "GPU-0", "gpu-9f", "MIG-1", "0:1", "*", "²", "٣", "-1",
     "9" * 30, "nvidia_driver", "legacy", "native", "cdi", "", " ", ",", "+", "%", "\x00"]
)  # fmt: skip
_VALUES = st.one_of(
    st.text(max_size=40),
    st.lists(_ENTRIES, max_size=8).map(" ".join),
    st.lists(_ENTRIES, max_size=8).map(",".join),
    st.integers(min_value=0, max_value=10**40).map(str),
    st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
)
_PARAMETERS = st.one_of(st.sampled_from(["dev", "vol", "format"]), st.text(max_size=6))


def _query_part(item: tuple[str, str | bytes]) -> str:
    name, value = item
    encoded = quote_from_bytes(value) if isinstance(value, bytes) else quote(value, safe="")
    return f"{quote(name, safe='')}={encoded}"


_QUERIES = st.lists(
    st.tuples(_PARAMETERS, st.one_of(_VALUES, st.binary(max_size=24))), max_size=4
).map(lambda items: "&".join(_query_part(item) for item in items))
_PATHS = st.one_of(
    st.tuples(st.sampled_from(["", "/v1.0"]), st.sampled_from(REST_ROUTES)).map("".join),
    st.text(max_size=20).map(lambda text: "/" + quote(text)),
)


def _get(agent: AgentProcess, target: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_random_queries_to_every_route_get_no_5xx(watch: Watch) -> None:
    statuses: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=DEADLINE_MS,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(path=_PATHS, query=_QUERIES)
    def one_request(path: str, query: str) -> None:
        status = _get(watch.agent, f"{path}?{query}" if query else path)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (path, query)

    started = time.monotonic()
    one_request()
    assert time.monotonic() - started < 300
    assert sum(statuses.values()) >= EXAMPLES
    assert {200, 400} <= set(statuses), statuses


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
_NAMES = st.one_of(
    st.sampled_from([VOLUME, "nvidia_driver_1.0", "nvidia_driver_../..", "nvidia_driver_",
                     "nvidia_driver_580.159.04/..", "../nvidia_driver_1", "cuda_9.0", ""]),
    st.from_regex(r"nvidia_driver_[0-9.]{1,30}", fullmatch=True),
    st.text(max_size=300),
    _JSON,
)  # fmt: skip
_BODIES = st.one_of(
    st.fixed_dictionaries(
        {"Name": _NAMES}, optional={"Opts": _JSON, "ID": st.text(max_size=8)}
    ).map(lambda body: json.dumps(body).encode()),
    _JSON.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=300),
    st.integers(min_value=1, max_value=5000).map(lambda n: b"[" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(min_value=4000, max_value=20000).map(lambda n: b'{"Name": ' + b"7" * n + b"}"),
)
_ACCEPT = st.sampled_from(
    [V12, {"Accept": "application/vnd.docker.plugins.v1.1+json"}, {"Accept": "text/html"}, {}]
)
_METHODS = st.one_of(st.sampled_from(PLUGIN_METHODS), st.text(max_size=16).map(quote))


def _post(agent: AgentProcess, method: str, body: bytes, headers: dict[str, str]) -> int:
    conn = UnixHTTPConnection(agent.socket_path, 10)
    try:
        conn.request("POST", f"/{method}", body=body, headers=headers)
        resp = conn.getresponse()
        answer = json.loads(resp.read())  # every answer is the protocol's JSON
        assert isinstance(answer, dict)
        err = answer.get("Err", "")
        assert "\n" not in err
        assert "Traceback" not in err
        assert "Expecting" not in err, err  # Python's own words
        return resp.status
    finally:
        conn.close()


def test_random_bodies_to_every_plugin_endpoint_get_no_5xx(watch: Watch) -> None:
    statuses: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=DEADLINE_MS,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(method=_METHODS, body=_BODIES, headers=_ACCEPT)
    def one_request(method: str, body: bytes, headers: dict[str, str]) -> None:
        status = _post(watch.agent, method, body, headers)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (method, body[:200], headers)

    started = time.monotonic()
    one_request()
    assert time.monotonic() - started < 300
    assert sum(statuses.values()) >= EXAMPLES
    assert {200, 400} <= set(statuses), statuses
    # Whatever the random Creates and Removes did, it was inside the volume directory.
    for path in watch.agent.volume_dir.rglob("*"):
        assert os.path.realpath(path).startswith(str(watch.agent.volume_dir))
