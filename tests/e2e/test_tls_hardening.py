"""TLS and token hardening, against the agent as a real process with real certificates.

- A passphrase-protected key never makes OpenSSL prompt: at start the start fails with one
  line naming the key (with and without a controlling terminal); swapped in before a SIGHUP
  while the agent has a terminal (a pty made its controlling terminal), the agent keeps
  answering, logs one line, and the previous context stays.
- Rotating ``--tls-client-ca`` ends the resumption of sessions made under the old CA: a
  client of the old CA resuming its saved TLS 1.3 session is refused after the SIGHUP (and
  resumed before it: the test can fail).
- Certificates near or past their expiry warn at start and at reload, and ``/metrics``
  serves the served certificate's notAfter.
- A token file beyond the bounds is refused at start and at reload (the previous tokens
  stay), and a flood of wrong tokens against the largest token file the bounds allow costs
  the agent no more than a flood without a token: plain loopback requests stay as fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import select
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.edge.tokens import MAX_TOKEN_CHARS, MAX_TOKENS, TOKEN_FILE_LIMIT
from tests.support.certs import Pki, dated_server, encrypt_key, make_pki, not_after
from tests.support.memory_cgroup import memory_cgroup
from tests.support.services import free_port, stop_process, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOKEN = "h" * 24 + "-hardening-token-0123456789"
PROMPT = "Enter PEM pass phrase"
PASSPHRASE = "correct horse battery staple"
EXPIRY_GAUGE = "nvidia_docker_tls_certificate_expiry_timestamp_seconds"


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    root = Path(tempfile.mkdtemp(prefix="nvd-pki-hardening-"))
    try:
        yield make_pki(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- an agent, optionally on a terminal -------------------------------------------------------


class Terminal:
    """A pty whose slave becomes the controlling terminal of the process started on it; what
    is written to the terminal (a prompt) is collected from the master."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self._output = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def preexec(self) -> None:
        """In the child, after setsid (``start_new_session``): take the pty (stdin)."""
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    def started(self) -> None:
        os.close(self.slave)  # the child holds it now
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: no process holds the slave any more
                return
            if not chunk:
                return
            self._output += chunk

    @property
    def output(self) -> str:
        return bytes(self._output).decode(errors="replace")

    def close(self) -> None:
        """After the process ended: read what is left (until EIO, bounded), then close."""
        if self._reader.is_alive():
            self._reader.join(timeout=5)
        self._stop.set()
        if self._reader.is_alive():
            self._reader.join(timeout=5)
        os.close(self.master)


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    base: Path
    cert: Path
    key: Path
    client_ca: Path | None
    tokens: Path | None
    terminal: Terminal | None = None

    @property
    def log_path(self) -> Path:
        return self.base / "agent.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def output(self) -> str:
        """Everything it wrote: its log, and its terminal's output."""
        return self.log() + (self.terminal.output if self.terminal is not None else "")

    def reload(self, line: str) -> None:
        """SIGHUP, then wait until the log says ``line`` once more than before."""
        before = self.log().count(line)
        self.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: self.log().count(line) > before, what=line, timeout_s=30)

    def plain_get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def gauge(self, name: str) -> float | None:
        status, body = self.plain_get("/metrics")
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None


def _command(base: Path, port: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
        "-s", str(base / "plugins"), "-d", str(base / "volumes"), "--simulate", "h200", *args,
    ]  # fmt: skip


def _spawn(command: list[str], log: Path, terminal: Terminal | None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command,
            stdin=terminal.slave if terminal is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=terminal is not None,
            preexec_fn=terminal.preexec if terminal is not None else None,  # noqa: PLW1509
        )
    if terminal is not None:
        terminal.started()
    return proc


@contextlib.contextmanager
def agent_with(
    pki: Pki,
    base: Path,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    client_ca: str | None = None,
    tokens: str | None = None,
    on_terminal: bool = False,
) -> Iterator[Agent]:
    """An agent with TLS (copies of the given files, or the server's, so that a test may
    change them), optionally a client CA and a token file, optionally on a terminal."""
    base.mkdir(parents=True, exist_ok=True)
    own_cert, own_key = base / "server.pem", base / "server.key"
    shutil.copyfile(cert or pki.pem("server"), own_cert)
    shutil.copyfile(key or pki.key("server"), own_key)
    own_key.chmod(0o600)
    args = ["--tls-cert", str(own_cert), "--tls-key", str(own_key)]
    own_ca = own_tokens = None
    if client_ca is not None:
        own_ca = base / "client-ca.pem"
        shutil.copyfile(pki.pem(client_ca), own_ca)
        args += ["--tls-client-ca", str(own_ca)]
    if tokens is not None:
        own_tokens = base / "tokens"
        own_tokens.write_text(tokens)
        own_tokens.chmod(0o600)
        args += ["--token-file", str(own_tokens)]
    port = free_port()
    terminal = Terminal() if on_terminal else None
    proc = _spawn(_command(base, port, *args), base / "agent.log", terminal)
    agent = Agent(proc, port, base, own_cert, own_key, own_ca, own_tokens, terminal)
    try:
        wait_until(lambda: "Ready" in agent.log(), what="agent", timeout_s=60, proc=proc)
        yield agent
    finally:
        stop_process(proc)
        if terminal is not None:
            terminal.close()


def _client(pki: Pki, name: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.pem("ca")))
    if name is not None:
        context.load_cert_chain(str(pki.pem(name)), str(pki.key(name)))
    return context


def _tls_get(
    port: int,
    context: ssl.SSLContext,
    *,
    session: ssl.SSLSession | None = None,
    token: str | None = None,
) -> tuple[bool, str, ssl.SSLSession | None]:
    """One GET /gpu/info on a new TLS connection (resuming ``session``): whether the session
    was resumed, the status line, the session to resume next time."""
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
    ):
        tls.sendall(
            f"GET /gpu/info HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        return bool(tls.session_reused), answer.split(b"\r\n")[0].decode(), tls.session


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Error" in line]


def _start(command: list[str], log: Path, terminal: Terminal | None = None) -> int | None:
    """Start the agent and wait until it exits or says Ready (then stop it): its exit code,
    None if it started. A prompt that waits for ever fails the wait (30 s)."""
    proc = _spawn(command, log, terminal)
    try:
        wait_until(
            lambda: proc.poll() is not None or "Ready" in log.read_text(errors="replace"),
            what="the start to end",
            timeout_s=30,
        )
        return proc.poll()
    finally:
        stop_process(proc)
        if terminal is not None:
            terminal.close()


# --- (a), (b): passphrase-protected keys ---------------------------------------------------------


@pytest.mark.parametrize("on_terminal", [False, True], ids=["no terminal", "on a terminal"])
def test_an_encrypted_key_stops_the_start_with_one_line(
    pki: Pki, tmp_path: Path, on_terminal: bool
) -> None:
    key = encrypt_key(pki.key("server"), tmp_path / "encrypted.key", PASSPHRASE)
    log = tmp_path / "agent.log"
    terminal = Terminal() if on_terminal else None
    command = _command(
        tmp_path, free_port(), "--tls-cert", str(pki.pem("server")), "--tls-key", str(key)
    )
    code = _start(command, log, terminal)
    output = log.read_text(errors="replace")
    everything = output + (terminal.output if terminal is not None else "")
    assert code == 1, output
    (error,) = _error_lines(output)
    assert f"--tls-key {key}: the private key is encrypted" in error
    assert "never asks for a passphrase" in error
    assert PROMPT not in everything
    assert "Invalid argument" not in everything
    assert "Traceback" not in output


def test_an_encrypted_key_at_sighup_on_a_terminal_never_freezes_the_agent(
    pki: Pki, tmp_path: Path
) -> None:
    with agent_with(pki, tmp_path / "agent", on_terminal=True) as agent:
        assert agent.plain_get("/gpu/info")[0] == 200
        encrypt_key(pki.key("server"), agent.key, PASSPHRASE)
        failed = "Reload: TLS certificate failed"
        before = agent.log().count(failed)
        agent.proc.send_signal(signal.SIGHUP)
        answered = 0
        deadline = time.monotonic() + 30
        while agent.log().count(failed) == before or answered < 5:
            assert time.monotonic() < deadline, "the reload never ended"
            # a frozen event loop answers nothing: each request must be answered in 2 s
            assert agent.plain_get("/gpu/info", timeout_s=2.0)[0] == 200
            answered += 1
        # the previous certificate and key still serve TLS
        _, status, _ = _tls_get(agent.port, _client(pki, None))
        assert status == "HTTP/1.1 200 OK"
        assert agent.proc.poll() is None
        lines = [line for line in agent.log().splitlines() if str(agent.key) in line]
        assert len(lines) == 1, lines
        assert failed in lines[0]
        assert "the private key is encrypted" in lines[0]
        assert "keeping the previous one" in lines[0]
        assert PROMPT not in agent.output()


# --- (c): a client CA rotation ends resumption --------------------------------------------------


def test_a_client_ca_rotation_ends_the_resumption_of_old_clients(pki: Pki, tmp_path: Path) -> None:
    with agent_with(pki, tmp_path / "agent", client_ca="ca") as agent:
        old_client = _client(pki, "client")
        old_client.minimum_version = ssl.TLSVersion.TLSv1_3  # tickets, as the clients
        reused, status, session = _tls_get(agent.port, old_client)
        assert (reused, status) == (False, "HTTP/1.1 200 OK")
        reused, status, session = _tls_get(agent.port, old_client, session=session)
        assert (reused, status) == (True, "HTTP/1.1 200 OK")  # resumption works: this can fail

        assert agent.client_ca is not None
        shutil.copyfile(pki.pem("other-ca"), agent.client_ca)
        agent.reload("Reload: TLS certificate and keys read again")
        with pytest.raises(ssl.SSLError, match=r"UNKNOWN_CA|unknown ca"):
            _tls_get(agent.port, old_client, session=session)
        _, status, _ = _tls_get(agent.port, _client(pki, "other-client"))
        assert status == "HTTP/1.1 200 OK"  # clients of the new CA get in


# --- (d): expiry ------------------------------------------------------------------------------


def test_certificates_near_or_past_expiry_warn_and_the_metric_shows_not_after(
    pki: Pki, tmp_path: Path
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    soon_cert, soon_key = dated_server(
        pki, "soon", now - timedelta(days=1), now + timedelta(days=10, hours=-1)
    )
    old_cert, old_key = dated_server(
        pki, "expired", datetime(2019, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC)
    )
    soon = not_after(soon_cert)
    with agent_with(pki, tmp_path / "agent", cert=soon_cert, key=soon_key) as agent:
        shown = soon.strftime("%Y-%m-%d %H:%M:%S UTC")
        warning = f"Warning: --tls-cert {agent.cert} expires on {shown} (in 9 days)"
        assert agent.log().count(warning) == 1
        assert agent.gauge(EXPIRY_GAUGE) == soon.timestamp()

        agent.reload("Reload: TLS certificate and keys read again")  # the same files: again
        assert agent.log().count(warning) == 2

        shutil.copyfile(old_cert, agent.cert)
        shutil.copyfile(old_key, agent.key)
        agent.reload("Reload: TLS certificate and keys read again")
        expired = f"Warning: --tls-cert {agent.cert} expired on 2020-01-02 00:00:00 UTC"
        assert agent.log().count(expired) == 1
        assert agent.gauge(EXPIRY_GAUGE) == datetime(2020, 1, 2, tzinfo=UTC).timestamp()
    assert "Traceback" not in agent.log()


def test_the_metric_follows_a_certificate_far_from_expiry(pki: Pki, tmp_path: Path) -> None:
    with agent_with(pki, tmp_path / "agent") as agent:
        assert agent.gauge(EXPIRY_GAUGE) == not_after(pki.pem("server")).timestamp()
        assert "expire" not in agent.log()


# --- (e): token files ---------------------------------------------------------------------------


def _many_tokens(count: int, width: int) -> str:
    return "".join(f"{i:0{width}d}\n" for i in range(count))


def test_a_token_file_beyond_the_bounds_is_refused_at_start_and_at_reload(
    pki: Pki, tmp_path: Path
) -> None:
    too_many = _many_tokens(MAX_TOKENS + 1, 24)
    too_long = TOKEN + "\n" + "x" * (MAX_TOKEN_CHARS + 1) + "\n"
    too_big = TOKEN + "\n" + "#" * TOKEN_FILE_LIMIT + "\n"
    for text, message in (
        (too_many, f"more than {MAX_TOKENS} tokens"),
        (too_long, f"more than the {MAX_TOKEN_CHARS} a token may be"),
        (too_big, "is 1.0 MiB, more than the 1.0 MiB it may be"),
    ):
        tokens = tmp_path / "tokens"
        tokens.write_text(text)
        tokens.chmod(0o600)
        log = tmp_path / f"start-{len(message)}.log"
        code = _start(_command(tmp_path / "start", free_port(), "--token-file", str(tokens)), log)
        output = log.read_text(errors="replace")
        assert code == 1, output
        (error,) = _error_lines(output)
        assert f"--token-file {tokens}" in error
        assert message in error

    with agent_with(pki, tmp_path / "agent", tokens=f"{TOKEN}\n") as agent:
        context = _client(pki, None)
        assert _tls_get(agent.port, context, token=TOKEN)[1] == "HTTP/1.1 200 OK"
        assert agent.tokens is not None
        for text, message in (
            (too_many, f"more than {MAX_TOKENS} tokens"),
            (too_big, "more than the 1.0 MiB it may be"),
        ):
            agent.tokens.write_text(text)
            agent.reload("Reload: token file failed")
            (line,) = [x for x in agent.log().splitlines() if message in x]
            assert "keeping the previous one" in line
            assert _tls_get(agent.port, context, token=TOKEN)[1] == "HTTP/1.1 200 OK"
            assert _tls_get(agent.port, context, token="w" * 32)[1] == "HTTP/1.1 401 Unauthorized"


class _Flood:
    """``threads`` kept-alive TLS connections, each sending ``requests`` requests with the
    header ``auth`` (one after the other, each answer read) and then stopping."""

    def __init__(
        self, port: int, context: ssl.SSLContext, auth: str, threads: int, requests: int
    ) -> None:
        self.port, self.context, self.requests = port, context, requests
        self.request = f"GET /gpu/info HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
        self.answered = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=30) as raw,
                self.context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                for _ in range(self.requests):
                    tls.sendall(self.request)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = tls.recv(65536)
                        if not chunk:
                            raise ConnectionError("closed before the answer")
                        head += chunk
                    header, _, body = head.partition(b"\r\n\r\n")
                    length = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    while len(body) < length:
                        body += tls.recv(65536)
                    if not header.startswith(b"HTTP/1.1 401"):
                        raise ConnectionError(header.split(b"\r\n")[0].decode())
                    with self._lock:
                        self.answered += 1
        except (OSError, ConnectionError) as err:
            self.failures.append(repr(err))

    def running(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=120)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _probe_latencies(agent: Agent, flood: _Flood | None, count: int = 40) -> list[float]:
    """Plain loopback GETs (new connections, one after the other): while ``flood`` runs, or
    ``count`` of them without one."""
    latencies: list[float] = []
    while flood.running() if flood is not None else len(latencies) < count:
        started = time.perf_counter()
        assert agent.plain_get("/gpu/info")[0] == 200
        latencies.append(time.perf_counter() - started)
    return latencies


def _flooded(agent: Agent, pki: Pki, auth: str) -> tuple[float, float, int]:
    """A bounded flood with ``auth``: the probes' median latency, the agent's CPU time per
    flood request, and how many probes were made."""
    flood = _Flood(agent.port, _client(pki, None), auth, threads=4, requests=400)
    cpu = _cpu_seconds(agent.proc.pid)
    flood.start()
    wait_until(lambda: flood.answered > 0 or not flood.running(), what="the flood", timeout_s=30)
    latencies = _probe_latencies(agent, flood)
    flood.join()
    used = _cpu_seconds(agent.proc.pid) - cpu
    assert flood.failures == []
    assert flood.answered == 4 * 400
    return statistics.median(latencies), used / flood.answered, len(latencies)


@pytest.mark.timeout(180)
def test_a_flood_of_wrong_tokens_costs_what_a_flood_without_one_does(
    pki: Pki, tmp_path: Path
) -> None:
    """The largest token file the bounds allow (4,096 tokens of 200 characters): a wrong
    token is one hash and one lookup, so plain loopback requests during a flood of wrong
    tokens are about as fast as during the same flood without a token (before, each wrong
    token was compared with every token: several times the cost)."""
    width = 200
    text = _many_tokens(MAX_TOKENS - 1, width) + TOKEN + "\n"
    assert len(text.encode()) <= TOKEN_FILE_LIMIT
    with agent_with(pki, tmp_path / "agent", tokens=text) as agent:
        idle = statistics.median(_probe_latencies(agent, None))
        missing, missing_cpu, probes_a = _flooded(agent, pki, "")
        wrong, wrong_cpu, probes_b = _flooded(
            agent, pki, f"Authorization: Bearer {'w' * width}\r\n"
        )
        report = (
            f"plain loopback median: idle {idle * 1e3:.1f} ms, during a flood without a token "
            f"{missing * 1e3:.1f} ms ({probes_a} probes), during a flood of wrong tokens "
            f"{wrong * 1e3:.1f} ms ({probes_b} probes); agent CPU per flood request: "
            f"{missing_cpu * 1e3:.2f} ms without a token, {wrong_cpu * 1e3:.2f} ms wrong"
        )
        print(report)
        assert probes_a >= 5
        assert probes_b >= 5, report
        assert wrong <= 1.6 * missing + 0.002, report
        assert wrong_cpu <= 1.35 * missing_cpu + 0.0001, report
        assert _tls_get(agent.port, _client(pki, None), token=TOKEN)[1] == "HTTP/1.1 200 OK"


# --- token files and certificates that are not what they say, under 256 MB -----------------


def _hostile(path: Path, kind: str) -> None:
    """Make ``path`` a file of ``kind``."""
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a blocking read would wait for ever
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # endless: an unbounded read takes every byte of memory
    elif kind == "directory":
        path.mkdir()
    else:
        with path.open("wb") as out:
            out.truncate(20 * 1000**3)  # 20 GB, sparse


# What the one line says of such a file: not a regular file (click's own check of a
# directory given to --token-file included), or larger than its bound.
REFUSALS = ("not a file", "not a regular file", "is a directory", "more than the 1.0 MiB")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "sparse-20-GB"])
@pytest.mark.parametrize("option", ["--token-file", "--tls-cert", "--tls-key", "--tls-client-ca"])
def test_a_hostile_file_is_refused_in_one_line_under_256_mb(
    pki: Pki, tmp_path: Path, option: str, kind: str
) -> None:
    files = {
        "--tls-cert": pki.pem("server"),
        "--tls-key": pki.key("server"),
        "--tls-client-ca": pki.pem("ca"),
    }
    hostile = tmp_path / "hostile"
    _hostile(hostile, kind)
    if option == "--token-file":
        args = ["--token-file", str(hostile)]
    else:
        files[option] = hostile
        args = [arg for name, path in files.items() for arg in (name, str(path))]
    log = tmp_path / "agent.log"
    with memory_cgroup(256 * 1024 * 1024) as group, log.open("ab") as out:
        proc = subprocess.Popen(
            _command(tmp_path, free_port(), *args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            preexec_fn=group.enter,  # noqa: PLW1509 - it only moves the child into a cgroup
        )
        try:
            code = proc.wait(timeout=60)  # a read that blocks or never ends fails this wait
        finally:
            stop_process(proc)
        assert group.oom_kills == 0, f"killed for memory under {group.layout}"
    output = log.read_text(errors="replace")
    assert code in (1, 2), output  # a start failure; 2: click's usage error (a directory)
    (error,) = _error_lines(output)
    assert option in error
    assert str(hostile) in error
    assert any(refusal in error for refusal in REFUSALS), error
    assert "Traceback" not in output
