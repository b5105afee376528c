"""``nvidia-docker-start-hook`` against the plugin application on a real unix socket, with a
scripted gate: what it reads of a runtime's state and config, what it asks, its exit status
and line, and how it fails open."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from plugin import start_hook
from plugin.authz import HookAsk, HookDevice
from plugin.protocol import create_app
from plugin.volumes import VolumeStore
from tests.support.podman import SHIPPED_START_HOOK
from tests.support.scripted_gate import ScriptedGate as Gate

REPO = Path(__file__).resolve().parents[3]
CID = "3f2a1b9c0d4e" + "ab" * 26
REFUSAL = "container 3f2a1b9c0d4e may not start: it names GPUs leased to others: GPU 3 by ..."
GPU3 = {"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}
RENAMED = {"path": "/dev/gpu0", "type": "c", "major": 195, "minor": 1}
OTHER = {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
async def agent_socket(tmp_path: Path, store: VolumeStore, gate: Gate) -> AsyncIterator[Path]:
    """The plugin application, with ``gate``, on a unix socket."""
    path = tmp_path / "nvidia-docker.sock"
    runner = web.AppRunner(create_app(store, authz_gate=gate))
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    yield path
    await runner.cleanup()


def bundle(tmp_path: Path, devices: list[dict[str, Any]], annotations: dict[str, str]) -> str:
    """A bundle with a config.json, and the OCI state naming it (the hook's standard input)."""
    directory = tmp_path / "bundle"
    directory.mkdir(exist_ok=True)
    config = {
        "root": {"path": "rootfs"},
        "linux": {"devices": devices},
        "annotations": {"io.container.manager": "libpod", **annotations},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return json.dumps(
        {"ociVersion": "1.0.2", "id": CID, "status": "creating", "bundle": str(directory)}
    )


async def run_hook(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    state: str,
    *args: str,
) -> tuple[int, str]:
    """The hook's exit status and standard error (it blocks: run in a thread)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(state))
    status = await asyncio.to_thread(start_hook.main, list(args))
    return status, capsys.readouterr().err


async def test_a_refusal_exits_1_with_the_agents_line_and_an_allow_exits_0(
    tmp_path: Path,
    agent_socket: Path,
    gate: Gate,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = bundle(
        tmp_path,
        [GPU3, RENAMED, OTHER],
        {"nvidia-docker.lease": "lease-1", "nvidia-docker.lease.devices": "3", "team": "a"},
    )
    gate.refusal = REFUSAL
    status, err = await run_hook(monkeypatch, capsys, state, "--socket", str(agent_socket))
    assert (status, err) == (1, f"nvidia-docker: {REFUSAL}\n")
    assert gate.asked == [
        HookAsk(
            CID,
            (HookDevice("/dev/nvidia3", 195, 3), HookDevice("/dev/gpu0", 195, 1)),
            {"nvidia-docker.lease": "lease-1", "nvidia-docker.lease.devices": "3"},
        )
    ]
    gate.refusal = None
    status, err = await run_hook(monkeypatch, capsys, state, "--socket", str(agent_socket))
    assert (status, err) == (0, "")


async def test_a_container_without_nvidia_devices_starts_without_asking(
    tmp_path: Path,
    agent_socket: Path,
    gate: Gate,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gate.refusal = REFUSAL
    state = bundle(tmp_path, [OTHER], {})
    status, err = await run_hook(monkeypatch, capsys, state, "--socket", str(agent_socket))
    assert (status, err) == (0, "")
    assert gate.asked == []


async def test_no_agent_is_an_allow_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = bundle(tmp_path, [GPU3], {})
    gone = tmp_path / "gone.sock"
    status, err = await run_hook(monkeypatch, capsys, state, "--socket", str(gone))
    assert status == 0
    assert err == (
        f"nvidia-docker-start-hook: allowed without the agent's answer ({gone}): "
        "No such file or directory\n"
    )


async def test_an_agent_that_does_not_answer_in_time_is_an_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(path))
        silent.listen()  # accepts (the kernel's backlog), never answers
        state = bundle(tmp_path, [GPU3], {})
        status, err = await run_hook(
            monkeypatch, capsys, state, "--socket", str(path), "--timeout", "0.2"
        )
    assert status == 0
    assert "allowed without the agent's answer" in err
    assert "timed out" in err


async def test_an_agent_that_trickles_its_answer_is_an_allow_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--timeout bounds the whole exchange: an answer that comes a byte at a time must not
    keep the hook past it (Podman kills a hook at its file's timeout and fails the start)."""
    path = tmp_path / "slow.sock"
    stop = asyncio.Event()
    ended = asyncio.Event()  # the handler's end: awaited before the test's loop closes

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(65536)
            for byte in b"HTTP/1.0 200 OK\r\n\r\n" + b'{"Allow": false, "Msg": "late"}':
                writer.write(bytes([byte]))
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)
                if stop.is_set():
                    break
        except ConnectionError:
            pass  # the hook gave up and closed its end
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            ended.set()

    server = await asyncio.start_unix_server(trickle, str(path))
    try:
        state = bundle(tmp_path, [GPU3], {})
        started = time.monotonic()
        status, err = await run_hook(
            monkeypatch, capsys, state, "--socket", str(path), "--timeout", "0.5"
        )
        took = time.monotonic() - started
    finally:
        stop.set()
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(ended.wait(), 10)
    assert status == 0
    assert "allowed without the agent's answer" in err
    assert "timed out" in err
    assert took < 2.0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        start_hook.main(["--timeout", value])
    assert stopped.value.code == 2
    assert f"{value!r} is not a number of seconds above 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ("[" * 100_000, "maximum recursion depth"),
        (json.dumps({"linux": {"devices": 5}}), "its linux.devices is not a list"),
    ],
)
async def test_a_config_that_is_no_runtime_config_exits_1_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    config: str,
    line: str,
) -> None:
    (tmp_path / "config.json").write_text(config)
    state = json.dumps({"id": CID, "bundle": str(tmp_path)})
    status, err = await run_hook(monkeypatch, capsys, state)
    assert status == 1
    assert err.startswith(f"nvidia-docker-start-hook: cannot read {tmp_path}/config.json: ")
    assert line in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (web.Response(status=404), "the agent has no start gate"),
        (web.Response(status=500), "HTTP 500 to POST /NvidiaDocker.MayStart"),
        (web.json_response({"Msg": "x"}), "has no Allow"),
        (
            web.json_response({"Allow": False, "Msg": "bad", "Err": "odd body"}),
            "the agent took the ask as a bad one: odd body",
        ),
    ],
)
async def test_an_answer_that_is_not_the_protocol_is_an_allow(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    answer: web.Response,
    why: str,
) -> None:
    app = web.Application()

    async def scripted(request: web.Request) -> web.Response:
        return answer

    app.router.add_post("/NvidiaDocker.MayStart", scripted)
    runner = web.AppRunner(app)
    await runner.setup()
    path = tmp_path / "odd.sock"
    await web.UnixSite(runner, str(path)).start()
    try:
        state = bundle(tmp_path, [GPU3], {})
        status, err = await run_hook(monkeypatch, capsys, state, "--socket", str(path))
    finally:
        await runner.cleanup()
    assert status == 0
    assert err.startswith("nvidia-docker-start-hook: allowed without the agent's answer")
    assert why in err


@pytest.mark.parametrize(
    ("state", "line"),
    [
        ("", "no OCI container state with an 'id' and a 'bundle'"),
        ('{"id": "x"}', "no OCI container state with an 'id' and a 'bundle'"),
        ('{"id": 7, "bundle": "/"}', "the OCI container state's 'id' and 'bundle' are not strings"),
        ('{"id": "x", "bundle": "/nonexistent"}', "cannot read /nonexistent/config.json"),
    ],
)
async def test_a_call_that_is_not_a_runtimes_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], state: str, line: str
) -> None:
    status, err = await run_hook(monkeypatch, capsys, state)
    assert status == 1
    assert err.startswith(f"nvidia-docker-start-hook: {line}")


def test_the_shipped_hook_file_runs_the_packaged_hook_for_podmans_containers_as_documented() -> (
    None
):
    hook = json.loads(SHIPPED_START_HOOK.read_text())
    assert hook["version"] == "1.0.0"
    assert hook["hook"]["path"] == "/opt/nvidia-docker/venv/bin/nvidia-docker-start-hook"
    # the packaged unit's plugin socket (its NVIDIA_DOCKER_PLUGIN_SOCKET_DIR): the hook is
    # installed beside it (docs/install.md); start_hook.DEFAULT_SOCKET is the agent's default
    assert hook["hook"]["args"][1:] == ["--socket", "/run/nvidia-docker/nvidia-docker.sock"]
    assert hook["stages"] == ["prestart"]
    assert hook["when"] == {"annotations": {"^io\\.container\\.manager$": "^libpod$"}}
    docs = (REPO / "docs" / "leases.md").read_text()
    section = docs[docs.index("## Refusing a start with Podman") :]
    assert json.loads(section.split("```json")[1].split("```")[0]) == hook
