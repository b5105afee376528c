"""``nvidia-docker-ctl mesos``: flags, decode and exec, with the agent's answer given."""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from controller.ctl import mesos as mesos_commands
from controller.ctl.main import main
from controller.ctl.mesos import AgentAnswer, fetch_flags, node_or_default
from controller.errors import ControllerError
from controller.options import Options
from mesos.blob import decode
from mesos.flags import legacy_flags, native_flags
from tests.support.cli import cli_runner
from tests.unit.controller.ctl_lines import error_of

INFO = b'{"Version":{"Driver":"580.159.04","CUDA":"13.0"},"Devices":[{"UUID":"GPU-aaaa"}]}\n'
LEGACY = legacy_flags(INFO, ["GPU-aaaa"])
NATIVE = native_flags(INFO, ["GPU-aaaa"], [0])


class AgentAnswers:
    """Stands in for the node's agent: answers /mesos/cli by format, records the requests."""

    def __init__(self, answers: Mapping[str, str], left_out: str | None = None) -> None:
        self.answers = answers
        self.left_out = left_out
        self.requests: list[tuple[str | None, str, dict[str, str]]] = []

    def __call__(self, node: str | None, path: str, params: Mapping[str, str]) -> AgentAnswer:
        self.requests.append((node, path, dict(params)))
        return AgentAnswer(self.answers[params["format"]].encode(), self.left_out)


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> AgentAnswers:
    answers = AgentAnswers({"legacy": LEGACY, "native": NATIVE})
    monkeypatch.setattr(mesos_commands, "fetcher", lambda _options: answers)
    monkeypatch.delenv("NV_HOST", raising=False)
    for key in ("MESOS_ATTRIBUTES", "MESOS_RESOURCES", "MESOS_ISOLATION"):
        monkeypatch.delenv(key, raising=False)
    return answers


def mesos(args: list[str], **kwargs: Any) -> Result:
    """``nvidia-docker-ctl mesos ARGS``, through the tool's edge."""
    return cli_runner().invoke(main, ["mesos", *args], **kwargs)


def test_decode_prints_the_json_from_an_argument_or_stdin() -> None:
    blob = LEGACY.split()[0].removeprefix("--attributes=gpus:")
    by_argument = mesos(["decode", blob])
    assert by_argument.exit_code == 0
    assert by_argument.stdout_bytes == INFO
    by_stdin = mesos(["decode"], input=LEGACY + "\n")
    assert by_stdin.exit_code == 0
    assert by_stdin.stdout_bytes == INFO


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        ("eJx+AAAA", "'+' at position 4 is from the standard base64 alphabet"),
        ("AAAAAAAA", "not a zlib stream"),
        ("", "empty input"),
    ],
)
def test_decode_of_garbage_is_one_line_and_exit_1(blob: str, reason: str) -> None:
    result = mesos(["decode", blob])
    assert result.exit_code == 1
    assert error_of(result.stderr).startswith("not a gpus blob: ")
    assert reason in result.stderr
    assert "Traceback" not in result.output


def test_flags_prints_the_agents_line_and_passes_node_and_dev(agent: AgentAnswers) -> None:
    result = mesos(["flags", "--format", "native", "--dev", "0 GPU-aa", "ssh://admin@node2:"])
    assert result.exit_code == 0, result.output
    assert result.stdout == NATIVE + "\n"
    assert agent.requests == [
        ("ssh://admin@node2:", "/mesos/cli", {"format": "native", "dev": "0 GPU-aa"})
    ]


def test_flags_names_what_the_line_leaves_out_on_stderr(agent: AgentAnswers) -> None:
    agent.left_out = "GPU 0 is in MIG mode (Mesos's gpu/nvidia isolator gives whole GPUs)"
    result = mesos(["flags", "--format", "native", "node2"])
    assert result.exit_code == 0, result.output
    assert result.stdout == NATIVE + "\n"  # what a launch script captures: the line only
    assert result.stderr == (
        "nvidia-docker-ctl: node2: not offered: GPU 0 is in MIG mode (Mesos's gpu/nvidia "
        "isolator gives whole GPUs)\n"
    )
    agent.left_out = None
    assert mesos(["flags", "node2"]).stderr == ""


def test_flags_uses_nv_host_when_no_node_is_given(
    agent: AgentAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NV_HOST", "http://10.0.0.1:3476")
    assert mesos(["flags"]).exit_code == 0
    assert agent.requests == [("http://10.0.0.1:3476", "/mesos/cli", {"format": "legacy"})]


def test_node_or_default() -> None:
    assert node_or_default("n1", Options.build({"NV_HOST": "n2"})) == "n1"
    assert node_or_default(None, Options.build({"NV_HOST": "n2"})) == "n2"
    assert node_or_default(None, Options.build({"NV_HOST": ""})) is None
    assert node_or_default(None, Options.build({})) is None


def test_an_old_agent_answering_legacy_to_native_is_refused() -> None:
    old_agent = AgentAnswers({"native": LEGACY})
    with pytest.raises(ControllerError, match="answered the legacy format to format=native"):
        fetch_flags("node1", "native", None, get=old_agent)


def test_an_answer_mesos_could_not_read_is_refused() -> None:
    broken = AgentAnswers({"legacy": "<html>proxy error</html>"})
    with pytest.raises(ControllerError, match="node1: the agent's /mesos/cli is not usable"):
        fetch_flags("node1", "legacy", None, get=broken)


def test_a_long_answer_that_is_not_flags_is_one_short_line(agent: AgentAnswers) -> None:
    # a web server's page on the agent's port (or megabytes of anything) was quoted whole on
    # the error line
    agent.answers = {"legacy": "<html>" + "x" * 100_000 + "</html>"}
    done = mesos(["flags", "node1:"])
    assert done.exit_code == 1
    assert done.stdout == ""
    line = error_of(done.stderr)
    assert "node1:: the agent's /mesos/cli is not usable: '<html>xxx" in line
    assert len(line) < 400


def test_exec_runs_the_agent_with_merged_flags(
    agent: AgentAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    executed: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(os, "execvp", lambda p, a: executed.append((p, a)))
    monkeypatch.setenv("MESOS_ATTRIBUTES", "zone:eu1")
    result = mesos(
        ["exec", "--format", "native", "--", "mesos-agent", "--master=m:5050", "--attributes=r:1"]
    )
    assert result.exit_code == 0, result.output
    program, argv = executed[0]
    assert program == "mesos-agent"
    assert argv[:2] == ["mesos-agent", "--master=m:5050"]
    flags = dict(arg[2:].split("=", 1) for arg in argv[1:])
    assert flags["attributes"].startswith("r:1;gpus:")  # the operator's value, then ours
    assert decode(flags["attributes"]) == INFO
    assert flags["resources"] == "gpus:1"
    assert flags["nvidia_gpu_devices"] == "0"
    assert flags["isolation"].endswith("cgroups/devices,filesystem/linux,gpu/nvidia")


def test_exec_dry_run_prints_the_command_shell_quoted(agent: AgentAnswers) -> None:
    result = mesos(["exec", "--dry-run", "--", "mesos-agent", "--master=m", "--attributes=rack:r7"])
    assert result.exit_code == 0
    # pasted into a shell, the line is the same words again: the ; and {} are quoted
    words = shlex.split(result.stdout)
    attributes, resources = LEGACY.split()
    assert words == [
        "mesos-agent",
        "--master=m",
        "--attributes=rack:r7;" + attributes.removeprefix("--attributes="),
        resources,
    ]
    assert result.stdout == shlex.join(words) + "\n"
    assert "'--attributes=rack:r7;gpus:" in result.stdout


def test_exec_refuses_a_conflict_in_one_line_as_a_usage_error(agent: AgentAnswers) -> None:
    result = mesos(["exec", "--", "mesos-agent", "--isolation=cgroups/devices,gpu/nvidia"])
    assert result.exit_code == 2
    assert "use the native format" in error_of(result.stderr)


def test_exec_of_a_missing_program_says_so(agent: AgentAnswers, tmp_path: Path) -> None:
    missing = str(tmp_path / "mesos-agent")
    result = mesos(["exec", "--", missing, "--master=m"])
    assert result.exit_code == 1
    assert error_of(result.stderr) == (
        f"cannot run {missing}: No such file or directory: check the command after --"
    )


def test_exec_needs_a_command() -> None:
    result = mesos(["exec"])
    assert result.exit_code == 2
    assert error_of(result.stderr).startswith("Missing argument")


def test_flags_dev_help_says_what_mig_devices_do() -> None:
    text = " ".join(mesos(["flags", "--help"]).stdout.split())
    assert "MIG devices (<gpu>:<mig>, MIG-...) with --format legacy only" in text


def test_help_names_every_command() -> None:
    result = mesos(["--help"])
    assert result.exit_code == 0
    for command in ("flags", "decode", "exec"):
        assert command in result.stdout


def _streaming_server(head: bytes, total: int) -> tuple[int, list[int], threading.Thread]:
    """A server on loopback that answers one request with ``head`` and then ``total`` bytes
    of body (or fewer, when the client closes first); ``sent`` gets how many it sent."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sent: list[int] = []

    def serve() -> None:
        with server, server.accept()[0] as conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(head)
            count, block = 0, b"x" * 65536
            try:
                while count < total:
                    count += conn.send(block[: total - count])
            except OSError:
                pass
            sent.append(count)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, sent, thread


def mesos_in_a_thread(args: list[str]) -> Result:
    """``mesos(args)`` for a command that really asks over the network: its ``asyncio.run``
    runs in a thread of its own, whose event loop it makes and closes. In the test's thread
    it would drop the loop an earlier async test's plugin left set there (pytest-asyncio
    0.24, the declared floor) without closing it, and the loop's sockets would be reported
    unclosed in whichever later test the garbage collector runs."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(mesos, args).result(timeout=60)


def test_flags_from_a_port_streaming_100_mb_stops_at_16_mib_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NV_HOST", raising=False)
    total = 100 * 2**20
    port, sent, thread = _streaming_server(b"HTTP/1.1 200 OK\r\n\r\n", total)
    done = mesos_in_a_thread(["flags", f"http://127.0.0.1:{port}"])
    thread.join(10)
    assert done.stdout == ""
    assert error_of(done.stderr) == (
        f"http://127.0.0.1:{port}: GET /mesos/cli failed: the answer is over 16 MiB: "
        "is this an nvidia-docker agent?"
    )
    assert sent
    assert sent[0] < total  # the client stopped reading


def test_flags_from_an_agent_that_cuts_its_answer_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NV_HOST", raising=False)
    port, _sent, thread = _streaming_server(b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n", 40)
    done = mesos_in_a_thread(["flags", f"http://127.0.0.1:{port}"])
    thread.join(10)
    assert done.exit_code == 3
    line = error_of(done.stderr)
    assert "GET /mesos/cli failed: the answer was cut off after 40 of 900 bytes" in line
    assert "https://?" not in line
