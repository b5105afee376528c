"""The real daemon process, started on a free port and queried over TCP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from tests.support.prerequisites import unavailable
from tests.support.services import (
    free_port,
    listens_on,
    mounted_tmpfs,
    port_open,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.e2e


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    port: int
    socket_dir: Path

    def get(self, path: str) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err.decode()


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent.daemon", *args]


def notify_receiver(path: Path) -> socket.socket:
    """A datagram socket at ``path`` that gets what the agent tells systemd (NOTIFY_SOCKET),
    each ``recv`` waiting up to 60 s."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(60)
    return receiver


def start_daemon(tmp_path: Path, *args: str, notify_socket: Path | None = None) -> Daemon:
    """The daemon, once its REST port listens (before it is Ready: ``notify_socket`` gets
    its READY=1)."""
    port = free_port()
    socket_dir = tmp_path / "plugins"
    env = dict(os.environ)
    if notify_socket is not None:
        env["NOTIFY_SOCKET"] = str(notify_socket)
    proc = subprocess.Popen(
        _command(
            "-l", f"127.0.0.1:{port}", "-s", str(socket_dir), "-d", str(tmp_path / "volumes"),
            *args,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )  # fmt: skip
    try:
        wait_until(lambda: listens_on(proc.pid, port), what="agent", timeout_s=60, proc=proc)
    except Exception:
        stop_process(proc)
        raise
    return Daemon(proc, port, socket_dir)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path, "--simulate", "hgx-h200-8")
    yield d
    stop_process(d.proc)
    d.proc.communicate()


def test_serves_the_api_over_tcp_and_stops_gracefully(daemon: Daemon) -> None:
    status, body = daemon.get("/gpu/info/json")
    assert status == 200
    assert len(json.loads(body)["Devices"]) == 8
    status, body = daemon.get("/v1.0/docker/cli?dev=2")
    assert body.decode().endswith(" --device=/dev/nvidia2\n")
    assert daemon.get("/docker/cli?dev=GPU-nope")[0] == 400
    assert daemon.get("/gpu/status/json")[0] == 200
    assert (daemon.socket_dir / "nvidia-docker.sock").is_socket()

    code, log = daemon.stop()
    assert code == 0
    assert not (daemon.socket_dir / "nvidia-docker.sock").exists()
    lines = log.splitlines()
    assert lines, "the daemon logged nothing"
    assert all(line.startswith("nvidia-docker-plugin | ") for line in lines)
    text = "\n".join(lines)
    for step in ("Initialising the GPU backend", "Discovered 8 GPU(s)", "Finding the driver files",
                 "Serving the plugin API", "Serving the REST API", "Ready",
                 "Received SIGTERM", "Stopped"):  # fmt: skip
        assert step in text
    assert "Traceback" not in text
    # the event loop the suite asked for (tests/conftest.py; scripts/test-all's uvloop pass)
    assert f"Event loop: {os.environ['NVIDIA_DOCKER_PLUGIN_EVENT_LOOP']}" in text


def test_sigint_is_graceful_too(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--simulate", "h200")
    d.proc.send_signal(signal.SIGINT)
    _, err = d.proc.communicate(timeout=30)
    assert d.proc.returncode == 0
    assert "Received SIGINT" in err.decode()


def test_sighup_rereads_and_keeps_serving(tmp_path: Path) -> None:
    """SIGHUP is the operators' "re-read now"; it never stops the agent (its default would).
    Sent once the agent said READY=1: the REST port listens before the start is done, and a
    SIGHUP then is only logged (the start reads everything anyway)."""
    receiver = notify_receiver(tmp_path / "notify")
    d = start_daemon(tmp_path, "--simulate", "h200", notify_socket=tmp_path / "notify")
    try:
        assert receiver.recv(4096).startswith(b"READY=1")
        d.proc.send_signal(signal.SIGHUP)
        d.proc.send_signal(signal.SIGHUP)
        assert d.get("/gpu/info/json")[0] == 200
        assert d.proc.poll() is None
    finally:
        code, log = d.stop()
        receiver.close()
    assert code == 0, log
    assert "Received SIGHUP: re-reading" in log
    assert "Traceback" not in log


def test_many_bad_requests_do_not_hurt_it(daemon: Daemon) -> None:
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as sock:
        sock.sendall(b"GARBAGE / HTTP/9\r\n\r\n")
        sock.recv(1024)
    for path in ("/gpu/info/json?dev=%ff%fe", "/docker/cli?vol=../../etc", "/" + "x" * 5000):
        assert daemon.get(path)[0] in (400, 404, 414)
    assert daemon.get("/gpu/info/json")[0] == 200


def test_removing_the_plugin_socket_stops_the_rest_api(daemon: Daemon) -> None:
    (daemon.socket_dir / "nvidia-docker.sock").unlink()
    _, err = daemon.proc.communicate(timeout=30)
    assert daemon.proc.returncode == 3
    assert "plugin socket" in err.decode()
    assert not port_open(daemon.port)


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(*args), capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_version_flag() -> None:
    for flag in ("-v", "--version"):
        result = _run(flag)
        assert result.returncode == 0
        assert result.stdout == f"NVIDIA Docker plugin: {__version__}\n"


def test_env_vars_configure_it(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ)
    env["NVIDIA_DOCKER_PLUGIN_LISTEN"] = f"127.0.0.1:{port}"
    env["NVIDIA_DOCKER_PLUGIN_SOCKET_DIR"] = str(tmp_path / "s")
    env["NVIDIA_DOCKER_PLUGIN_VOLUMES"] = str(tmp_path / "v")
    env["NVIDIA_DOCKER_PLUGIN_SIMULATE"] = "h200"
    proc = subprocess.Popen(_command(), env=env, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: listens_on(proc.pid, port), what="agent", timeout_s=60, proc=proc)
        assert (tmp_path / "s" / "nvidia-docker.sock").is_socket()
    finally:
        stop_process(proc)
        proc.communicate()
    assert proc.returncode == 0


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "Error" in line]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def _nvml_loads() -> bool:
    """Whether this machine has an NVIDIA driver that NVML can start from, as a new process
    (the daemon) sees it: not this one, where other tests load a fake libnvidia-ml.so.1."""
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, timeout=60, check=False
    )
    return found.returncode == 0


def test_no_driver_is_one_line_that_names_simulate(tmp_path: Path) -> None:
    if _nvml_loads():
        unavailable("this machine has an NVIDIA driver (libnvidia-ml.so.1 loads)")
    env = dict(os.environ)
    env.pop("NVIDIA_DOCKER_PLUGIN_SIMULATE", None)
    result = _run(
        "-l", f"127.0.0.1:{free_port()}", "-s", str(tmp_path / "s"), "-d", str(tmp_path / "v"),
        env=env,
    )  # fmt: skip
    line = _one_error_line(result)
    assert "--simulate" in line
    assert "NVIDIA driver" in line
    assert not (tmp_path / "s").exists()


def test_bad_node_file_is_one_line(tmp_path: Path) -> None:
    node = tmp_path / "node.json"
    node.write_text('{"driver_version": "580.1", "cuda_version": "13.0", "devices": [{}]}')
    result = _run("-l", f"127.0.0.1:{free_port()}", "--simulate", str(node))
    assert "devices[0].pci.bus_id: missing" in _one_error_line(result)
    result = _run("-l", f"127.0.0.1:{free_port()}", "--simulate", str(tmp_path / "none.json"))
    assert "not found" in _one_error_line(result)


def test_address_in_use_is_one_line(daemon: Daemon, tmp_path: Path) -> None:
    result = _run(
        "-l", f"127.0.0.1:{daemon.port}", "--simulate", "h200",
        "-s", str(tmp_path / "other"), "-d", str(tmp_path / "v2"),
    )  # fmt: skip
    line = _one_error_line(result)
    assert f"cannot listen on 127.0.0.1:{daemon.port}" in line
    assert not (tmp_path / "other" / "nvidia-docker.sock").exists()
    assert daemon.get("/gpu/info/json")[0] == 200


def test_an_address_in_use_is_said_before_anything_is_built_or_served(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The bound port is the first thing to know: no volume built, no CDI spec written, no
    "Serving ..." line before the error (it was said after all three)."""
    result = _run(
        "-l", f"127.0.0.1:{daemon.port}", "--simulate", "h200",
        "-s", str(tmp_path / "other"), "-d", str(tmp_path / "v2"),
        "--cdi-spec-dir", str(tmp_path / "cdi"),
    )  # fmt: skip
    assert result.returncode == 1
    before_error = result.stderr.partition("Error: cannot listen")[0]
    assert "Serving" not in before_error
    assert "GPU backend" not in before_error  # not even the GPU worker was started
    assert not (tmp_path / "cdi").exists()
    assert not (tmp_path / "v2").exists()  # no volume directory opened either


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory the agent cannot write, and why: as root a read-only tmpfs (as a unit's
    sandbox, ProtectSystem=strict, leaves a --state-dir outside ReadWritePaths), else a
    directory of mode 0555."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory, "Permission denied"
        return
    with mounted_tmpfs(directory, "ro,size=1m"):
        yield directory, "Read-only file system"


def _refused_state_dir(tmp_path: Path, state_dir: Path) -> str:
    """The one error line of an agent started with ``--state-dir state_dir``, once it is
    checked that nothing was built, served or written before it."""
    result = _run(
        "-l", f"127.0.0.1:{free_port()}", "--simulate", "h200",
        "-s", str(tmp_path / "plugins"), "-d", str(tmp_path / "volumes"),
        "--cdi-spec-dir", str(tmp_path / "cdi"), "--state-dir", str(state_dir),
    )  # fmt: skip
    line = _one_error_line(result)
    before_error = result.stderr.partition("Error:")[0]
    assert "Discovered 1 GPU(s)" in before_error  # a node without a driver makes nothing
    assert "Finding the driver files" not in before_error
    assert "Serving" not in before_error
    for written in ("plugins", "volumes", "cdi"):
        assert not (tmp_path / written).exists(), written
    return line


def test_a_state_dir_under_a_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """It started, and said so only at the first lease (its state not written) and sweep
    (serving without a usage ledger)."""
    (tmp_path / "var").write_text("x")
    state_dir = tmp_path / "var" / "state"
    line = _refused_state_dir(tmp_path, state_dir)
    assert line.endswith(
        f"Error: cannot use the state directory {state_dir}: Not a directory ({tmp_path}/var "
        "is a regular file): give --state-dir a directory the agent can create and write (it "
        "holds the lease table's leases.json and the usage ledger's usage.db)"
    )


def test_a_read_only_state_dir_stops_the_start_in_one_line(
    tmp_path: Path, read_only_dir: tuple[Path, str]
) -> None:
    directory, why = read_only_dir
    line = _refused_state_dir(tmp_path, directory)
    assert f"Error: cannot use the state directory {directory}: {why}: give --state-dir" in line
    assert list(directory.iterdir()) == []


def test_bad_listen_address_is_a_usage_error() -> None:
    result = _run("-l", "localhost", "--simulate", "h200")
    assert result.returncode == 2
    assert "expected HOST:PORT" in result.stderr


def test_it_tells_systemd_it_is_ready_only_once_both_servers_answer(tmp_path: Path) -> None:
    """Type=notify: docker.service starts after READY=1, and must find the plugin then."""
    notify_path = tmp_path / "notify"
    receiver = notify_receiver(notify_path)
    port = free_port()
    socket_path = tmp_path / "s" / "nvidia-docker.sock"
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path))
    proc = subprocess.Popen(
        _command(
            "-l", f"127.0.0.1:{port}", "-s", str(socket_path.parent), "-d", str(tmp_path / "v"),
            "--simulate", "h200",
        ),
        env=env,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        ready = receiver.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=serving 1 GPU(s), driver 580.159.04")
        # At that moment both answer, first time.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/gpu/info/json", timeout=5) as r:
            assert r.status == 200
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plugin:
            plugin.connect(str(socket_path))
            plugin.sendall(
                b"POST /Plugin.Activate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                b"Accept: application/vnd.docker.plugins.v1.2+json\r\n\r\n"
            )
            assert plugin.recv(4096).startswith(b"HTTP/1.1 200")
        proc.send_signal(signal.SIGHUP)
        assert receiver.recv(4096) == b"RELOADING=1"
        assert receiver.recv(4096) == b"READY=1"
        proc.send_signal(signal.SIGTERM)
        assert receiver.recv(4096) == b"STOPPING=1"
        proc.wait(timeout=30)
    finally:
        stop_process(proc)
        proc.communicate()
        receiver.close()
    assert proc.returncode == 0


def test_its_own_readiness_check_is_not_logged_as_a_refused_request(tmp_path: Path) -> None:
    """With tokens and no plain loopback, the agent's own check at start gets a 401 (it has
    no token): that is no refusal to report. A client's request without a token still is."""
    tokens = tmp_path / "tokens"
    tokens.write_text("t" * 32 + "\n")
    tokens.chmod(0o600)
    port = free_port()
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _command(
                "-l", f"127.0.0.1:{port}", "-s", str(tmp_path / "plugins"),
                "-d", str(tmp_path / "volumes"), "--simulate", "h200",
                "--token-file", str(tokens), "--no-plain-loopback",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: "Ready" in log.read_text(), what="agent", timeout_s=60, proc=proc)
        daemon = Daemon(proc, port, tmp_path / "plugins")
        assert daemon.get("/gpu/info/json")[0] == 401  # a client without a token
        wait_until(lambda: "Refused" in log.read_text(), what="the refusal's line")
    finally:
        stop_process(proc)
    before_ready, _, after_ready = log.read_text().partition("Ready")
    assert "Refused" not in before_ready
    assert "Refused 1 request(s) without a valid token (last: no bearer token" in after_ready
