"""The README's quick start, run as a newcomer runs it, and what it leaves on the machine.

Step 1 (the block after ``<!-- quick-start -->``) is run as written, with the virtual
environment's path ``/opt/nvidia-docker/venv`` moved into the test's temporary directory:
a fresh venv, not activated, ``pip install .`` from this checkout (from PyPI for the
dependencies), then the agent by its path. On this machine, which has no GPU, the agent
must stop at once with one line that says how to try it without one. Then the demo line
(``<!-- quick-start-demo -->``) runs the simulated agent, on a free port given through
``NVIDIA_DOCKER_PLUGIN_LISTEN`` (the line stays as written), and the README's ``curl``
examples are asked of it. Nothing machine-wide may change meanwhile: not the plugin
directories Docker reads, not the CDI directories, not the volume directory, and the
agent's private directory is gone once it stops.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.services import free_port, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
VENV = "/opt/nvidia-docker/venv"
MACHINE_PATHS = (
    Path("/run/docker/plugins"),
    Path("/etc/docker/plugins"),
    Path("/var/run/cdi"),
    Path("/etc/cdi"),
    Path("/var/lib/nvidia-docker"),
    Path("/opt/nvidia-docker"),
)


def block_after(marker: str) -> list[str]:
    """The command lines of the fenced block after ``<!-- marker -->`` (no comments)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"<!-- {marker} -->")
    assert lines[start + 1].startswith("```"), f"{marker}: no fenced block follows"
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("```"))
    return [line for line in lines[start + 2 : end] if line.strip() and not line.startswith("#")]


def snapshot() -> dict[str, tuple[tuple[str, int, int], ...] | None]:
    """Every machine path the agent could write to, with what it holds."""
    found: dict[str, tuple[tuple[str, int, int], ...] | None] = {}
    for root in MACHINE_PATHS:
        if not root.exists():
            found[str(root)] = None
            continue
        entries = []
        for path in sorted([root, *root.rglob("*")]):
            st = path.lstat()
            entries.append((str(path), st.st_ino, st.st_mtime_ns))
        found[str(root)] = tuple(entries)
    return found


def simulated_dirs() -> set[str]:
    return {p.name for p in Path("/tmp").glob("nvidia-docker-simulated-*")}


@pytest.fixture
def newcomer(tmp_path: Path) -> dict[str, str]:
    """A clean environment: a HOME of its own, none of the suite's agent variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVIDIA_DOCKER_PLUGIN_")}
    env["HOME"] = str(tmp_path / "home")
    env.pop("VIRTUAL_ENV", None)
    (tmp_path / "home").mkdir()
    return env


def test_the_quick_start_works_as_written_and_touches_nothing_machine_wide(
    tmp_path: Path, newcomer: dict[str, str]
) -> None:
    before, dirs_before = snapshot(), simulated_dirs()
    venv = tmp_path / "venv"
    (install,) = block_after("quick-start")[:1]
    commands = [c.strip() for c in install.replace(VENV, str(venv)).split("&&")]
    *setup, run_agent = commands
    assert run_agent == f"{venv}/bin/nvidia-docker-plugin"
    for command in setup:
        done = subprocess.run(
            command, shell=True, cwd=REPO, env=newcomer, capture_output=True, text=True,
            timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"

    # No GPU here: one line that says how to try the agent anyway, and nothing left behind.
    newcomer_port = {**newcomer, "NVIDIA_DOCKER_PLUGIN_LISTEN": f"127.0.0.1:{free_port()}"}
    done = subprocess.run(
        shlex.split(run_agent), env=newcomer_port, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if "Error:" in line]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1, done.stderr
    assert "--simulate h200" in errors[0]

    (demo,) = block_after("quick-start-demo")
    port = free_port()
    log = tmp_path / "demo.log"
    env = {**newcomer, "NVIDIA_DOCKER_PLUGIN_LISTEN": f"127.0.0.1:{port}"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            shlex.split(demo.replace(VENV, str(venv))), env=env, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: "Ready" in log.read_text(), what="the demo agent", proc=proc)
        for line in block_after("runnable"):
            command = line.split("#", 1)[0].strip().replace("localhost:3476", f"127.0.0.1:{port}")
            answer = subprocess.run(
                shlex.split(command), capture_output=True, text=True, timeout=30, check=False
            )
            assert answer.returncode == 0, command
            assert answer.stdout.strip(), command
        status = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
             f"http://127.0.0.1:{port}/gpu/info/json"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert status.stdout == "200"
    finally:
        stop_process(proc)
    text = log.read_text()
    (private,) = re.findall(r"plugin socket, volumes and state in (\S+);", text)
    assert Path(private).name.startswith("nvidia-docker-simulated-")
    assert not Path(private).exists()  # removed when the agent stopped
    assert "Traceback" not in text
    assert "No libcuda" not in text  # the host's linker cache is not the simulated node's
    assert "no driver files" in text
    assert snapshot() == before
    assert simulated_dirs() == dirs_before
