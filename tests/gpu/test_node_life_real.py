"""The node's life on a real NVIDIA GPU: the GPU worker, the event watch, SIGHUP under load.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_node_life_real.py -s`` (``-s`` shows
what the real driver delivers and the figures). Every test skips where no NVIDIA driver is
loaded. What it checks:

- the daemon itself never maps libnvidia-ml nor holds a ``/dev/nvidia*`` file: its GPU
  worker does; killing the worker gives a short 503 and a new worker;
- the worker's NVML runs without libcuda (``agent.gpu.hidden_libcuda``), and the CUDA
  version the agent says is still the one nvidia-smi says, its CUDA facts still known;
- the worker's NVML event watch registers on the real GPUs (the log says for which events),
  and what the driver delivers in ``NVD_EVENT_WAIT_S`` seconds (default 5) is printed: a
  healthy machine delivers nothing, which is printed too;
- the per-sweep health checks answer on the real GPUs, and ``/gpu/health`` says healthy;
- 64 clients on ``/gpu/status/json`` while SIGHUPs re-read the driver: no failed request
  (``tests.benchmarks.bench_reload --real``), the longest request printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.gpu.backend import GpuBackendError
from agent.gpu.nvml_backend import NvmlBackend
from agent.gpu.nvml_health import EVENT_DOUBLE_BIT_ECC, EVENT_XID_CRITICAL
from agent.node.drivers import InstalledDriver, LoadedModule
from tests.benchmarks.proc_usage import resident_memory
from tests.support.node_life import StatusLoad, gpu_worker_pids
from tests.support.services import free_port, stop_process, wait_until

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
WORKER_PID = re.compile(r"GPU worker, pid (\d+)")


def _need_driver() -> str:
    version = LoadedModule().version()
    if version is None or not Path("/dev/nvidiactl").exists():
        pytest.skip("no NVIDIA kernel module loaded here")
    return version


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def worker_pid(self) -> int:
        pids = WORKER_PID.findall(self.log())
        restarted = re.findall(r"GPU worker restarted .*", self.log())
        assert pids, self.log()
        return int(pids[-1]) if not restarted else _only_worker(self.proc.pid)


def _only_worker(pid: int) -> int:
    (worker,) = gpu_worker_pids(pid)
    return worker


def _nvidia_files(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return sorted(set(found))


def _maps_nvml(pid: int) -> bool:
    return "libnvidia-ml" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _need_driver()
    base = tmp_path_factory.mktemp("node-life")
    port = free_port()
    log_path = base / "agent.log"
    command = [
        sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
        "-s", str(base / "sock"), "-d", str(base / "volumes"),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    daemon = Daemon(proc, port, log_path)
    try:
        wait_until(lambda: "Ready" in daemon.log(), what="agent", timeout_s=120, proc=proc)
        yield daemon
    finally:
        stop_process(proc)
    print(f"\n--- agent log ---\n{daemon.log()}")
    assert "Traceback" not in daemon.log()


def test_the_daemon_holds_no_nvidia_file_its_worker_does(daemon: Daemon) -> None:
    worker = daemon.worker_pid()
    assert not _maps_nvml(daemon.proc.pid), "the daemon mapped libnvidia-ml itself"
    assert _nvidia_files(daemon.proc.pid) == []
    held = _nvidia_files(worker)
    print(f"\nthe GPU worker (pid {worker}) holds {held}; the daemon holds none")
    assert _maps_nvml(worker)
    assert "/dev/nvidiactl" in held


def test_the_worker_maps_no_libcuda_and_the_cuda_version_is_right(daemon: Daemon) -> None:
    worker = daemon.worker_pid()
    maps = Path(f"/proc/{worker}/maps").read_text()
    assert "libnvidia-ml" in maps
    assert "libcuda" not in maps, "NVML loaded libcuda into the GPU worker"
    smi = subprocess.run(
        ["nvidia-smi", "-q", "-x"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    match = re.search(r"<cuda_version>([0-9.]+)</cuda_version>", smi)
    assert match is not None, "nvidia-smi shows no CUDA version"
    info = json.loads(daemon.get("/gpu/info/json")[1])
    print(f"\nthe worker maps no libcuda; CUDA {info['Version']['CUDA']} (nvidia-smi: "
          f"{match.group(1)}); resident {resident_memory(worker).rss_mb:.1f} MB")  # fmt: skip
    assert info["Version"]["CUDA"] == match.group(1)
    for device in info["Devices"]:  # the CUDA child still read the facts NVML has not
        assert device["Memory"]["L2Cache"], device
        assert device["Memory"]["Shared"], device


def test_the_driver_versions_the_agent_watches(daemon: Daemon) -> None:
    info = json.loads(daemon.get("/gpu/info/json")[1])
    loaded = LoadedModule().version()
    installed = InstalledDriver(Path("/etc/ld.so.cache")).version()
    print(
        f"\nNVML driver {info['Version']['Driver']}; loaded module {loaded}; the linker "
        f"cache's libnvidia-ml.so.1 is driver {installed}"
    )
    assert loaded == info["Version"]["Driver"]


def test_the_event_watch_registers_on_the_real_gpu(daemon: Daemon) -> None:
    registered = [line for line in daemon.log().splitlines() if "Watching NVML events" in line] or [
        line for line in daemon.log().splitlines() if "delivers neither" in line
    ]
    print("\n" + "\n".join(registered))
    assert registered, "the worker logged nothing about the event watch"
    # The same watch in this process, to say what the driver supports and delivers.
    with pytest.MonkeyPatch.context() as env:
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_UNIFIED_MEMORY", "CUDA_CACHE_DISABLE"):
            env.setenv(name, os.environ.get(name, ""))
        try:
            backend = NvmlBackend.start(cuda=lambda _bus: None)
        except GpuBackendError as err:
            pytest.skip(f"NVML does not start in the test process: {err}")
    try:
        watch = backend.event_watch()
        masks = watch.registered if watch is not None else {}
        for index in range(len(backend.node_info().devices)):
            mask = masks.get(index, 0)
            kinds = [
                name
                for bit, name in ((EVENT_XID_CRITICAL, "XID"), (EVENT_DOUBLE_BIT_ECC, "DBE"))
                if mask & bit
            ]
            print(f"GPU {index}: registered for {', '.join(kinds) or 'nothing'} (mask {mask:#x})")
        wait_s = float(os.environ.get("NVD_EVENT_WAIT_S", "5"))
        events = []
        deadline = time.monotonic() + wait_s
        while watch is not None and time.monotonic() < deadline:
            events += watch.wait(0.5)
        print(f"events delivered in {wait_s:g} s: {events or 'none'}")
        checks = [backend.health_check(i) for i in range(len(backend.node_info().devices))]
        print(f"per-sweep checks: {checks}")
        assert all(check.answering for check in checks)
        if watch is not None:
            watch.close()
    finally:
        backend.close()
    health = json.loads(daemon.get("/gpu/health/json")[1])["Devices"]
    print(f"/gpu/health/json: {health}")
    assert all(device["Healthy"] for device in health), health


def test_a_killed_worker_is_replaced_with_a_short_503(daemon: Daemon) -> None:
    info_before = daemon.get("/gpu/info/json")[1]
    worker = daemon.worker_pid()
    load = StatusLoad(daemon.port, clients=8).start()
    try:
        wait_until(lambda: load.count() > 50, what="load")
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: "GPU worker restarted" in daemon.log(), what="a new worker", timeout_s=30
        )
        back = time.monotonic()
        before = load.count()
        wait_until(lambda: load.count() > before + 50, what="load after")
    finally:
        outcomes = load.stop()
    odd = [
        o
        for o in outcomes
        if o.status != 200 and (o.status, o.body) != (503, b"GPU worker restarting\n")
    ]
    window = [o for o in outcomes if o.status == 503]
    print(f"\nworker killed: back after {back - killed:.2f} s; {len(window)} answers were 503")
    assert odd == []
    assert daemon.get("/gpu/info/json")[1] == info_before
    assert daemon.get("/gpu/status/json")[0] == 200


def test_sighup_under_64_clients_fails_no_request() -> None:
    _need_driver()
    done = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_reload", "--real", "--clients", "64",
         "--sighups", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    print("\n" + done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", 0 failed, 0 broken connections;" in done.stdout
