"""docs/metrics.md says what the agent does: its scrape config is valid, its tables name
every metric the agent exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics.gpu_families import GPU_METRICS
from agent.metrics.service import render
from agent.metrics.usage_families import usage_families
from tests.unit.agent.conftest import CountingBackend
from tests.unit.metrics.conftest import MakeAgent
from tests.unit.usage.test_idle_ledger import node_of

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
PROMTOOL = shutil.which("promtool")


def _leased_idle_query() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("GPUs leased and idle for the last hour", 1)[1]
    match = re.search(r"```promql\n(.*?)```", section, re.DOTALL)
    assert match, "docs/metrics.md has no query for leased idle GPUs"
    return match.group(1).strip()


def _scrape_config() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Scrape config", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert match, "docs/metrics.md has no scrape config block"
    return match.group(1)


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_scrape_config_is_valid(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(_scrape_config(), encoding="utf-8")
    done = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


LEASED_IDLE_TEST = """
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'nvidia_docker_gpu_leased{UUID="GPU-a",gpu="3",lease="l1",state="running"}'
        values: '1x60'
      - series: 'nvidia_docker_gpu_leased{UUID="GPU-b",gpu="4",lease="l2",state="running"}'
        values: '1x60'
      # GPU-a ran a job of another container in the first half hour, idle since
      - series: 'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-a",gpu="3",container="old-job"}'
        values: '0x30'
      - series: 'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-a",gpu="3"}'
        values: '_x30 0x30'
      - series: 'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-b",gpu="4"}'
        values: '0x30 40x30'
    promql_expr_test:
      - expr: leased_idle
        eval_time: 50m
        exp_samples:
          - labels: 'leased_idle{UUID="GPU-a",gpu="3",lease="l1",state="running"}'
            value: 0
"""


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_leased_idle_query_finds_a_gpu_whose_labels_changed(tmp_path: Path) -> None:
    """The documented query, on a GPU leased and idle whose series changed labels within
    the hour (a job of another container ran on it), and one busy GPU."""
    assert PROMTOOL is not None
    query = _leased_idle_query()
    rule = "      - record: leased_idle\n        expr: |\n"
    rule += "".join(f"          {line}\n" for line in query.splitlines())
    (tmp_path / "rules.yml").write_text("groups:\n  - name: docs\n    rules:\n" + rule)
    (tmp_path / "test.yml").write_text(LEASED_IDLE_TEST)
    done = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


async def test_every_exported_family_is_documented(make_agent: MakeAgent, tmp_path: Path) -> None:
    """What a scrape gives, what it gives while the GPUs are released, and the usage
    ledger's families."""
    agent = await make_agent(CountingBackend("hgx-h200-8"))
    text = await agent.scrape()
    agent.service.status.suspend("driver upgrade in progress")
    text += await agent.scrape()
    async for node in node_of("h200", tmp_path):
        text += render(usage_families(node.ledger, "gpu-node-7")).decode()
    doc = DOC.read_text(encoding="utf-8")
    parse = cast(Callable[[str], Iterable[Metric]], text_string_to_metric_families)
    families = {family.name for family in parse(text)} | {m.name for m in GPU_METRICS}
    assert {"nvidia_docker_gpus_released", "nvidia_docker_usage_ledger_behind"} <= families
    undocumented = [f for f in sorted(families) if not f.startswith("process_")
                    and f"`{f}`" not in doc and f"`{f}_total`" not in doc]  # fmt: skip
    assert undocumented == []
