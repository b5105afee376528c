"""The operator docs' command examples, run as written, against real agents.

Which examples run: a fenced block that follows the line ``<!-- runnable -->`` (or
``<!-- runnable: SETUP -->``) in docs/fleet.md, docs/nvidia-docker.md or docs/mesos.md.
In it, a line ``$ COMMAND`` (continued by lines ending in ``\\``) is run by ``sh`` in a
directory holding the docs' inventory ``hosts.yml`` and ``bad.yml``; the lines up to the
next ``$`` are what it must print, stdout and stderr as a terminal shows them, and a last
line ``[exit N]`` the exit code it must end with (none: 0).

What may differ from the sample: ``...`` alone on a line stands for any lines (none too),
``...`` within a line for any text; dates, times, TCP ports of 4 and 5 digits (the test
farm's are random), ``elapsed_s`` and SSH key fingerprints are normalised on both sides, and
the test's HOME is shown as the docs' ``/home/ops``.

The fleet is the docs' own (docs/fleet.md, "What it prints"): ``gpu01`` an 8-GPU
``hgx-h200-8`` whose GPU 3 fell off the bus (XID 79), ``gpu02`` a one-GPU ``h200`` on
driver 575.64.05, ``gpu03`` stopped (nothing listens on its port), ``gpu04`` a name that
does not resolve, ``dgx01`` an ``hgx-h200-8`` behind a real OpenSSH server; agents are
real ``python -m agent.daemon --simulate`` processes writing no CDI spec. SETUP may be
``no-known-hosts`` (a HOME whose known_hosts lacks the sshd's key) or ``docker`` (a private
dockerd with a labelled image ``cuda``, ``DOCKER_HOST`` pointing at it and ``NV_HOST`` at
``gpu02``'s agent) or ``mesos`` (``NV_HOST`` at ``dgx01``'s agent, by HTTP).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.doc_samples import matches
from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.node_life import NodeFile
from tests.support.prerequisites import require_root
from tests.support.services import free_port, stop_process, wait_until
from tests.support.sshd import start_sshd, stop_sshd

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DOCS = ("docs/fleet.md", "docs/nvidia-docker.md", "docs/mesos.md")
MARKER = re.compile(r"^<!-- runnable(?::\s*([\w-]+))?\s*-->$")
SETUPS = ("fleet", "no-known-hosts", "docker", "mesos")
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}


@dataclass(frozen=True)
class Example:
    doc: str
    line: int  # of the command, in the doc
    setup: str
    command: str
    expected: str  # the sample's lines, without [exit N]
    exit_code: int

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        lines = (REPO / doc).read_text(encoding="utf-8").splitlines()
        for number, text in enumerate(lines):
            marker = MARKER.match(text.strip())
            if marker is None:
                continue
            indent = len(text) - len(text.lstrip())  # a block inside a list item
            block = [line[indent:] for line in lines[number + 1 :]]
            assert block[0].startswith("```"), f"{doc}:{number + 2}: no fence after the marker"
            end = next(i for i in range(1, len(block)) if block[i].startswith("```"))
            found += _block(doc, number + 3, block[1:end], marker.group(1) or "fleet")
    return found


def _block(doc: str, first: int, lines: list[str], setup: str) -> list[Example]:
    assert setup in SETUPS, f"{doc}:{first}: unknown setup {setup!r}"
    found: list[Example] = []
    at = 0
    while at < len(lines):
        assert lines[at].startswith("$ "), f"{doc}:{first + at}: expected a $ command"
        start = first + at
        command = lines[at][2:]
        while command.endswith("\\"):
            at += 1
            command += "\n" + lines[at]  # sh reads the backslash-newline as one line
        at += 1
        output = []
        while at < len(lines) and not lines[at].startswith("$ "):
            output.append(lines[at])
            at += 1
        code = 0
        if output and re.fullmatch(r"\[exit \d+\]", output[-1]):
            code = int(output.pop()[6:-1])
        found.append(Example(doc, start, setup, command, "\n".join(output), code))
    return found


# --- the fleet -----------------------------------------------------------------------------


@dataclass
class Site:
    work: Path  # the commands' directory: hosts.yml, bad.yml
    env: dict[str, str]
    homes: dict[str, Path]
    agents: dict[str, AgentProcess]


def _agent(base: Path, node: str, path: Path | None = None) -> AgentProcess:
    simulate = str(path) if path is not None else node
    return launch_agent(base / node, "--cdi-spec-dir", "", simulate=simulate)


def _unhealthy(agent: AgentProcess, gpu: int) -> bool:
    status, _, body = agent.get("/gpu/health/json")
    return status == 200 and json.loads(body)["Devices"][gpu]["Healthy"] is False


def _shims(bin_dir: Path) -> None:
    """``nvidia-docker-ctl`` and ``nvidia-docker`` of this checkout, whatever is installed."""
    bin_dir.mkdir()
    for name, target in (
        ("nvidia-docker-ctl", "-m controller.ctl.main"),
        ("nvidia-docker", f"{REPO / 'bin' / 'nvidia-docker'}"),
    ):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} {target} "$@"\n')
        shim.chmod(0o755)


INVENTORY = """\
all:
  children:
    gpu:
      vars:
        nvidia_docker_transport: http
        ansible_host: 127.0.0.1
      hosts:
        gpu01: {{nvidia_docker_agent_listen_port: {gpu01}}}
        gpu02: {{nvidia_docker_agent_listen_port: {gpu02}}}
        gpu03: {{nvidia_docker_agent_listen_port: {gpu03}}}
        gpu04: {{ansible_host: gpu04.invalid}}
    dgx:
      hosts:
        dgx01: {{ansible_host: 127.0.0.1, ansible_port: {ssh}, \
nvidia_docker_agent_listen_port: {dgx01}, ansible_user: {user}}}
"""
BAD = "all:\n  hosts:\n    - gpu01\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_root()
    base = tmp_path_factory.mktemp("docs")
    sick = NodeFile(base / "gpu01.json", "hgx-h200-8")
    older = NodeFile(base / "gpu02.json", "h200")
    older.load_driver("575.64.05")
    agents = {
        "gpu01": _agent(base, "gpu01", sick.path),
        "gpu02": _agent(base, "gpu02", older.path),
        "dgx01": _agent(base, "hgx-h200-8"),
    }
    server, sshd = start_sshd(base)
    try:
        for agent in agents.values():
            wait_ready(agent)
        sick.event(3, "xid", 79)  # GPU 3 of gpu01 falls off the bus
        wait_until(lambda: _unhealthy(agents["gpu01"], 3), what="GPU 3 unhealthy", timeout_s=30)
        homes = {
            "fleet": server.client_home(base / "home"),
            "no-known-hosts": server.client_home(base / "stranger", knows_host=False),
        }
        work = base / "work"
        work.mkdir()
        ports = {name: agent.port for name, agent in agents.items()}
        text = INVENTORY.format(gpu03=free_port(), ssh=server.port, user=server.user, **ports)
        (work / "hosts.yml").write_text(text)
        (work / "bad.yml").write_text(BAD)
        _shims(base / "bin")
        keep = ("LANG", "LC_ALL", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(
            PATH=f"{base / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",  # stdout and stderr in the order written, as on a terminal
            USER=server.user,
            NV_SSH_CONFIG="none",
        )
        yield Site(work, env, homes, agents)
    finally:
        stop_sshd(server, sshd)
        for agent in agents.values():
            stop_process(agent.proc)


@pytest.fixture(scope="module")
def engine(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEngine]:
    engine, proc = start_engine(tmp_path_factory.mktemp("dockerd"))
    try:
        engine.import_busybox("cuda", GPU_LABELS)
        yield engine
    finally:
        stop_engine(engine, proc)


def run(example: Example, site: Site, request: pytest.FixtureRequest) -> tuple[int, str]:
    home = site.homes.get(example.setup, site.homes["fleet"])
    env = dict(site.env, HOME=str(home))
    if example.setup == "mesos":
        env.update(NV_HOST=f"http://127.0.0.1:{site.agents['dgx01'].port}")
    if example.setup == "docker":
        engine: DockerEngine = request.getfixturevalue("engine")
        env.update(DOCKER_HOST=engine.host, NV_HOST=f"http://127.0.0.1:{site.agents['gpu02'].port}")
    done = subprocess.run(
        ["sh", "-c", example.command],
        cwd=site.work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout.decode(errors="replace").replace(str(home), "/home/ops")


EXAMPLES = examples()


def test_the_docs_mark_examples_to_run() -> None:
    assert len(EXAMPLES) >= 15
    assert {e.doc for e in EXAMPLES} == set(DOCS)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_prints_what_the_doc_shows(
    example: Example, site: Site, request: pytest.FixtureRequest
) -> None:
    code, output = run(example, site, request)
    shown = f"$ {example.command}\n--- printed:\n{output}--- exit {code}"
    assert matches(example.expected, output), shown
    assert code == example.exit_code, shown


def test_the_matcher() -> None:
    assert matches("a\n...\nd", "a\nb\nc\nd")
    assert matches("a\n...\nd", "a\nd")
    assert matches("x ... z", "x y y z")
    assert not matches("x ... z", "x y\nz")
    assert matches("at 2026/12/01 10:00:00 on :43941", "at 2025/01/31 09:09:09 on :51234")
    assert not matches("a\nb", "a\nc")
