"""GET /metrics and /gpu/processes/json on the simulated 8-GPU node."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from agent.api import render_json
from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import Attributor, ProcessOwner
from agent.gpu.model import UNKNOWN_TELEMETRY
from agent.health.rule import HEALTHY, DeviceHealth
from agent.leases.asks import Ask
from agent.leases.table import LeaseTable
from agent.metrics.gpu_families import COUNTER, GPU_METRICS
from agent.metrics.service import MetricsService
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.node_files import with_processes
from tests.unit.agent.conftest import CONTROL, CountingBackend
from tests.unit.leases.nodes import T0, granted, healthy
from tests.unit.metrics.conftest import MakeAgent, samples, values

DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id",
               "DCGM_FI_DRIVER_VERSION"}  # fmt: skip
MIB = 2**20


async def test_dcgm_names_labels_and_values(make_agent: MakeAgent) -> None:
    agent = await make_agent(CountingBackend("hgx-h200-8"))
    resp = await agent.client.get("/metrics")
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = await resp.text()
    (util,) = [s for s in samples(text) if s.name == "DCGM_FI_DEV_GPU_UTIL" and
               s.labels["gpu"] == "2"]  # fmt: skip
    assert util.value == 97
    assert set(util.labels) == DCGM_LABELS  # its processes' owner is unknown: no container
    assert util.labels == {
        "gpu": "2",
        "UUID": "GPU-2f70ba43-2df1-51a2-a6ab-95502c99433a",
        "device": "nvidia2",
        "modelName": "NVIDIA H200",
        "Hostname": "gpu-node-7",
        "pci_bus_id": "00000000:3A:00.0",
        "DCGM_FI_DRIVER_VERSION": "580.159.04",
    }
    assert util.type == "gauge"
    assert values(text, "DCGM_FI_DEV_GPU_UTIL", gpu="0") == [0]
    assert values(text, "DCGM_FI_DEV_MEM_COPY_UTIL", gpu="3") == [58]
    assert values(text, "DCGM_FI_DEV_FB_USED", gpu="2") == [121034 - 615]
    assert values(text, "DCGM_FI_DEV_FB_FREE", gpu="2") == [143771 - 121034]
    assert values(text, "DCGM_FI_DEV_POWER_USAGE", gpu="2") == [512.25]  # W, from mW
    assert values(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu="2") == [512250 * 86400]
    assert values(text, "DCGM_FI_DEV_SM_CLOCK", gpu="2") == [1980]
    assert values(text, "DCGM_FI_DEV_MEMORY_TEMP", gpu="2") == [67]
    assert values(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE", gpu="5") == [0]
    for name in ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                 "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"):  # fmt: skip
        assert f"# TYPE {name} counter\n" in text  # dcgm-exporter's: no _total suffix
    assert len(values(text, "DCGM_FI_DEV_GPU_TEMP")) == 8


async def test_values_the_gpu_does_not_report_are_absent(make_agent: MakeAgent) -> None:
    """h200x2 was dumped before the telemetry existed; L1/L2 ECC are not supported."""
    text = await (await make_agent(CountingBackend("h200x2"))).scrape()
    names = {s.name for s in samples(text)}
    for absent in ("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_FB_USED",
                   "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_ECC_DBE_VOL_L1",
                   "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_XID_ERRORS"):  # fmt: skip
        assert absent not in names
        assert absent not in text  # not even its HELP line
    assert values(text, "DCGM_FI_DEV_POWER_USAGE") == [77, 76]  # whole watts: the W field
    assert values(text, "DCGM_FI_DEV_ECC_DBE_VOL_DEV") == [0, 0]
    assert "NaN" not in text
    assert " -1" not in text


async def test_a_lost_gpu_has_no_gpu_samples(make_agent: MakeAgent) -> None:
    backend = CountingBackend("hgx-h200-8")
    backend.failing.add(3)
    text = await (await make_agent(backend)).scrape()
    dcgm = [s for s in samples(text) if s.name.startswith("DCGM_")]
    assert not [s for s in dcgm if s.labels["gpu"] == "3"]
    assert values(text, "DCGM_FI_DEV_GPU_UTIL", gpu="2") == [97]


async def test_a_lost_gpu_keeps_its_health_and_its_last_xid(make_agent: MakeAgent) -> None:
    backend = CountingBackend("hgx-h200-8")
    backend.failing.add(3)
    lost = DeviceHealth(False, "GPU is lost (not answering: fallen off the bus?)", None, 1.0)
    health = Health((HEALTHY,) * 3 + (lost,) + (HEALTHY,) * 4, (0, 0, 0, 79, 0, 0, 0, 0))
    text = await (await make_agent(backend, health=health)).scrape()
    gpu3 = {s.name: s.value for s in samples(text) if s.labels.get("gpu") == "3"}
    assert gpu3 == {"DCGM_FI_DEV_XID_ERRORS": 79, "nvidia_docker_gpu_healthy": 0}


async def test_status_json_does_not_show_the_telemetry(make_agent: MakeAgent) -> None:
    backend = CountingBackend("hgx-h200-8")
    agent = await make_agent(backend)
    body = await (await agent.client.get("/gpu/status/json")).read()
    sweep = await agent.service.status.sweep()
    without = [dataclasses.replace(s, telemetry=UNKNOWN_TELEMETRY) for s in sweep.statuses]
    assert body == render_json.status(without, sweep.throughputs)
    assert sweep.statuses[2].telemetry.framebuffer.used_mib == 120419  # it is there, unshown


class CountingAttributor(Attributor):
    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0

    async def owners(self, pids: Iterable[int]) -> dict[int, ProcessOwner]:
        self.calls += 1
        return await super().owners(pids)


async def test_concurrent_scrapes_share_one_sweep_and_one_attribution(
    make_agent: MakeAgent,
) -> None:
    backend = CountingBackend("hgx-h200-8", status_delay_s=0.2)
    attributor = CountingAttributor()
    agent = await make_agent(backend, attributor=attributor)
    requests = [agent.client.get("/metrics") for _ in range(20)]
    requests += [agent.client.get("/gpu/processes/json") for _ in range(5)]
    requests += [agent.client.get("/gpu/status/json") for _ in range(5)]
    responses = await asyncio.gather(*requests)
    assert all(r.status == 200 for r in responses)
    # 30 requests of 8 GPUs: one sweep (a few at worst), and one attribution per sweep
    assert backend.status_calls <= 8 * 3
    assert backend.status_calls % 8 == 0
    assert attributor.calls == backend.status_calls // 8
    gpu_parts = {(await r.text()).split("# HELP nvidia_docker_http")[0] for r in responses[:20]}
    assert len(gpu_parts) == 1  # the GPU part rendered once, served to all


async def test_requests_are_counted_by_route_template(make_agent: MakeAgent) -> None:
    agent = await make_agent(CountingBackend("h200"))
    for path in ("/gpu/status/json", "/gpu/status/json", "/v1.0/gpu/info", "/gpu/info?dev=9"):
        await agent.client.get(path)
    for n in range(5):  # a scanner: five paths, one series
        assert (await agent.client.get(f"/wp-admin/{n}.php")).status == 404
    text = await agent.scrape()
    requests = "nvidia_docker_http_requests_total"
    assert values(text, requests, route="/gpu/status/json", code="200") == [2]
    assert values(text, requests, route="/v1.0/gpu/info", code="200") == [1]
    assert values(text, requests, route="/gpu/info", code="400") == [1]
    assert values(text, requests, route="unmatched", code="404") == [5]
    assert not [s for s in samples(text) if "wp-admin" in str(s.labels)]


async def test_sweeps_are_timed(make_agent: MakeAgent) -> None:
    agent = await make_agent(CountingBackend("hgx-h200-8", status_delay_s=0.01))
    for _ in range(3):
        await agent.client.get("/gpu/status/json")
    text = await agent.scrape()  # its own sweep is the fourth
    assert values(text, "nvidia_docker_status_sweep_duration_seconds_count") == [4]
    (total,) = values(text, "nvidia_docker_status_sweep_duration_seconds_sum")
    assert 4 * 0.01 <= total < 4 * 1.0
    assert values(text, "nvidia_docker_status_sweep_duration_seconds_bucket", le="0.005") == [0]


async def test_build_info_pcie_age_and_process_metrics(make_agent: MakeAgent) -> None:
    text = await (await make_agent(CountingBackend("h200"))).scrape()
    (build,) = [s for s in samples(text) if s.name == "nvidia_docker_build_info"]
    assert build.labels == {"version": __version__, "driver_version": "580.159.04",
                            "cuda_version": "13.0"}  # fmt: skip
    assert build.value == 1
    (age,) = values(text, "nvidia_docker_pcie_sample_age_seconds")
    assert 0 <= age < 60
    (rss,) = values(text, "process_resident_memory_bytes")
    assert rss > 10 * MIB


@dataclass(frozen=True)
class Health:
    """What the health monitor shows /metrics (HealthView)."""

    health: tuple[DeviceHealth, ...]
    last_xids: tuple[int, ...]


async def test_health_source_gives_xid_and_health(make_agent: MakeAgent) -> None:
    sick = DeviceHealth(False, "XID 79 (GPU has fallen off the bus)", 79, 1.0)
    health = Health((HEALTHY, sick) + (HEALTHY,) * 6, (0, 79, 13) + (0,) * 5)
    text = await (await make_agent(CountingBackend("hgx-h200-8"), health=health)).scrape()
    assert values(text, "DCGM_FI_DEV_XID_ERRORS", gpu="0") == [0]
    assert values(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == [79]
    assert values(text, "DCGM_FI_DEV_XID_ERRORS", gpu="2") == [13]  # an application's: healthy
    assert values(text, "nvidia_docker_gpu_healthy", gpu="1") == [0]
    assert values(text, "nvidia_docker_gpu_healthy", gpu="0") == [1]
    assert values(text, "nvidia_docker_gpu_healthy", gpu="2") == [1]


async def test_without_a_health_source_the_health_families_are_absent(
    make_agent: MakeAgent,
) -> None:
    text = await (await make_agent(CountingBackend("h200"))).scrape()
    assert values(text, "DCGM_FI_DEV_XID_ERRORS") == []
    assert values(text, "nvidia_docker_gpu_healthy") == []


async def test_processes_json_and_per_process_metrics(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    host_pid = os.getpid()
    node = with_processes(
        "hgx-h200-8",
        {0: [(host_pid, "python3", 2048)], 1: [(2**22 + 17, "ghost", 10)]},  # beyond pid_max
        tmp_path / "node.json",
    )
    agent = await make_agent(CountingBackend(str(node)))
    doc = await (await agent.client.get("/gpu/processes/json")).json()
    assert [d["Index"] for d in doc["Devices"]] == list(range(8))
    assert doc["Devices"][0]["UUID"] == "GPU-825bd660-d5ca-57d3-b40a-8a8f99e88dc9"
    (host,) = doc["Devices"][0]["Processes"]
    assert host == {"PID": host_pid, "Name": "python3", "MemoryUsed": 2048,
                    "Owner": read_owner_kind(host_pid), "ContainerID": None,
                    "ContainerName": None, "Image": None, "MesosContainer": None}  # fmt: skip
    assert doc["Devices"][1]["Processes"][0]["Owner"] == "unknown"
    assert doc["Devices"][4]["Processes"] == []

    one = await agent.client.get("/gpu/processes/json?dev=0")
    assert [d["Index"] for d in (await one.json())["Devices"]] == [0]
    bad = await agent.client.get("/gpu/processes/json?dev=12")
    assert bad.status == 400
    assert bad.headers["X-Invalid-Parameter"] == "dev"

    text = await agent.scrape()
    (memory,) = [s for s in samples(text) if s.name == "nvidia_docker_gpu_process_memory_used_bytes"
                 and s.labels["gpu"] == "0"]  # fmt: skip
    assert memory.value == 2048 * MIB
    assert memory.labels["pid"] == str(host_pid)
    assert memory.labels["process_name"] == "python3"
    assert memory.labels["owner"] == read_owner_kind(host_pid)
    assert values(text, "nvidia_docker_gpu_process_info", gpu="1", owner="unknown") == [1]


def read_owner_kind(pid: int) -> str:
    """What this machine's cgroups say of the test process: the host (or a container, when
    the suite itself runs inside one)."""
    from agent.attribution.cgroup import read_place  # noqa: PLC0415

    kind = read_place(pid).kind
    assert kind is not OwnerKind.UNKNOWN
    return kind.value


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
async def test_promtool_finds_only_the_names_kept_on_purpose(make_agent: MakeAgent) -> None:
    """promtool's linter flags three things of dcgm-exporter's own, which we keep so that its
    dashboards work: the camelCase label modelName, "counter" in
    DCGM_FI_DEV_PCIE_REPLAY_COUNTER, and counters without the _total suffix. With those
    renamed it finds nothing at all."""
    assert PROMTOOL is not None
    text = await (await make_agent(CountingBackend("hgx-h200-8"))).scrape()
    problems = _promtool(PROMTOOL, text)
    kept = {
        "label names should be written in 'snake_case' not 'camelCase'",
        "metric name should not include type 'counter'",
        'counter metrics should have "_total" suffix',
    }
    assert problems, "promtool sees modelName: it must say so"
    assert {p.partition(" ")[2] for p in problems} <= kept
    assert {p for p in problems if "'counter'" in p} == {
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'"
    }
    counters = {m.name for m in GPU_METRICS if m.kind == COUNTER}
    assert {p.partition(" ")[0] for p in problems if "_total" in p} <= counters
    renamed = text.replace("modelName=", "model_name=").replace(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAYS"
    )
    counters = counters - {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER"} | {"DCGM_FI_DEV_PCIE_REPLAYS"}
    for name in sorted(counters):
        renamed = re.sub(rf"^((?:# (?:HELP|TYPE) )?{name})\b", r"\1_total", renamed, flags=re.M)
    assert _promtool(PROMTOOL, renamed) == []


def _promtool(promtool: str, text: str) -> list[str]:
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert (proc.returncode == 0) == (not lines), proc.stdout + proc.stderr
    return sorted(set(lines))


async def test_released_gpus_keep_the_leases_and_the_agents_counters() -> None:
    """While the GPUs are released (a driver upgrade), the GPU families go, and what does not
    come from a sweep stays: the lease that holds a GPU, the agent's own counters."""
    backend = CountingBackend("hgx-h200-8")
    node = backend.node_info()
    status = StatusService(backend, node, pcie_interval_s=60)
    table = LeaseTable(node, healthy(node), now_s=T0)
    granted(table.ask(Ask(count=1, owner=(("job", "7"),)), T0))
    state = NodeState(NodeFacts(node, CONTROL))
    service = MetricsService(state, status, hostname="gpu-node-7", leases=table.view)
    try:
        status.suspend("driver upgrade in progress")
        text = (await service.scrape()).decode()
    finally:
        await service.close()
        await status.close()
    assert values(text, "nvidia_docker_gpus_released", reason="driver upgrade in progress") == [1]
    assert not [s for s in samples(text) if s.name.startswith("DCGM_")]
    leased = [s for s in samples(text) if s.name == "nvidia_docker_gpu_leased"]
    assert [(s.labels["owner"], s.value) for s in leased] == [("job=7", 1)]
    assert len(values(text, "nvidia_docker_gpu_lease_state")) == 8
    assert values(text, "nvidia_docker_container_lookups_total") == [0, 0]
    assert len(values(text, "nvidia_docker_build_info")) == 1
    assert values(text, "nvidia_docker_pcie_sample_age_seconds") == []  # no sample served
