"""NVIDIA's dcgm-exporter dashboard works on the agent: every panel query gives series.

A real agent serves the simulated 8-GPU node (``--simulate hgx-h200-8``), a real Prometheus
(Debian's ``prometheus``) scrapes it every second, and each query of the official dashboard
(``tests/fixtures/grafana/dcgm-exporter-dashboard-queries.json``, where they came from is
in the file) is evaluated through Prometheus's HTTP API, the dashboard's variables
``$instance`` and ``$gpu`` replaced by a regular expression that matches every value (what
Grafana's "All" sends when ``includeAll`` has no custom value).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.agent_process import AgentProcess, running_agent
from tests.support.fixture_files import FIXTURES
from tests.support.prometheus import PrometheusServer, start_prometheus, stop_prometheus

pytestmark = pytest.mark.e2e

QUERIES: dict[str, Any] = json.loads(
    (FIXTURES / "grafana" / "dcgm-exporter-dashboard-queries.json").read_text()
)
ALL = ".+"  # every value of a variable
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def with_all(expr: str) -> str:
    """The query as Grafana sends it with every variable at "All"."""
    return expr.replace("$instance", ALL).replace("$gpu", ALL)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    base = tmp_path_factory.mktemp("dashboard-agent")
    state = ("--state-dir", str(base / "state"), "--cdi-spec-dir", "")  # nothing outside base
    with running_agent(base, *state, simulate="hgx-h200-8") as agent:
        yield agent


@pytest.fixture(scope="module")
def prometheus(agent: AgentProcess) -> Iterator[PrometheusServer]:
    server = start_prometheus([f"127.0.0.1:{agent.port}"], interval_s=1)
    try:
        server.wait_for('up{job="nvidia-docker"} == 1')
        yield server
    finally:
        stop_prometheus(server)


def test_the_fixture_says_where_it_came_from() -> None:
    source = QUERIES["source"]
    assert source["repository"] == "https://github.com/NVIDIA/dcgm-exporter"
    assert source["path"] == "grafana/dcgm-exporter-dashboard.json"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert len(QUERIES["panels"]) == 8


@pytest.mark.parametrize("variable", QUERIES["variables"], ids=lambda v: v["name"])
def test_each_variable_has_values(prometheus: PrometheusServer, variable: dict[str, str]) -> None:
    match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"])
    assert match, variable
    metric, label = match.groups()
    prometheus.wait_for(metric)
    found = prometheus.api(f"/api/v1/label/{label}/values", **{"match[]": metric})
    expected = 8 if label == "gpu" else 1  # eight GPUs, one agent
    assert len(found) == expected, found


@pytest.mark.parametrize("panel", QUERIES["panels"], ids=lambda p: f"{p['id']}-{p['title']}")
def test_each_panel_query_gives_series(prometheus: PrometheusServer, panel: dict[str, Any]) -> None:
    series = prometheus.wait_for(with_all(panel["expr"]))
    assert series, panel["expr"]
    for label in LEGEND_LABEL.findall(panel["legendFormat"]):  # "GPU {{gpu}}" names each
        assert all(label in s["metric"] for s in series), (label, series)
    if "{{gpu}}" in panel["legendFormat"]:
        assert sorted(int(s["metric"]["gpu"]) for s in series) == list(range(8))


def test_the_tensor_panel_shows_the_training_gpus_busy(prometheus: PrometheusServer) -> None:
    (panel,) = [p for p in QUERIES["panels"] if "TENSOR" in p["expr"]]
    series = prometheus.wait_for(with_all(panel["expr"]))
    ratios = {s["metric"]["gpu"]: float(s["value"][1]) for s in series}
    assert ratios["2"] == ratios["3"] == pytest.approx(0.638)  # GPM's 63.8 %, as a ratio
    assert {ratios[g] for g in "014567"} == {0.0}
    assert all(0.0 <= r <= 1.0 for r in ratios.values())


def test_the_agent_logged_no_traceback(agent: AgentProcess) -> None:
    assert "Traceback" not in agent.log()
