"""The real daemon under exhaustion: stalled connections, a small descriptor limit, timeouts,
and two daemons racing for one socket directory."""

from __future__ import annotations

import contextlib
import http.client
import resource
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_farm import raise_fd_limit
from tests.support.agent_process import (
    AgentProcess,
    launch_agent,
    plugin_call,
    running_agent,
    wait_ready,
)
from tests.support.certs import make_pki
from tests.support.fake_driver import VERSION, FakeDriver
from tests.support.services import port_open, stop_process, wait_until

pytestmark = pytest.mark.e2e

VOLUME = f"nvidia_driver_{VERSION}"
HALF_REQUEST = b"GET /gpu/info/json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Stalled: yes\r\n"
ATTACKERS = 1100
DAEMON_FDS = 1024  # the default soft limit of a service without LimitNOFILE=
REST_BOUND = DAEMON_FDS - 256  # what --reserved-fds' default leaves the REST API


@contextlib.contextmanager
def attacker_sockets(count: int) -> Iterator[list[socket.socket]]:
    """Room for ``count`` client sockets in this process; closes them all at the end."""
    raise_fd_limit(count + 512)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count + 256:
        pytest.skip(f"this test needs {count + 256} descriptors; the hard limit is lower")
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def stall(port: int) -> socket.socket:
    """A connection from 127.0.0.1 that sends half a request and waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    with contextlib.suppress(OSError):  # dropped already: it still holds our descriptor
        sock.sendall(HALF_REQUEST)
    return sock


def closed_by_peer(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def descriptors_back(agent: AgentProcess, baseline: int) -> None:
    """Wait (bounded) until the daemon holds no more descriptors than ``baseline``."""
    wait_until(
        lambda: agent.open_descriptors() <= baseline,
        what=f"the daemon's descriptors back to {baseline}",
        timeout_s=20,
    )


@contextlib.contextmanager
def descriptor_peak(agent: AgentProcess) -> Iterator[list[int]]:
    """The most descriptors the daemon held, read from /proc as fast as a thread can while
    the block runs (``[peak]`` once it has ended)."""
    peak = [agent.open_descriptors()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):  # a descriptor closed while listed
                peak[0] = max(peak[0], agent.open_descriptors())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def mount_and_get(agent: AgentProcess, limit_s: float) -> None:
    """A Mount on the plugin socket and a GET on a new REST connection, each answered
    within ``limit_s``."""
    started = time.monotonic()
    status, answer = agent.plugin(
        "VolumeDriver.Mount", {"Name": VOLUME, "ID": "c0ffee"}, timeout_s=limit_s
    )
    mount_s = time.monotonic() - started
    assert (status, answer) == (
        200,
        {"Mountpoint": str(agent.volume_dir / "nvidia_driver" / VERSION), "Err": ""},
    )
    started = time.monotonic()
    status, _, body = agent.get("/gpu/info/json", timeout_s=limit_s)
    get_s = time.monotonic() - started
    assert status == 200
    assert body.startswith(b"{")
    assert mount_s < limit_s, f"Mount took {mount_s:.2f} s"
    assert get_s < limit_s, f"GET took {get_s:.2f} s"


def test_mount_and_rest_answer_within_1s_under_1100_stalled_connections_at_1024_fds(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    """The service's default descriptor limit and 1,100 stalled connections from the good
    client's own address. The timeouts are set long, so that only the connection bound
    (the oldest without a request is dropped) and the descriptor reserve keep it serving."""
    with (
        attacker_sockets(ATTACKERS) as attackers,
        running_agent(
            tmp_path, "--header-timeout", "600", "--idle-timeout", "600",
            nofile=DAEMON_FDS, driver=fake_driver,
        ) as agent,
    ):  # fmt: skip
        created = agent.plugin("VolumeDriver.Create", {"Name": VOLUME}, timeout_s=60)
        assert created == (200, {"Err": ""})
        mount_and_get(agent, 1.0)
        baseline = agent.settled_descriptors()
        with descriptor_peak(agent) as most:
            for _ in range(4):  # a quarter of the attack at a time, then the good client
                for _ in range(ATTACKERS // 4):
                    attackers.append(stall(agent.port))
                mount_and_get(agent, 1.0)
        assert agent.alive()
        for sock in attackers:
            sock.close()
        descriptors_back(agent, baseline)
        mount_and_get(agent, 1.0)
        log = agent.log()
    assert "Connection limits: 768 REST connections (descriptor limit 1024, 256 reserved)" in log
    assert "connections, the most allowed: dropped the one from 127.0.0.1" in log
    assert "Too many open files" not in log
    assert "out of system resource" not in log
    assert "Traceback" not in log
    # Never beyond the bound, even for a moment: accepted in a batch, or dropped and not yet
    # closed, each would have held a descriptor the plugin socket needs (the good client's
    # Mount and GET hold two more).
    assert most[0] <= baseline + REST_BOUND + 2, f"the daemon held {most[0]} descriptors"


def stall_in_handshake(port: int) -> socket.socket:
    """A connection that starts a TLS record (a ClientHello's first bytes) and waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    with contextlib.suppress(OSError):
        sock.sendall(b"\x16\x03\x01")
    return sock


def tls_get(port: int, ca: Path, limit_s: float) -> None:
    """A GET over TLS on a new connection, answered within ``limit_s``."""
    context = ssl.create_default_context(cafile=str(ca))
    started = time.monotonic()
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=limit_s, context=context)
    try:
        conn.request("GET", "/gpu/info/json")
        answer = conn.getresponse()
        assert (answer.status, answer.read()[:1]) == (200, b"{")
    finally:
        conn.close()
    assert time.monotonic() - started < limit_s


def test_the_tls_port_under_1100_connections_stalled_in_their_handshake_at_1024_fds(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    """The same attack on a TLS port (--tls-cert, plain HTTP on loopback): each connection
    starts a TLS record and stalls, so it never reaches the server and its guard. The
    handshake timeout is long (it is the header timeout); only the bound on connections
    before their handshake's end keeps the plugin socket and the REST API answering."""
    pki = make_pki(tmp_path / "pki")
    with (
        attacker_sockets(ATTACKERS) as attackers,
        running_agent(
            tmp_path / "agent", "--header-timeout", "600", "--idle-timeout", "600",
            "--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("server")),
            nofile=DAEMON_FDS, driver=fake_driver,
        ) as agent,
    ):  # fmt: skip
        assert agent.plugin("VolumeDriver.Create", {"Name": VOLUME}, timeout_s=60) == (
            200,
            {"Err": ""},
        )
        mount_and_get(agent, 1.0)  # the GET: plain HTTP to loopback
        tls_get(agent.port, pki.pem("ca"), 1.0)
        baseline = agent.settled_descriptors()
        most = baseline
        for _ in range(4):
            for _ in range(ATTACKERS // 4):
                attackers.append(stall_in_handshake(agent.port))
            most = max(most, agent.open_descriptors())
            mount_and_get(agent, 1.0)
            tls_get(agent.port, pki.pem("ca"), 1.0)
        assert agent.alive()
        for sock in attackers:
            sock.close()
        descriptors_back(agent, baseline)
        log = agent.log()
    assert "before their first byte or in their TLS handshake, the most allowed" in log
    assert "Too many open files" not in log
    assert "out of system resource" not in log
    assert "Traceback" not in log
    assert most < DAEMON_FDS


def test_header_and_idle_timeouts_close_what_clients_leave_open(tmp_path: Path) -> None:
    with running_agent(tmp_path, "--header-timeout", "1", "--idle-timeout", "2") as agent:
        baseline = agent.settled_descriptors()
        started = time.monotonic()
        stalled = [stall(agent.port) for _ in range(20)]
        silent = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(5)]
        idle = socket.create_connection(("127.0.0.1", agent.port), timeout=10)
        idle.sendall(b"GET /gpu/info/json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(65536).startswith(b"HTTP/1.1 200 OK")
        answered = time.monotonic()
        assert all(closed_by_peer(sock) for sock in [*stalled, *silent])
        header_s = time.monotonic() - started
        assert closed_by_peer(idle)
        idle_s = time.monotonic() - answered
        for sock in [*stalled, *silent, idle]:
            sock.close()
        wait_until(lambda: agent.open_descriptors() <= baseline, what="descriptors", timeout_s=10)
        assert agent.get("/gpu/info/json")[0] == 200
    assert header_s < 3.0
    assert 1.5 < idle_s < 4.0


def test_a_pause_between_requests_is_not_cut_by_the_header_timeout(tmp_path: Path) -> None:
    """A kept-alive client that asks again after a pause longer than the header timeout
    (shorter than the idle timeout) is served on the same connection."""
    with running_agent(tmp_path, "--header-timeout", "0.5", "--idle-timeout", "30") as agent:
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=10)
        with sock:
            for _ in range(3):
                sock.sendall(b"GET /gpu/info/json HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = b""
                while not reply.endswith(b"}\n"):
                    chunk = sock.recv(65536)
                    assert chunk, "a kept-alive connection was closed before its idle timeout"
                    reply += chunk
                assert reply.startswith(b"HTTP/1.1 200 OK")
                time.sleep(1.0)  # the pause between two requests is what is tested


def _error_line(agent: AgentProcess) -> str:
    lines = [line for line in agent.log().splitlines() if " Error: " in line]
    assert len(lines) == 1, agent.log()
    assert "Traceback" not in agent.log()
    return lines[0]


def _race(shared: Path) -> None:
    """Start two daemons on one socket directory at once: exactly one serves it."""
    agents = [launch_agent(shared.parent / name, socket_dir=shared) for name in ("a", "b")]
    try:
        wait_until(
            lambda: any(a.proc.poll() is not None for a in agents),
            what="one of the two daemons to give up",
            timeout_s=60,
        )
        (loser,) = [a for a in agents if a.proc.poll() is not None]
        (winner,) = [a for a in agents if a is not loser]
        assert loser.proc.wait() == 1
        line = _error_line(loser)
        assert f"another agent (pid {winner.proc.pid}) is serving {shared}" in line or (
            "another agent is serving" in line  # the winner had not written its pid yet
        ), line
        assert line.endswith("stop it or choose another -s")
        wait_until(lambda: port_open(winner.port), what="the winner", timeout_s=60)
        answer = plugin_call(shared / "nvidia-docker.sock", "Plugin.Activate")
        assert answer == (200, {"Implements": ["VolumeDriver", "authz"]})
        assert winner.alive()
    finally:
        for agent in agents:
            stop_process(agent.proc)
    assert winner.proc.returncode == 0
    assert not (shared / "nvidia-docker.sock").exists()


def test_two_daemons_racing_for_one_socket_directory_exactly_one_serves(tmp_path: Path) -> None:
    for round_ in range(20):
        _race(tmp_path / f"round-{round_}" / "plugins")


def test_a_second_daemon_on_a_served_directory_exits_1_with_one_line(tmp_path: Path) -> None:
    with running_agent(tmp_path / "first") as first:
        second = launch_agent(tmp_path / "second", socket_dir=first.socket_dir)
        assert second.proc.wait(timeout=60) == 1
        line = _error_line(second)
        assert f"another agent (pid {first.proc.pid}) is serving {first.socket_path}" in line
        assert first.plugin("Plugin.Activate") == (200, {"Implements": ["VolumeDriver", "authz"]})
        wait_ready(first)
