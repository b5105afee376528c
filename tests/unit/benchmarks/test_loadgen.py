"""The benchmarks' load generator: spreads connections over client processes, reads what
each side spent in CPU, stops by itself whatever the server does, loads loopback only."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.benchmarks.loadgen import LoadError, LoadGenerator, plan_processes
from tests.benchmarks.proc_usage import usable_cpus


class _Answer(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1: 200 with a small body on /ok, 404 elsewhere."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # the head and the body are two writes

    def do_GET(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200 if self.path == "/ok" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: thousands of requests."""


@pytest.fixture
def http_port() -> Iterator[int]:
    """A keep-alive HTTP server in a thread of this (the test's) process."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def test_spreads_connections_over_processes_and_reads_both_sides_cpu(http_port: int) -> None:
    with LoadGenerator("127.0.0.1", http_port) as load:
        result = load.measure(
            "/ok", clients=5, processes=2, duration_s=0.5, server_pid=os.getpid(),
            cpus=usable_cpus(), warmup_s=0.1,
        )  # fmt: skip
    assert result.processes == 2
    assert result.connections_per_process == (3, 2)
    assert result.errors == 0
    assert result.requests > 0
    assert 0.5 <= result.elapsed_s < 3.0
    assert all(cpu > 0 for cpu in result.client_cpu_s), "each client process did work"
    assert result.server_cpu_s is not None
    assert result.server_cpu_s > 0
    assert result.p50_ms <= result.p99_ms
    assert "2 procs" in result.row()


def test_client_processes_are_reused_and_stopped(http_port: int) -> None:
    with LoadGenerator("127.0.0.1", http_port) as load:
        first = load.measure("/ok", 2, 2, 0.2, None, usable_cpus(), warmup_s=0.0)
        second = load.measure("/ok", 1, 1, 0.2, None, usable_cpus(), warmup_s=0.0)
        pids = load.client_pids
    assert first.requests > 0
    assert second.requests > 0
    assert second.server_cpu_s is None
    assert "server ?" in second.row()
    assert len(pids) == 2, "the second measurement reused a started process"
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "stopped and reaped"


def test_stops_by_itself_when_the_server_never_answers(silent_port: int) -> None:
    started = time.monotonic()
    with LoadGenerator("127.0.0.1", silent_port) as load:
        result = load.measure(
            "/ok", 3, 1, duration_s=0.3, server_pid=None, cpus=usable_cpus(),
            warmup_s=0.0, grace_s=0.5,
        )  # fmt: skip
    assert time.monotonic() - started < 10
    assert result.requests == 0
    assert result.errors == 3, "each connection's unanswered request is an error"


def test_errors_in_the_warm_up_stop_the_measurement_with_one_line(http_port: int) -> None:
    with (
        LoadGenerator("127.0.0.1", http_port) as load,
        pytest.raises(LoadError, match=r"GET /missing: \d+ errors in the warm-up"),
    ):
        load.measure("/missing", 2, 1, 0.2, None, usable_cpus(), warmup_s=0.1)


def test_a_closed_port_is_one_line() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        with (
            LoadGenerator("127.0.0.1", port) as load,
            pytest.raises(LoadError, match=r"cannot connect to 127\.0\.0\.1"),
        ):
            load.measure("/ok", 1, 1, 0.2, None, usable_cpus())


@pytest.mark.parametrize("host", ["192.0.2.1", "0.0.0.0"])
def test_refuses_targets_other_than_loopback(host: str) -> None:
    with pytest.raises(LoadError, match="only to loopback"):
        LoadGenerator(host, 80)


def test_auto_picks_one_process_per_connection_up_to_the_cpus_the_server_leaves() -> None:
    assert plan_processes(1, None, cpus=16) == 1
    assert plan_processes(4, None, cpus=16) == 4
    assert plan_processes(64, None, cpus=16) == 15
    assert plan_processes(64, None, cpus=2) == 1
    assert plan_processes(64, None, cpus=1) == 1
    assert plan_processes(2, 4, cpus=16) == 2, "never more processes than connections"
    assert plan_processes(64, 4, cpus=2) == 4, "a given number is used as given"
