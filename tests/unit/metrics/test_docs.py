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
from tests.unit.agent.conftest import CountingBackend
from tests.unit.metrics.conftest import MakeAgent

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
PROMTOOL = shutil.which("promtool")


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


async def test_every_exported_family_is_documented(make_agent: MakeAgent) -> None:
    text = await (await make_agent(CountingBackend("hgx-h200-8"))).scrape()
    doc = DOC.read_text(encoding="utf-8")
    parse = cast(Callable[[str], Iterable[Metric]], text_string_to_metric_families)
    families = {family.name for family in parse(text)} | {m.name for m in GPU_METRICS}
    undocumented = [f for f in sorted(families) if not f.startswith("process_")
                    and f"`{f}`" not in doc and f"`{f}_total`" not in doc]  # fmt: skip
    assert undocumented == []
