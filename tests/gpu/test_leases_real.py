"""Leases on a real NVIDIA GPU: the grant names the GPU NVML and nvidia-smi know, its device
node and the CPUs of its NUMA node; the table survives the agent's kill -9; a CUDA program
started outside any container makes the GPU foreign while it runs.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_leases_real.py``. The agent uses real
NVML, its own port and directories (its lease state in a temporary directory); no container
engine is needed (none answers: the table keeps what it has).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.services import free_port, port_open, stop_process, wait_until

pytestmark = pytest.mark.gpu


def _smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def _call(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return status, json.loads(raw) if raw.startswith(b"{") else raw.decode()


class Agent:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with (self.root / "agent.log").open("ab") as log:
            self.proc = self._spawn(log)
        wait_until(lambda: port_open(self.port), what="the agent", timeout_s=120, proc=self.proc)

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{self.port}",
             "-s", str(self.root / "plugins"), "-d", str(self.root / "volumes"),
             "--state-dir", str(self.root / "state"), "--cdi-spec-dir", "",
             "--docker-socket", str(self.root / "no-docker.sock"),
             "--podman-socket", str(self.root / "no-podman.sock"),
             "--usage-interval", "0.5"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    agent = Agent(tmp_path)
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        print((tmp_path / "agent.log").read_text(errors="replace"))


def _numa_node(bus_id: str) -> int | None:
    address = bus_id.lower()
    if address.count(":") == 2 and len(address.split(":")[0]) == 8:
        address = address[4:]  # nvidia-smi's 00000000:19:00.0 is sysfs's 0000:19:00.0
    path = Path("/sys/bus/pci/devices") / address / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def test_a_grant_names_the_real_gpu_its_device_and_its_cpus(agent: Agent) -> None:
    uuids = _smi("--query-gpu=uuid,pci.bus_id", "--format=csv,noheader").splitlines()
    first_uuid, first_bus = (cell.strip() for cell in uuids[0].split(","))
    status, grant = _call(agent.port, "POST", "/leases", {"count": 1, "owner": {"job": "gpu"}})
    assert status == 201, grant
    (device,) = grant["Devices"]
    assert device["UUID"] == first_uuid
    assert grant["Dev"] == first_uuid
    assert Path(device["Path"]).is_char_device()
    # the GPU's NUMA node (as sysfs says, where the PCI device shows its numa_node), and
    # the CPUs of that node as the host lists them
    numa = _numa_node(first_bus)
    if numa is not None:
        assert grant["NumaNodes"] == [numa]
    if grant["NumaNodes"] is None:
        assert (grant["CpusetCpus"], grant["CpusetMems"]) == (None, None)
    else:
        (node,) = grant["NumaNodes"]
        cpus = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
        assert (grant["CpusetCpus"], grant["CpusetMems"]) == (cpus, str(node))
    assert grant["Labels"]["nvidia-docker.lease.devices"] == first_uuid

    # the one GPU is taken: an ask for it says by whom; more than the node has: impossible
    gpus = len(uuids)
    status, refused = _call(agent.port, "POST", "/leases", {"count": gpus})
    assert status == 409
    assert refused["Refusal"] == "not_enough", refused
    assert grant["Lease"] in refused["Error"]
    status, impossible = _call(agent.port, "POST", "/leases", {"count": gpus + 1})
    assert (status, impossible["Refusal"]) == (409, "impossible")

    # seen in /metrics with its owner, then released
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=30) as m:
        text = m.read().decode()
    leased = [line for line in text.splitlines() if line.startswith("nvidia_docker_gpu_leased{")]
    assert len(leased) == 1, leased
    assert f'UUID="{first_uuid}"' in leased[0]
    assert 'owner="job=gpu"' in leased[0]
    status, released = _call(agent.port, "DELETE", f"/leases/{grant['Lease']}")
    assert (status, released["Released"]) == (200, grant["Lease"])
    status, table = _call(agent.port, "GET", "/leases/json")
    assert next(u["State"] for u in table["Units"]) == "free"


def test_the_table_survives_kill_9(agent: Agent) -> None:
    status, grant = _call(agent.port, "POST", "/leases", {"count": 1})
    assert status == 201, grant
    state = agent.root / "state" / "leases.json"
    wait_until(lambda: state.exists() and grant["Lease"] in state.read_text(), what="the save")
    assert state.stat().st_mode & 0o777 == 0o600
    agent.kill()
    agent.start()
    status, table = _call(agent.port, "GET", "/leases/json")
    assert [(lease["Lease"], lease["State"]) for lease in table["Leases"]] == [
        (grant["Lease"], "pending")
    ]
    status, again = _call(agent.port, "POST", "/leases", {"devices": grant["Dev"]})
    assert (status, again["Refusal"]) == (409, "taken"), again


# A CUDA context on GPU 0 through the driver's own library (no framework needed): NVML then
# lists this process among the GPU's compute processes.
CUDA_PROGRAM = """
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
device, context = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
print("ready", flush=True)
time.sleep(600)
"""


def _foreign(port: int) -> list[str]:
    status, table = _call(port, "GET", "/leases/json")
    assert status == 200, table
    return [hold["Holder"] for hold in table["Foreign"]]


def test_a_cuda_program_outside_containers_makes_the_gpu_foreign(agent: Agent) -> None:
    program = subprocess.Popen(
        [sys.executable, "-c", CUDA_PROGRAM], stdout=subprocess.PIPE, text=True
    )
    try:
        assert program.stdout is not None
        assert program.stdout.readline().strip() == "ready"
        with urllib.request.urlopen(
            f"http://127.0.0.1:{agent.port}/gpu/processes/json", timeout=30
        ) as answer:
            listed = [
                p["PID"] for d in json.loads(answer.read())["Devices"] for p in d["Processes"]
            ]
        if program.pid not in listed:
            pytest.skip(
                f"NVML lists the GPU's processes as {listed}, not as pid {program.pid}: "
                "another PID namespace (a sandbox), where the agent cannot place them"
            )
        holder = f"pid {program.pid}"
        wait_until(lambda: holder in _foreign(agent.port), what=f"{holder} foreign", timeout_s=30)
        status, refused = _call(agent.port, "POST", "/leases", {"devices": "0"})
        assert (status, refused["Refusal"]) == (409, "taken"), refused
        assert f"by {holder} (a GPU process)" in refused["Error"], refused
    finally:
        program.kill()
        program.wait(timeout=30)
        if program.stdout is not None:
            program.stdout.close()
    wait_until(lambda: not _foreign(agent.port), what="the GPU free again", timeout_s=30)
    status, grant = _call(agent.port, "POST", "/leases", {"devices": "0"})
    assert status == 201, grant
