"""/metrics on a real NVIDIA GPU: a real CUDA process, and the values against nvidia-smi.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_metrics_real.py``. A child Python with
PyTorch allocates 1 GiB on GPU 0 and waits; the agent (real NVML, its own port and
directories) must list it in ``/metrics`` with its PID, its memory as nvidia-smi reports it,
and the host attribution. Each GPU value is compared with ``nvidia-smi --query-gpu`` read
just before and just after the scrape: it must lie between the two readings, widened by
the drift stated in ``DRIFT`` (nvidia-smi rounds MiB where NVML's bytes are floored; power,
temperature, clocks and utilisation are sampled by the driver at slightly different
moments). The interpreter with torch is ``$NVD_TORCH_PYTHON``, else the first of this
Python, ``/usr/bin/python3`` and ``python3`` that imports torch; without one the tests skip.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.support.services import free_port, port_open, stop_process, wait_until

pytestmark = pytest.mark.gpu

MIB = 2**20
ALLOC_BYTES = 2**30
# metric -> (nvidia-smi --query-gpu field, allowed drift beyond the two readings, unit note)
DRIFT: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_FB_USED": ("memory.used", 2),  # MiB: smi rounds, we floor
    "DCGM_FI_DEV_FB_FREE": ("memory.free", 2),
    "DCGM_FI_DEV_FB_RESERVED": ("memory.reserved", 2),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature.gpu", 2),  # C
    "DCGM_FI_DEV_MEMORY_TEMP": ("temperature.memory", 2),
    "DCGM_FI_DEV_POWER_USAGE": ("power.draw", 15),  # W: a 1 s average on Hopper
    "DCGM_FI_DEV_SM_CLOCK": ("clocks.sm", 150),  # MHz: boosts between readings
    "DCGM_FI_DEV_MEM_CLOCK": ("clocks.mem", 1),
    "DCGM_FI_DEV_GPU_UTIL": ("utilization.gpu", 10),  # %
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("utilization.memory", 10),
    "DCGM_FI_DEV_ENC_UTIL": ("utilization.encoder", 5),
    "DCGM_FI_DEV_DEC_UTIL": ("utilization.decoder", 5),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remapped_rows.correctable", 0),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remapped_rows.uncorrectable", 0),
}
CHILD = f"""
import sys, torch
x = torch.empty({ALLOC_BYTES}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def _smi(*args: str) -> str:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"nvidia-smi {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


def _number(cell: str) -> float | None:
    cell = cell.strip()
    if cell in ("Yes", "No"):
        return float(cell == "Yes")
    try:
        return float(cell)
    except ValueError:
        return None  # [N/A], [Not Supported]


@pytest.fixture(scope="module")
def smi_fields() -> list[str]:
    """The DRIFT fields this driver's nvidia-smi knows (older ones lack a few)."""
    fields = []
    for field, _drift in DRIFT.values():
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode == 0:
            fields.append(field)
    if not fields:
        pytest.skip("nvidia-smi answers none of the compared fields")
    return fields


def smi_gpus(fields: list[str]) -> list[dict[str, float | None]]:
    out = _smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return [dict(zip(fields, map(_number, row), strict=True)) for row in rows]


def smi_apps() -> dict[int, int]:
    """pid -> used MiB of every compute process."""
    out = _smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    apps = {}
    for line in out.splitlines():
        if line.strip():
            pid, used = (cell.strip() for cell in line.split(","))
            apps[int(pid)] = int(used)
    return apps


def _torch_python() -> str | None:
    candidates = [os.environ.get("NVD_TORCH_PYTHON"), sys.executable, "/usr/bin/python3",
                  shutil.which("python3")]  # fmt: skip
    for python in dict.fromkeys(c for c in candidates if c):
        done = subprocess.run([python, "-c", "import torch; assert torch.cuda.is_available()"],
                              capture_output=True, timeout=120, check=False)  # fmt: skip
        if done.returncode == 0:
            return python
    return None


@pytest.fixture(scope="module")
def cuda_process() -> Iterator[subprocess.Popen[str]]:
    """A real CUDA process holding 1 GiB on GPU 0 (NVML order), until the module ends."""
    python = _torch_python()
    if python is None:
        pytest.skip("no Python with a CUDA-enabled torch (set NVD_TORCH_PYTHON)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    proc = subprocess.Popen([python, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=180):
                raise AssertionError("the CUDA child did not allocate within 180 s")
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Agent:
    port: int

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as resp:
            body: bytes = resp.read()
            return body

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        text = self.get("/metrics").decode()
        parse = cast(Callable[[str], Iterable[Metric]], text_string_to_metric_families)
        lines = "\n" + text
        found = []
        for family in parse(text):
            for s in family.samples:
                # The parser names a counter's samples <name>_total; the GPU counters are
                # written without the suffix, as dcgm-exporter writes them: keep their names.
                name = s.name
                if (
                    family.type == "counter"
                    and name.endswith("_total")
                    and f"\n{name}" not in lines
                ):
                    name = name.removesuffix("_total")
                found.append((name, dict(s.labels), s.value))
        return found


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    root = tmp_path_factory.mktemp("gpu-metrics")
    port = free_port()
    log_path = root / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
             "-s", str(root / "plugins"), "-d", str(root / "volumes")],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: port_open(port), what=f"agent (log {log_path})", timeout_s=120,
                   proc=proc)  # fmt: skip
        yield Agent(port)
    finally:
        stop_process(proc)
        print(Path(log_path).read_text(errors="replace"))


def _gpu0(samples: list[tuple[str, dict[str, str], float]], name: str) -> float | None:
    found = [v for n, labels, v in samples if n == name and labels.get("gpu") == "0"]
    return found[0] if found else None


def test_the_cuda_process_is_listed_with_pid_memory_and_host(
    agent: Agent, cuda_process: subprocess.Popen[str]
) -> None:
    pid = cuda_process.pid

    def listed() -> bool:
        devices = json.loads(agent.get("/gpu/processes/json"))["Devices"]
        return any(p["PID"] == pid for p in devices[0]["Processes"])

    wait_until(listed, what=f"PID {pid} in /gpu/processes/json", timeout_s=30)
    smi_used_mib = smi_apps()[pid]
    assert smi_used_mib >= ALLOC_BYTES // MIB  # the allocation plus the CUDA context
    samples = agent.samples()
    (memory,) = [(labels, v) for n, labels, v in samples
                 if n == "nvidia_docker_gpu_process_memory_used_bytes"
                 and labels.get("pid") == str(pid)]  # fmt: skip
    labels, used_bytes = memory
    assert labels["gpu"] == "0"
    assert labels["owner"] == "host", labels  # a plain process of this machine
    assert "container" not in labels
    assert labels["process_name"].startswith("python")
    assert abs(used_bytes / MIB - smi_used_mib) <= 1  # same NVML number; smi rounds
    (entry,) = [p for p in json.loads(agent.get("/gpu/processes/json?dev=0"))["Devices"][0][
        "Processes"] if p["PID"] == pid]  # fmt: skip
    assert entry["Owner"] == "host"
    assert entry["MemoryUsed"] == int(used_bytes // MIB)


def test_gpu_values_match_nvidia_smi_within_the_drift(
    agent: Agent, cuda_process: subprocess.Popen[str], smi_fields: list[str]
) -> None:
    del cuda_process  # holds memory on GPU 0 while we compare
    before = smi_gpus(smi_fields)
    samples = agent.samples()
    after = smi_gpus(smi_fields)
    gpu_count = len({labels["gpu"] for n, labels, _ in samples if n == "DCGM_FI_DEV_GPU_TEMP"})
    assert gpu_count == len(before)
    compared = []
    for metric, (field, drift) in DRIFT.items():
        if field not in smi_fields:
            continue
        for gpu in range(gpu_count):
            ours = [v for n, labels, v in samples if n == metric and labels["gpu"] == str(gpu)]
            a, b = before[gpu][field], after[gpu][field]
            if a is None or b is None:
                assert ours == [], f"{metric} GPU {gpu}: nvidia-smi has no value, we {ours}"
                continue
            assert ours, f"{metric} GPU {gpu}: absent, nvidia-smi says {a}"
            low, high = min(a, b) - drift, max(a, b) + drift
            assert low <= ours[0] <= high, f"{metric} GPU {gpu}: {ours[0]} not in [{low}, {high}]"
            compared.append(metric)
    assert "DCGM_FI_DEV_FB_USED" in compared
    assert "DCGM_FI_DEV_POWER_USAGE" in compared


def test_energy_counter_grows(agent: Agent) -> None:
    first = _gpu0(agent.samples(), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    if first is None:
        pytest.skip("this GPU has no energy counter")
    time.sleep(1.5)  # the quantity measured is energy over time: it needs time to pass
    second = _gpu0(agent.samples(), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    assert second is not None
    assert second > first  # mJ: an idle H200 draws ~75 W, ~110 J in 1.5 s


def test_the_process_leaves_when_it_exits(
    agent: Agent, cuda_process: subprocess.Popen[str]
) -> None:
    pid = cuda_process.pid
    assert cuda_process.stdin is not None
    cuda_process.stdin.close()
    cuda_process.wait(timeout=60)

    def gone() -> bool:
        info = "nvidia_docker_gpu_process_info"
        return not [
            1 for n, labels, _ in agent.samples() if n == info and labels["pid"] == str(pid)
        ]

    wait_until(gone, what=f"PID {pid} gone from /metrics", timeout_s=30)
