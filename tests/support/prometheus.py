"""A real Prometheus server (Debian's ``prometheus``) scraping test targets on loopback.

Started with its own config and data directory under a temporary root, listening on a
free 127.0.0.1 port; ready when ``/-/ready`` answers. ``query`` asks its HTTP API; ``stop``
ends it and removes the root.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.services import free_port, stop_process, wait_until

Series = list[dict[str, Any]]  # the API's vector result: [{"metric": {...}, "value": [t, "v"]}]


@dataclass
class PrometheusServer:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.root / "prometheus.log").read_text(errors="replace")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> Series:
        """An instant query; the vector of series it gives."""
        data = self.api("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        result: Series = data["result"]
        return result

    def wait_for(
        self, expr: str, ready: Callable[[Series], bool] = bool, timeout_s: float = 60
    ) -> Series:
        """Query ``expr`` until ``ready(result)``; the result then."""
        found: list[Series] = []

        def check() -> bool:
            result = self.query(expr)
            found[:] = [result]
            return ready(result)

        try:
            wait_until(check, what=f"Prometheus query {expr}", timeout_s=timeout_s,
                       proc=self.proc, interval_s=0.2)  # fmt: skip
        except TimeoutError:
            raise AssertionError(
                f"{expr}: {found[0] if found else 'no answer'} after {timeout_s:.0f} s; "
                f"targets: {self.api('/api/v1/targets')}"
            ) from None
        return found[0]


def start_prometheus(
    targets: Sequence[str], *, job: str = "nvidia-docker", interval_s: int = 1
) -> PrometheusServer:
    """Prometheus scraping ``targets`` (``127.0.0.1:PORT``) every ``interval_s``."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed: apt-get install prometheus")
    root = Path(tempfile.mkdtemp(prefix="nvd-prometheus-"))
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s"},
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics",
             "static_configs": [{"targets": list(targets)}]}
        ],
    }  # fmt: skip
    (root / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    with (root / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
    server = PrometheusServer(proc, port, root)

    def ready() -> bool:
        with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
            return bool(resp.status == 200)

    try:
        wait_until(ready, what="prometheus", timeout_s=60, proc=proc, interval_s=0.1)
    except BaseException:
        stop_prometheus(server)
        raise
    return server


def stop_prometheus(server: PrometheusServer) -> None:
    stop_process(server.proc)
    shutil.rmtree(server.root, ignore_errors=True)
