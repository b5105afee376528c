"""The GPU worker and its client: NVML (the fake pynvml) served across the pipe.

Most tests serve ``agent.gpu.worker.run`` in a thread on one end of a socket pair, with the
fake pynvml installed, and talk to it with the real client; the last ones start the real
worker process (``--simulate``), as the daemon does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import nodefile, worker
from agent.gpu import worker_protocol as wp
from agent.gpu.backend import GpuBackend
from agent.gpu.health import DOUBLE_BIT_ECC, XID
from agent.gpu.nvml_backend import NvmlBackend
from agent.gpu.simulated import SimulatedBackend
from agent.gpu.worker_client import WorkerClient, WorkerFailed, WorkerGone
from agent.health.rule import check_problem
from tests.unit.gpu.conftest import MakeFake
from tests.unit.gpu.fake_nvml import (
    DRIVER_NOT_LOADED,
    EVENT_XID_CRITICAL,
    LIB_RM_VERSION_MISMATCH,
    FakeCuda,
    FakeNvml,
)

REPO = Path(__file__).resolve().parents[3]

Served = tuple[WorkerClient, threading.Thread]
Serve = Callable[..., Any]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """Serve a backend in a thread; yields ``serve(start_backend) -> (client, thread)``."""
    running: list[Served] = []

    async def start(start_backend: Callable[[], GpuBackend], interval_s: float = 0.02) -> Served:
        ours, theirs = socket.socketpair()
        thread = threading.Thread(
            target=worker.run,
            args=(theirs, start_backend),
            kwargs={"health_interval_s": interval_s},
        )
        thread.start()
        try:
            client = await WorkerClient.attach(ours, start_timeout_s=10)
        except BaseException:
            thread.join(10)
            raise
        running.append((client, thread))
        return client, thread

    yield start
    for client, thread in running:
        await client.stop()
        await asyncio.to_thread(thread.join, 10)


def nvml_starter(fake: FakeNvml, tmp_path: Path) -> Callable[[], GpuBackend]:
    return lambda: NvmlBackend.start(
        cuda=lambda _bus: FakeCuda(fake.capture), sysfs=tmp_path / "sys", proc=tmp_path / "proc"
    )


async def test_the_worker_serves_what_nvml_says(
    make_fake: MakeFake, serve: Serve, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    direct = nvml_starter(fake, tmp_path)()
    client, _ = await serve(nvml_starter(fake, tmp_path))

    assert client.node_info() == direct.node_info()
    assert client.name == direct.name
    assert await client.read_statuses() == (direct.device_status(0), direct.device_status(1))
    assert await client.read_throughputs() == (
        direct.pcie_throughput(0),
        direct.pcie_throughput(1),
    )
    direct.close()


async def test_stop_shuts_nvml_down_and_ends_the_worker(
    make_fake: MakeFake, serve: Serve, tmp_path: Path
) -> None:
    fake = make_fake("h200")
    client, thread = await serve(nvml_starter(fake, tmp_path))
    await client.stop()
    await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive()
    assert fake.shutdowns == 1
    assert fake.event_sets
    assert all(s.freed for s in fake.event_sets)
    with pytest.raises(WorkerGone):
        await client.read_statuses()


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (LIB_RM_VERSION_MISMATCH, "library and kernel module versions differ"),
        (DRIVER_NOT_LOADED, "NVIDIA driver not loaded"),
    ],
)
async def test_nvml_refusing_to_start_mid_upgrade_is_reported_with_its_code(
    make_fake: MakeFake, serve: Serve, tmp_path: Path, code: int, words: str
) -> None:
    """During a driver upgrade nvmlInit says "not loaded" (9) or "versions differ" (18):
    the daemon must tell these "not yet" answers from a broken node."""
    fake = make_fake("h200")
    fake.init_error = code
    with pytest.raises(WorkerFailed) as failed:
        await serve(nvml_starter(fake, tmp_path))
    assert failed.value.nvml_code == code
    assert words in str(failed.value)


async def test_a_driver_gone_error_while_serving_is_pushed(
    make_fake: MakeFake, serve: Serve, tmp_path: Path
) -> None:
    fake = make_fake("h200")
    client, _ = await serve(nvml_starter(fake, tmp_path))
    pushes: list[dict[str, Any]] = []
    client.set_push_handler(pushes.append)
    fake.fail("nvmlDeviceGetPowerUsage", DRIVER_NOT_LOADED)
    await client.read_statuses()
    await until(
        lambda: {"push": wp.PUSH_DRIVER_ERROR, "code": DRIVER_NOT_LOADED} in pushes,
        "the driver error pushed",
    )


async def test_nvml_events_are_pushed_as_they_come(
    make_fake: MakeFake, serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    fake = make_fake("h200x2")
    client, _ = await serve(nvml_starter(fake, tmp_path))
    events: list[dict[str, Any]] = []
    client.set_push_handler(lambda m: events.append(m["event"]) if m["push"] == "event" else None)
    await until(lambda: "Watching NVML events" in caplog.text, "registered (its log line)")
    assert "Watching NVML events of GPU(s) 0, 1: critical XID errors, double-bit ECC" in caplog.text

    fake.emit_xid(1, 79)
    fake.emit_double_bit_ecc(0)
    fake.emit_xid(0, 13)
    await until(lambda: len(events) == 3, "three events")
    decoded = [wp.decode_event(e) for e in events]
    assert [(e.index, e.kind, e.xid) for e in decoded] == [
        (1, XID, 79),
        (0, DOUBLE_BIT_ECC, None),
        (0, XID, 13),
    ]


async def test_a_gpu_that_delivers_no_events_is_left_to_the_checks(
    make_fake: MakeFake, serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    fake = make_fake("h200x2")
    fake.supported_events[0] = 0
    fake.supported_events[1] = EVENT_XID_CRITICAL
    await serve(nvml_starter(fake, tmp_path))
    await until(lambda: "Watching NVML events" in caplog.text, "the watch log line")
    assert fake.event_sets[0].masks == {1: EVENT_XID_CRITICAL}
    assert "GPU 0 delivers neither XID nor double-bit ECC events" in caplog.text
    assert "of GPU(s) 1: critical XID errors" in caplog.text


async def test_health_checks_are_pushed_when_they_change(
    make_fake: MakeFake, serve: Serve, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    client, _ = await serve(nvml_starter(fake, tmp_path))
    checks: list[list[Any]] = []
    client.set_push_handler(lambda m: checks.append(m["checks"]) if m["push"] == "checks" else None)
    await until(lambda: len(checks) == 1, "the first sweep")
    first = [wp.decode_check(c) for c in checks[0]]
    assert [c.answering for c in first] == [True, True]
    assert [check_problem(c) for c in first] == [None, None]

    fake.remapped_rows[1] = (0, 0, 1, 0)  # a remap pending
    fake.lose(0)
    await until(lambda: len(checks) == 2, "a sweep that found something new")
    second = [wp.decode_check(c) for c in checks[1]]
    assert second[0].answering is False
    assert second[1].row_remap_pending is True

    fake.recover(0)
    fake.remapped_rows[1] = (0, 0, 0, 0)
    await until(lambda: len(checks) == 3, "the GPUs well again")
    assert [check_problem(wp.decode_check(c)) for c in checks[2]] == [None, None]


async def test_a_bad_request_is_answered_and_the_worker_goes_on(
    make_fake: MakeFake, serve: Serve, tmp_path: Path
) -> None:
    client, _ = await serve(nvml_starter(make_fake("h200"), tmp_path))
    with pytest.raises(WorkerGone, match="unknown request 'dance'"):
        await client.call("dance")
    assert len(await client.read_statuses()) == 1


# --- the real process ----------------------------------------------------------------------


async def test_the_worker_process_serves_a_simulated_node() -> None:
    client = await WorkerClient.spawn(simulate="hgx-h200-8", health_interval_s=0.05)
    try:
        simulated = SimulatedBackend.from_file("hgx-h200-8")
        assert client.node_info() == simulated.node_info()
        assert await client.read_statuses() == tuple(simulated.device_status(i) for i in range(8))
        assert client.pid is not None
        assert client.pid != os.getpid()
    finally:
        await client.stop()
    assert client.process is not None
    assert client.process.returncode == 0


async def test_a_worker_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(WorkerFailed, match=r"node file .*none\.json not found"):
        await WorkerClient.spawn(simulate=str(tmp_path / "none.json"))


async def test_a_worker_that_dies_fails_its_callers_and_says_how() -> None:
    client = await WorkerClient.spawn(simulate="h200")
    assert client.pid is not None
    os.kill(client.pid, signal.SIGKILL)
    await asyncio.wait_for(client.closed.wait(), 10)
    with pytest.raises(WorkerGone):
        await client.read_statuses()
    await client.stop()
    assert client.exit_reason is not None
    assert "GPU worker" in client.exit_reason


async def test_a_stopped_worker_misses_the_deadline_is_killed_and_fails_every_waiting_call() -> (
    None
):
    """SIGSTOP looks like a hung NVML call: no answer. Every waiting call fails within the
    deadline (not 30 s later), the process is killed, and the reason names the deadline."""
    client = await WorkerClient.spawn(simulate="h200", call_deadline_s=0.5)
    assert client.pid is not None
    assert client.process is not None
    os.kill(client.pid, signal.SIGSTOP)
    try:
        started = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(
            *(client.read_statuses() for _ in range(5)), client.ping(), return_exceptions=True
        )
        waited = asyncio.get_running_loop().time() - started
        assert all(isinstance(outcome, WorkerGone) for outcome in outcomes), outcomes
        assert waited < 5  # the deadline (0.5 s), not CALL_TIMEOUT_S (30 s)
        assert client.closed.is_set()
        assert client.exit_reason is not None
        assert "did not answer a status read within 0.5 s" in client.exit_reason
        assert await asyncio.to_thread(client.process.wait, 10) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(client.pid, signal.SIGCONT)
        await client.stop()


async def test_a_slow_answer_within_the_deadline_is_not_taken_for_a_hang(tmp_path: Path) -> None:
    node = json.loads(nodefile.resolve("h200").read_text())
    node["timing"] = {"status_call_s": 0.3, "pcie_sample_s": 0.3}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(node))
    client = await WorkerClient.spawn(simulate=str(path), call_deadline_s=2.0)
    try:
        for _ in range(3):
            assert len(await client.read_statuses()) == 1
        assert not client.closed.is_set()
    finally:
        await client.stop()


# --- memory: the worker imports what reading NVML needs ---------------------------------------

# pathlib, and what it brings (urllib.parse, ipaddress and the Windows path module): 0.5 MB.
NOT_IN_THE_WORKER = ("pathlib", "ntpath", "urllib", "urllib.parse", "ipaddress")


@pytest.mark.parametrize(
    ("backend", "absent"),
    [
        ("agent.gpu.nvml_backend", NOT_IN_THE_WORKER),
        # A simulated node (--simulate) has no NVML: pynvml and ctypes are 2.4 MB there.
        ("agent.gpu.simulated", ("pynvml", "ctypes", "ctypes.util")),
    ],
)
def test_the_worker_leaves_out_what_it_does_not_need(backend: str, absent: tuple[str]) -> None:
    """The worker lives as long as the agent and keeps every module it imported resident,
    so its NVML path (``python -m agent.gpu.worker`` through ``NvmlBackend.start``, which
    imports nothing more lazily) reads the kernel's files with ``os.path``, not pathlib, and
    a simulated node's worker leaves NVML out."""
    probe = (
        "import sys\n"
        f"import agent.gpu.worker, {backend}\n"
        f"print(sorted(m for m in {absent!r} if m in sys.modules))\n"
    )
    done = subprocess.run(  # -S: the development venv's site loads its editable install's
        [sys.executable, "-S", "-c", probe],  # finder, which imports pathlib; a node's doesn't
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{sysconfig.get_path('purelib')}"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "[]\n", (
        f"the GPU worker imports {done.stdout.strip()}: every module stays resident in a "
        "process that lives as long as the agent"
    )
