"""The REST API's examples in the docs, run as written against real agents.

Which examples run: a fenced block that follows ``<!-- runnable-agent: NODE -->`` in
``DOCS``. NODE is a built-in simulated node (``h200``, ``h200x2``, ``hgx-h200-8``,
``h200x2-mig``), optionally with a state: ``NODE+xid79-on-N`` (GPU N fell off the bus: an
XID 79 is delivered before the examples run). In the block, a line ``$ COMMAND`` is run by
``sh`` with ``localhost:3476`` pointing at that node's agent (a real ``python -m
agent.daemon`` on a free port, writing its CDI spec into a private directory); the lines up
to the next ``$`` are what it must print (tests/support/doc_samples.py says what may differ:
``...``, dates, times, ports).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.doc_samples import matches
from tests.support.node_life import Agent, NodeFile, start_agent
from tests.support.services import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DOCS = ("docs/api.md", "docs/metrics.md", "docs/mesos.md")
MARKER = re.compile(r"^<!-- runnable-agent:\s*([\w-]+)(?:\+xid79-on-(\d+))?\s*-->$")


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    node: str  # the built-in node, with its state: "h200x2+xid79-on-1"
    command: str
    expected: str

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
            node = marker.group(1) + (f"+xid79-on-{marker.group(2)}" if marker.group(2) else "")
            assert lines[number + 1].startswith("```"), f"{doc}:{number + 2}: no fence"
            end = next(i for i in range(number + 2, len(lines)) if lines[i].startswith("```"))
            at = number + 2
            while at < end:
                assert lines[at].startswith("$ "), f"{doc}:{at + 1}: expected a $ command"
                start, command = at + 1, lines[at][2:]
                at += 1
                output = []
                while at < end and not lines[at].startswith("$ "):
                    output.append(lines[at])
                    at += 1
                found.append(Example(doc, start, node, command, "\n".join(output)))
    return found


EXAMPLES = examples()


class Agents:
    """One agent per node (and state) the examples name, started when first asked for."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.agents: dict[str, Agent] = {}
        self._stack: list[object] = []

    def __getitem__(self, node: str) -> Agent:
        if node not in self.agents:
            name, _, state = node.partition("+")
            base = self.base / node.replace("+", "-")
            base.mkdir()
            node_file = NodeFile(base / "node.json", name, timing=False)
            context = start_agent(base, node_file, extra=["--cdi-spec-dir", str(base / "cdi")])
            agent = context.__enter__()
            self._stack.append(context)
            self.agents[node] = agent
            if state:
                gpu = int(state.removeprefix("xid79-on-"))
                node_file.event(gpu, "xid", 79)
                wait_until(
                    lambda: b'"Healthy":false' in agent.get("/gpu/health/json")[1],
                    what=f"GPU {gpu} unhealthy",
                )
        return self.agents[node]

    def close(self) -> None:
        for context in reversed(self._stack):
            context.__exit__(None, None, None)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    started = Agents(tmp_path_factory.mktemp("api-examples"))
    try:
        yield started
    finally:
        started.close()


def test_the_docs_mark_their_api_examples_to_run() -> None:
    assert len(EXAMPLES) >= 12
    assert {e.doc for e in EXAMPLES} == set(DOCS)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_api_example_prints_what_the_doc_shows(example: Example, agents: Agents) -> None:
    agent = agents[example.node]
    command = example.command.replace("localhost:3476", f"127.0.0.1:{agent.port}")
    done = subprocess.run(
        ["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60,
        check=False,
    )  # fmt: skip
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output
    assert matches(example.expected, output), f"$ {example.command}\n--- printed:\n{output}"
