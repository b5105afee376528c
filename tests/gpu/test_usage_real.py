"""The usage ledger on a real NVIDIA GPU that nobody scrapes: a hold gets the energy its GPU
used, also while the agent's PCIe and energy sampler rests (docs/usage.md, "How the figures
are made").

The agent (real NVML, its own port and directories, no container engine) grants a lease asked
over the REST API (pending for 600 s, so it holds its GPU) and nobody reads ``/gpu/status`` or
``/metrics``: past 60 s the sampler rests, and the GPU's energy counter moves only with the
one sample a minute the ledger's sweep takes itself. The test reads the same counter through
NVML in its own process before the ask and after the release; the ledger's joules per
GPU-second of the hold must be the GPU's mean power over that time. With a ledger that never
samples (the code before 2026-12-07), the counter froze once the sampler rested and the hold
got about 60 s of its 150 s.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_usage_real.py`` (about four minutes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import free_port, port_open, stop_process, wait_stable, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

HOLD_S = 150.0  # past the sampler's rest (60 s) and past two of the ledger's own samples
TEAM = "energy-check"


def _call(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def agent_port(tmp_path: Path) -> Iterator[int]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    port = free_port()
    log_path = tmp_path / "agent.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
             "-s", str(tmp_path / "plugins"), "-d", str(tmp_path / "volumes"),
             "--state-dir", str(tmp_path / "state"), "--cdi-spec-dir", "",
             "--docker-socket", str(tmp_path / "no-docker.sock"),
             "--podman-socket", str(tmp_path / "no-podman.sock"),
             "--usage-interval", "0.5", "--lease-pending", "600"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: port_open(port), what="the agent", timeout_s=120, proc=proc)
        yield port
    finally:
        stop_process(proc)
        print(log_path.read_text(errors="replace"))


def _team(port: int) -> dict[str, Any] | None:
    status, answer = _call(port, "GET", "/usage/json?by=label:team&since=-1h")
    if status == 503:  # the ledger is being opened
        return None
    assert status == 200, answer
    rows = [row for row in answer["rows"] if row["team"] == TEAM]
    return rows[0] if rows else None


def test_an_unscraped_hold_gets_the_energy_its_gpu_used(agent_port: int) -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        status, grant = _call(agent_port, "POST", "/leases", {"count": 1, "owner": {"team": TEAM}})
        assert status == 201, grant
        handle = pynvml.nvmlDeviceGetHandleByUUID(grant["Devices"][0]["UUID"])
        try:
            first_mj, first_s = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.time()
        except pynvml.NVMLError_NotSupported:
            pytest.skip("this GPU has no energy counter")
        time.sleep(HOLD_S)  # nobody reads status: the sampler rests from 60 s on
        status, released = _call(agent_port, "DELETE", f"/leases/{grant['Lease']}")
        assert status == 200, released
        last_mj, last_s = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.time()
    finally:
        pynvml.nvmlShutdown()
    mean_w = (last_mj - first_mj) / 1000 / (last_s - first_s)

    # the hold's last minute is credited at the counter's next move, a minute at most later
    def credited() -> bool:
        row = _team(agent_port)
        return row is not None and (row["energy_joules"] or 0) >= 0.9 * mean_w * HOLD_S

    wait_until(credited, what=f"about {mean_w * HOLD_S:.0f} J for team {TEAM}", timeout_s=150,
               interval_s=1.0)  # fmt: skip
    wait_stable(lambda: _team(agent_port), alike=3, what="the ledger settled", timeout_s=60,
                interval_s=1.0)  # fmt: skip
    row = _team(agent_port)
    assert row is not None
    assert row["gpu_seconds"] == pytest.approx(last_s - first_s, abs=5.0)
    held_w = row["energy_joules"] / row["gpu_seconds"]
    print(f"the GPU drew {mean_w:.1f} W; the ledger gave the hold {held_w:.1f} W "
          f"({row['energy_joules']:.0f} J over {row['gpu_seconds']:.1f} s)")  # fmt: skip
    assert held_w == pytest.approx(mean_w, rel=0.10)
