"""The families dcgm-exporter has that came with GPM, MIG and health: profiling ratios and
rates, per-MIG-device series, the XID's labels, and counters under dcgm-exporter's names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.core import Metric

from agent.gpu import nodefile
from agent.health.rule import HEALTHY, DeviceHealth
from agent.metrics.exposition import render_families
from agent.metrics.gpu_families import COUNTER, GPU_METRICS, PROFILING_METRICS, gpu_families
from agent.metrics.service import render
from tests.unit.agent.conftest import CountingBackend
from tests.unit.metrics.conftest import MakeAgent, samples, values

MIB = 2**20
PROFILING = [m.name for m in PROFILING_METRICS]


@dataclass(frozen=True)
class Health:
    health: tuple[DeviceHealth, ...]
    last_xids: tuple[int, ...]


async def test_profiling_values_in_dcgms_units(make_agent: MakeAgent) -> None:
    text = await (await make_agent(CountingBackend("hgx-h200-8"))).scrape()
    busy = {name: values(text, name, gpu="2") for name in PROFILING}
    assert busy == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": [pytest.approx(0.964)],
        "DCGM_FI_PROF_SM_ACTIVE": [pytest.approx(0.923)],
        "DCGM_FI_PROF_SM_OCCUPANCY": [pytest.approx(0.417)],
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": [pytest.approx(0.638)],
        "DCGM_FI_PROF_DRAM_ACTIVE": [pytest.approx(0.529)],
        "DCGM_FI_PROF_PCIE_TX_BYTES": [pytest.approx(1788.1 * MIB)],
        "DCGM_FI_PROF_PCIE_RX_BYTES": [pytest.approx(2203.0 * MIB)],
        "DCGM_FI_PROF_NVLINK_TX_BYTES": [pytest.approx(118213.5 * MIB)],
        "DCGM_FI_PROF_NVLINK_RX_BYTES": [pytest.approx(117904.2 * MIB)],
    }
    assert values(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu="0") == [0]  # idle is 0
    for name in PROFILING:
        assert f"# TYPE {name} gauge\n" in text
        assert len(values(text, name)) == 8


async def test_no_profiling_values_no_profiling_series(make_agent: MakeAgent) -> None:
    """h200x2 was dumped from machines whose agent had no GPM: nothing, not even a HELP."""
    text = await (await make_agent(CountingBackend("h200x2"))).scrape()
    for name in PROFILING:
        assert name not in text


async def test_mig_devices_have_their_own_series(make_agent: MakeAgent) -> None:
    node = nodefile.load("h200x2-mig").info
    sick = DeviceHealth(False, "XID 94 (contained ECC error)", 94, 1.0)
    health = Health((DeviceHealth(migs=((1, sick),)), HEALTHY), (94, 0))
    text = await (await make_agent(CountingBackend("h200x2-mig"), health=health)).scrape()
    used = [s for s in samples(text) if s.name == "DCGM_FI_DEV_FB_USED" and "GPU_I_ID" in s.labels]
    assert [(s.labels["GPU_I_PROFILE"], s.labels["GPU_I_ID"], s.value) for s in used] == [
        ("3g.71gb", "1", 20480), ("2g.35gb", "5", 0), ("1g.18gb", "13", 0), ("1g.18gb", "14", 0),
    ]  # fmt: skip
    (first,) = [s for s in used if s.labels["GPU_I_ID"] == "1"]
    assert first.labels["UUID"] == node.devices[0].uuid  # the GPU's, as dcgm-exporter has it
    assert first.labels["gpu"] == "0"
    assert values(text, "DCGM_FI_DEV_FB_FREE", GPU_I_ID="1") == [71424 - 20480 - 512]
    assert values(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_I_ID="1") == [pytest.approx(0.615)]
    assert values(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_I_ID="5") == [0]
    assert values(text, "DCGM_FI_PROF_PCIE_TX_BYTES", gpu="0") == []  # not per instance
    whole = [s for s in samples(text) if s.name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
             and "GPU_I_ID" not in s.labels]  # fmt: skip
    assert [s.labels["gpu"] for s in whole] == ["1"]  # GPU 0 gave no whole-GPU values
    healthy = {
        s.labels.get("GPU_I_ID"): s.value
        for s in samples(text)
        if s.name == "nvidia_docker_gpu_healthy" and s.labels["gpu"] == "0"
    }
    assert healthy == {None: 1, "1": 1, "5": 0, "13": 1, "14": 1}


async def test_compute_instances_of_one_gpu_instance_make_one_series(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    """MIG devices 0:0 and 0:1 are two compute instances of GPU instance 1 (as
    ``nvidia-smi mig -cci`` makes them): one series per metric for that GPU instance, never
    two samples of one series, and 0 healthy while either MIG device is withdrawn."""
    raw = json.loads(nodefile.resolve("h200x2-mig").read_text(encoding="utf-8"))
    first, second = raw["devices"][0]["mig_devices"][:2]
    first["profile"] = second["profile"] = "1c.3g.71gb"
    second["gpu_instance_id"], second["compute_instance_id"] = 1, 1
    path = tmp_path / "node.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    sick = DeviceHealth(False, "XID 94 (contained ECC error)", 94, 1.0)
    health = Health((DeviceHealth(migs=((1, sick),)), HEALTHY), (94, 0))
    text = await (await make_agent(CountingBackend(str(path)), health=health)).scrape()
    series = [(s.name, tuple(sorted(s.labels.items()))) for s in samples(text)]
    assert len(series) == len(set(series))  # Prometheus drops all but one of a duplicate
    used = [s for s in samples(text) if s.name == "DCGM_FI_DEV_FB_USED" and "GPU_I_ID" in s.labels]
    assert [(s.labels["GPU_I_PROFILE"], s.labels["GPU_I_ID"], s.value) for s in used] == [
        ("3g.71gb", "1", 20480), ("1g.18gb", "13", 0), ("1g.18gb", "14", 0),
    ]  # fmt: skip
    healthy = {
        s.labels.get("GPU_I_ID"): s.value
        for s in samples(text)
        if s.name == "nvidia_docker_gpu_healthy" and s.labels["gpu"] == "0"
    }
    assert healthy == {None: 1, "1": 0, "13": 1, "14": 1}


async def test_the_xid_carries_dcgm_exporters_labels(make_agent: MakeAgent) -> None:
    health = Health((HEALTHY,) * 8, (0, 79, 13, 500) + (0,) * 4)
    text = await (await make_agent(CountingBackend("hgx-h200-8"), health=health)).scrape()
    labels = {
        s.labels["gpu"]: (s.labels["err_code"], s.labels["err_msg"], s.value)
        for s in samples(text)
        if s.name == "DCGM_FI_DEV_XID_ERRORS"
    }
    assert labels["0"] == ("0", "No Error", 0)
    assert labels["1"] == ("79", "GPU has fallen off the bus", 79)
    assert labels["2"] == ("13", "Graphics Engine Exception", 13)
    assert labels["3"] == ("500", "Unknown Error", 500)
    assert "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n" in text


async def test_counters_are_typed_so_under_their_own_names(make_agent: MakeAgent) -> None:
    text = await (await make_agent(CountingBackend("hgx-h200-8"))).scrape()
    counters = [m.name for m in GPU_METRICS if m.kind == COUNTER]
    assert set(counters) == {
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_ECC_DBE_VOL_L1", "DCGM_FI_DEV_ECC_DBE_VOL_L2", "DCGM_FI_DEV_ECC_DBE_VOL_DEV",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    }  # fmt: skip
    for name in counters:
        if name in ("DCGM_FI_DEV_ECC_DBE_VOL_L1", "DCGM_FI_DEV_ECC_DBE_VOL_L2"):
            continue  # not supported on Hopper: absent
        assert f"# TYPE {name} counter\n" in text
        assert f"\n{name}{{" in text
        assert f"{name}_total" not in text
    assert "# TYPE nvidia_docker_http_requests_total counter" in text  # ours keep _total


def test_the_renderer_writes_what_prometheus_client_writes_but_for_counters() -> None:
    node = nodefile.load("hgx-h200-8")
    families = gpu_families(
        node.info.devices, [d.status for d in node.devices], [d.throughput for d in node.devices],
        {}, driver_version="580.159.04", hostname='odd "host"\\\n',
    )  # fmt: skip
    gauges = [f for f in families if f.type != COUNTER]
    assert render_families(gauges) == render(gauges)
    counter = Metric("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", COUNTER)
    counter.add_sample("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", {"gpu": "0"}, 3)
    assert render_families([counter]).decode() == (
        "# HELP DCGM_FI_DEV_PCIE_REPLAY_COUNTER Total number of PCIe retries.\n"
        "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter\n"
        'DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="0"} 3.0\n'
    )
