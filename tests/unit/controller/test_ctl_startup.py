"""What ``nvidia-docker-ctl`` loads at start: the fleet commands never import aiohttp (its
import and the TLS contexts it makes cost about 0.1 s of every run: docs/fleet.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted(m for m in sys.modules
                                                if m.split('.')[0] in ('aiohttp', 'paramiko')))))
sys.argv = ['nvidia-docker-ctl', *sys.argv[1:]]
from controller.ctl.main import main
main()
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _heavy_modules(*args: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fleet_query_over_http_loads_neither_aiohttp_nor_paramiko(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes"
    nodes.write_text(f"http://127.0.0.1:{_closed_port()}\n")
    for command in (["leases"], ["status"], ["free", "--gpus", "1"]):
        code, heavy = _heavy_modules(*command, "--nodes", str(nodes))
        assert code == 3  # no node answered (the one node cannot be reached)
        assert heavy == [], command


def test_help_loads_neither() -> None:
    assert _heavy_modules("--help") == (0, [])
