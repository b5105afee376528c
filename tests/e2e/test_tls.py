"""The REST API over TLS with client certificates and tokens, end to end, with real certificates.

``openssl`` makes a CA, the agent's certificate for 127.0.0.1 and localhost, a client
certificate, and a second unrelated CA with its own client and server certificates
(``tests.support.certs``). Real agent processes serve them; ``curl`` and
``nvidia-docker-ctl`` are the clients. Each wrong setting must be refused with its own
message: CA not trusted, name mismatch, no client certificate, a client certificate of the
other CA, no token, a wrong token, plain HTTP to a TLS-only port (``--no-plain-loopback``),
while plain HTTP to loopback on the default agent needs neither. SIGHUP then rotates the server
certificate and the tokens while requests keep flowing: none may fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.certs import Pki, fingerprint, make_pki, reissue_server
from tests.support.services import free_port, stop_process, wait_until
from tests.unit.controller.ctl_lines import error_of

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOKEN = "a" * 20 + "-first-token-0123456789"
TOKEN_2 = "b" * 20 + "-second-token-0123456789"


@dataclass
class TlsAgent:
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    cert: Path
    key: Path
    tokens: Path

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def reload(self, line: str) -> None:
        """SIGHUP, then wait until the log says ``line`` once more than before."""
        before = self.log_text().count(line)
        self.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: self.log_text().count(line) > before, what=line, timeout_s=30)


@contextlib.contextmanager
def tls_agent(pki: Pki, base: Path, host: str = "127.0.0.1", *extra: str) -> Iterator[TlsAgent]:
    """An agent with TLS, client certificates from the CA and a token file (files of its own,
    so that a test may rotate them)."""
    base.mkdir(parents=True, exist_ok=True)
    cert, key, tokens = base / "server.pem", base / "server.key", base / "tokens"
    cert.write_bytes(pki.pem("server").read_bytes())
    key.write_bytes(pki.key("server").read_bytes())
    key.chmod(0o600)
    tokens.write_text(f"# agent tokens\n{TOKEN}\n")
    tokens.chmod(0o600)
    port = free_port(host)
    log = base / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon", "-l", f"{host}:{port}",
                "-s", str(base / "plugins"), "-d", str(base / "volumes"), "--simulate", "h200",
                "--tls-cert", str(cert), "--tls-key", str(key),
                "--tls-client-ca", str(pki.pem("ca")), "--token-file", str(tokens), *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    agent = TlsAgent(host, port, proc, log, cert, key, tokens)
    try:
        wait_until(lambda: "Ready" in agent.log_text(), what="TLS agent", timeout_s=60, proc=proc)
        yield agent
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    root = Path(tempfile.mkdtemp(prefix="nvd-pki-"))
    try:
        yield make_pki(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(pki: Pki) -> Iterator[TlsAgent]:
    with tls_agent(pki, pki.root / "agent") as running:
        yield running


@pytest.fixture(scope="module")
def strict_agent(pki: Pki) -> Iterator[TlsAgent]:
    """``--no-plain-loopback``: TLS and the token from the node itself too."""
    with tls_agent(pki, pki.root / "strict", "127.0.0.1", "--no-plain-loopback") as running:
        yield running


@pytest.fixture(scope="module")
def agent_by_other_address(pki: Pki) -> Iterator[TlsAgent]:
    """The same certificate, served on 127.0.0.2: an address the certificate does not list."""
    with tls_agent(pki, pki.root / "agent2", "127.0.0.2") as running:
        yield running


# --- curl -----------------------------------------------------------------------------------


def curl(url: str, *args: str) -> tuple[int, str, str]:
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "20", "-w", "\n%{http_code}", *args, url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def test_curl_with_the_right_ca_certificate_and_token(pki: Pki, agent: TlsAgent) -> None:
    code, out, err = curl(
        f"{agent.url}/gpu/info/json",
        "--cacert", str(pki.pem("ca")),
        "--cert", str(pki.pem("client")), "--key", str(pki.key("client")),
        "-H", f"Authorization: Bearer {TOKEN}",
    )  # fmt: skip
    assert code == 0, err
    body, status = out.rsplit("\n", 1)
    assert status == "200"
    assert len(json.loads(body)["Devices"]) == 1
    # localhost is in the certificate too
    code, out, err = curl(
        f"https://localhost:{agent.port}/gpu/info",
        "--cacert", str(pki.pem("ca")),
        "--cert", str(pki.pem("client")), "--key", str(pki.key("client")),
        "-H", f"Authorization: Bearer {TOKEN}",
    )  # fmt: skip
    assert code == 0, err
    assert out.endswith("\n200")


@pytest.mark.parametrize(
    ("case", "exit_code", "message"),
    [
        ("other CA", 60, "SSL certificate problem: self-signed certificate in certificate chain"),
        ("name mismatch", 60, "no alternative certificate subject name matches"),
        ("no client certificate", 56, "alert certificate required"),
        ("client certificate of another CA", 56, "alert unknown ca"),
        ("no token", 0, "401:this agent needs a bearer token"),
        ("wrong token", 0, "401:token refused"),
        ("plain HTTP", 52, "Empty reply from server"),
    ],
)
def test_curl_each_wrong_setting_is_refused(
    case: str,
    exit_code: int,
    message: str,
    pki: Pki,
    agent: TlsAgent,
    agent_by_other_address: TlsAgent,
    strict_agent: TlsAgent,
) -> None:
    ca = ["--cacert", str(pki.pem("ca"))]
    cert = ["--cert", str(pki.pem("client")), "--key", str(pki.key("client"))]
    token = ["-H", f"Authorization: Bearer {TOKEN}"]
    url = f"{agent.url}/gpu/info/json"
    args = {
        "other CA": ["--cacert", str(pki.pem("other-ca")), *cert, *token],
        "name mismatch": [*ca, *cert, *token],
        "no client certificate": [*ca, *token],
        "client certificate of another CA": [
            *ca, "--cert", str(pki.pem("other-client")), "--key", str(pki.key("other-client")),
            *token,
        ],
        "no token": [*ca, *cert],
        "wrong token": [*ca, *cert, "-H", "Authorization: Bearer " + "x" * 32],
        "plain HTTP": [],
    }[case]  # fmt: skip
    if case == "name mismatch":
        url = f"{agent_by_other_address.url}/gpu/info/json"
    if case == "plain HTTP":  # a TLS-only port (plain loopback is the other test)
        url = f"http://127.0.0.1:{strict_agent.port}/gpu/info/json"
    code, out, err = curl(url, *args)
    assert code == exit_code, (out, err)
    if exit_code == 0:
        body, status = out.rsplit("\n", 1)
        assert f"{status}:{body}".startswith(message)
        assert "Devices" not in body
    else:
        assert message in err


def test_plain_http_to_loopback_needs_neither_tls_nor_token(
    pki: Pki, agent: TlsAgent, strict_agent: TlsAgent
) -> None:
    """A launch script's plain ``curl localhost:3476`` on the node keeps working on the TLS
    port; TLS on that port still asks for the token. ``--no-plain-loopback`` refuses it."""
    for url in (f"http://127.0.0.1:{agent.port}", f"http://localhost:{agent.port}"):
        code, out, err = curl(f"{url}/gpu/info/json")
        assert code == 0, err
        body, status = out.rsplit("\n", 1)
        assert status == "200"
        assert len(json.loads(body)["Devices"]) == 1
    code, out, err = curl(f"http://127.0.0.1:{agent.port}/docker/cli")
    assert (code, out.rsplit("\n", 1)[1]) == (0, "200"), err
    assert "--device=/dev/nvidiactl" in out
    code, out, _ = curl(
        f"{agent.url}/gpu/info/json",
        "--cacert", str(pki.pem("ca")),
        "--cert", str(pki.pem("client")), "--key", str(pki.key("client")),
    )  # fmt: skip
    assert (code, out.rsplit("\n", 1)[1]) == (0, "401")
    assert "plain HTTP without a token on loopback" in agent.log_text()
    code, _, err = curl(f"http://127.0.0.1:{strict_agent.port}/gpu/info/json")
    assert code == 52, err
    assert "plain HTTP without a token" not in strict_agent.log_text()


# --- nvidia-docker-ctl ------------------------------------------------------------------------


def ctl_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "SSH_AUTH"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    env.pop("COLUMNS", None)
    return env


async def ctl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.ctl.main", *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        cwd=REPO, env=env or ctl_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ctl_with_the_right_ca_certificate_and_token(
    pki: Pki, agent: TlsAgent, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    code, out, err = await ctl(
        "status", agent.url,
        "--ca", str(pki.pem("ca")), "--cert", str(pki.pem("client")),
        "--key", str(pki.key("client")), "--token-file", str(token_file),
    )  # fmt: skip
    assert code == 0, err
    assert out.splitlines()[1].split()[:3] == [agent.url, "0", "H200"]
    # the same from the environment (what the wrapper and the Mesos helper read)
    env = ctl_env(
        NV_TLS_CA=str(pki.pem("ca")),
        NV_TLS_CERT=str(pki.pem("client")),
        NV_TLS_KEY=str(pki.key("client")),
        NV_TOKEN_FILE=str(token_file),
    )
    code, out, err = await ctl("mesos", "flags", agent.url, env=env)
    assert code == 0, err
    assert out.startswith("--attributes=gpus:")


async def test_ctl_names_each_refusal_with_its_own_kind(
    pki: Pki,
    agent: TlsAgent,
    agent_by_other_address: TlsAgent,
    strict_agent: TlsAgent,
    tmp_path: Path,
) -> None:
    """One inventory, one host per wrong setting (per-host TLS variables), one run."""
    good_token, bad_token = tmp_path / "good-token", tmp_path / "bad-token"
    good_token.write_text(TOKEN + "\n")
    bad_token.write_text("y" * 32 + "\n")
    right = {
        "nvidia_docker_tls_ca": str(pki.pem("ca")),
        "nvidia_docker_tls_cert": str(pki.pem("client")),
        "nvidia_docker_tls_key": str(pki.key("client")),
        "nvidia_docker_token_file": str(good_token),
    }
    hosts: dict[str, dict[str, object]] = {
        "good": {},
        "untrusted": {"nvidia_docker_tls_ca": str(pki.pem("other-ca"))},
        "mismatch": {"ansible_host": "127.0.0.2", "port": agent_by_other_address.port},
        "no-client-cert": {"nvidia_docker_tls_cert": "", "nvidia_docker_tls_key": ""},
        "stranger-cert": {
            "nvidia_docker_tls_cert": str(pki.pem("other-client")),
            "nvidia_docker_tls_key": str(pki.key("other-client")),
        },
        "no-token": {"nvidia_docker_token_file": ""},
        "wrong-token": {"nvidia_docker_token_file": str(bad_token)},
        "plain-http": {"nvidia_docker_transport": "http", "port": strict_agent.port},
        # plain HTTP to loopback, no token: answered (--plain-loopback, the default)
        "plain-loopback": {"nvidia_docker_transport": "http", "nvidia_docker_token_file": ""},
    }
    inventory: dict[str, object] = {}
    for name, changes in hosts.items():
        variables: dict[str, object] = {
            "ansible_host": "127.0.0.1",
            "nvidia_docker_transport": "https",
            "nvidia_docker_agent_listen_port": agent.port,
            **right,
        }
        port = changes.pop("port", None)
        variables.update(changes)
        if port is not None:
            variables["nvidia_docker_agent_listen_port"] = port
        inventory[name] = variables
    path = tmp_path / "fleet.yml"
    path.write_text(json.dumps({"all": {"hosts": inventory}}))

    code, out, err = await ctl("status", "--jsonl", "-i", str(path))

    lines = {line["node"]: line for line in map(json.loads, out.splitlines())}
    assert code == 1, err
    reasons = {name: lines[name]["reason"] for name in hosts}
    assert reasons == {
        "good": None,
        "untrusted": "certificate not trusted",
        "mismatch": "certificate name mismatch",
        "no-client-cert": "client certificate refused",
        "stranger-cert": "client certificate refused",
        "no-token": "token refused",
        "wrong-token": "token refused",
        "plain-http": "disconnected",
        "plain-loopback": None,
    }
    errors = {name: lines[name]["error"] for name in hosts}
    assert "not trusted (self-signed certificate in certificate chain" in errors["untrusted"]
    assert "--ca FILE or NV_TLS_CA" in errors["untrusted"]
    assert "not valid for 127.0.0.2" in errors["mismatch"]
    assert "asks for a client certificate (mutual TLS)" in errors["no-client-cert"]
    assert f"refused the client certificate {pki.pem('other-client')}" in (errors["stranger-cert"])
    assert "unknown ca" in errors["stranger-cert"]
    assert "the agent asks for a token (401" in errors["no-token"]
    assert f"refused the token of {bad_token}" in errors["wrong-token"]
    assert "https://?" in errors["plain-http"]
    assert len(lines["good"]["status"]["Devices"]) == 1
    assert len(lines["plain-loopback"]["status"]["Devices"]) == 1


async def test_ctl_options_that_cannot_be_used_stop_before_any_node(
    agent: TlsAgent, tmp_path: Path
) -> None:
    code, out, err = await ctl("status", agent.url, "--ca", str(tmp_path / "missing.pem"))
    assert code == 2
    assert out == ""
    assert error_of(err) == (
        f"TLS CA file (--ca, NV_TLS_CA) {tmp_path / 'missing.pem'} does not exist"
    )


# --- rotation ---------------------------------------------------------------------------------


def _served_certificate(host: str, port: int, pki: Pki) -> str:
    """SHA-256 fingerprint of the certificate a new handshake gets (like openssl's)."""
    context = ssl.create_default_context(cafile=str(pki.pem("ca")))
    context.load_cert_chain(str(pki.pem("client")), str(pki.key("client")))
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


class _Hammer:
    """Requests in a loop on fresh and kept-alive connections, counting every failure."""

    def __init__(self, agent: TlsAgent, pki: Pki, token: str) -> None:
        self.context = ssl.create_default_context(cafile=str(pki.pem("ca")))
        self.context.load_cert_chain(str(pki.pem("client")), str(pki.key("client")))
        self.agent, self.token = agent, token
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _request(self, tls: ssl.SSLSocket) -> None:
        tls.sendall(
            b"GET /gpu/status/json HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {self.token}\r\n\r\n".encode()
        )
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
        if not header.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(header.split(b"\r\n")[0].decode())

    def once(self) -> None:
        host, port = self.agent.host, self.agent.port
        with (
            socket.create_connection((host, port), timeout=10) as raw,
            self.context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            self._request(tls)

    def _run(self) -> None:
        host, port = self.agent.host, self.agent.port
        while not self.stop.is_set():
            try:
                with (
                    socket.create_connection((host, port), timeout=10) as raw,
                    self.context.wrap_socket(raw, server_hostname=host) as tls,
                ):
                    for _ in range(5):  # a kept-alive connection across the reload
                        self._request(tls)
                        self.ok += 1
            except (OSError, ConnectionError) as err:
                self.failures.append(repr(err))

    def __enter__(self) -> _Hammer:
        self.thread.start()
        wait_until(lambda: self.ok > 20, what="requests flowing", timeout_s=30)
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def test_sighup_rotates_certificate_and_tokens_without_dropping_requests(
    pki: Pki, tmp_path: Path
) -> None:
    with tls_agent(pki, tmp_path / "rotating") as agent:
        first = _served_certificate(agent.host, agent.port, pki)
        assert first == fingerprint(pki.pem("server"))
        new_cert, new_key = reissue_server(pki, f"rotated-{os.getpid()}")

        with _Hammer(agent, pki, TOKEN) as hammer:
            # a new certificate: replaced in place, then SIGHUP
            agent.key.write_bytes(new_key.read_bytes())
            agent.cert.write_bytes(new_cert.read_bytes())
            done_before = hammer.ok
            agent.reload("Reload: TLS certificate and keys read again")
            wait_until(lambda: hammer.ok > done_before + 20, what="requests after", timeout_s=30)
            # a second token next to the first: both valid during the rotation
            agent.tokens.write_text(f"{TOKEN}\n{TOKEN_2}\n")
            agent.reload("Reload: 2 token(s) read again")
            done_before = hammer.ok
            wait_until(lambda: hammer.ok > done_before + 20, what="requests after", timeout_s=30)
        assert hammer.failures == []
        assert _served_certificate(agent.host, agent.port, pki) == fingerprint(new_cert)

        with _Hammer(agent, pki, TOKEN_2) as second:
            pass
        assert second.failures == []
        # the old token retired
        agent.tokens.write_text(f"{TOKEN_2}\n")
        agent.reload("Reload: 1 token(s) read again")
        retired = _Hammer(agent, pki, TOKEN)
        with pytest.raises(ConnectionError, match=r"HTTP/1\.1 401 Unauthorized"):
            retired.once()

        # a broken certificate file: logged, and the previous one stays in use
        agent.cert.write_text("not a certificate\n")
        agent.reload("Reload: TLS certificate failed")
        assert _served_certificate(agent.host, agent.port, pki) == fingerprint(new_cert)
        assert agent.proc.poll() is None
    log = agent.log_text()
    assert "keeping the previous one" in log
    assert "Traceback" not in log


# --- start-up -------------------------------------------------------------------------------


def _start(*args: str) -> subprocess.CompletedProcess[str]:
    base = Path(tempfile.mkdtemp(prefix="nvd-tls-start-"))
    try:
        return subprocess.run(
            [
                sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{free_port()}",
                "-s", str(base / "s"), "-d", str(base / "v"), "--simulate", "h200", *args,
            ],
            capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_unusable_files_stop_the_start_with_one_line(pki: Pki, tmp_path: Path) -> None:
    short = tmp_path / "short-token"
    short.write_text("tooshort\n")
    cases = [
        (["--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("client"))],
         "key values mismatch"),
        (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(pki.key("server"))],
         "cannot read the certificate"),
        (["--token-file", str(short)], "shorter than 16 characters"),
    ]  # fmt: skip
    for args, message in cases:
        result = _start(*args)
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if "Error" in line]
        assert len(errors) == 1, result.stderr
        assert message in errors[0]
        assert "Traceback" not in result.stderr
    result = _start("--tls-cert", str(pki.pem("server")))
    assert result.returncode == 2
    assert "--tls-cert and --tls-key go together" in result.stderr
