"""Hostile node files against the real daemon (``--simulate FILE``): other kinds of file
than a regular one, huge files, deep nesting, bytes that are not UTF-8.

Every agent here runs (daemon and GPU worker) in a memory cgroup of 256 MB, and every test
ends with no process of it killed for memory. At start a hostile file stops the agent at
once with one line; while the agent runs, a hostile version renamed into place is one log
line, the node is served as the file said before, and the next good version is taken (its
events delivered). SIGTERM stops the agent whatever the file is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.errors import EXIT_STARTUP_FAILED
from agent.gpu import nodefile
from tests.support.memory_cgroup import MemoryCgroup, memory_cgroup
from tests.support.node_life import Agent as LifeAgent
from tests.support.node_life import NodeFile, start_agent
from tests.support.prerequisites import require_root
from tests.support.services import free_port, stop_process, wait_until

pytestmark = pytest.mark.e2e

MEMORY_LIMIT = 256 * 1024 * 1024
DEEP = 100_000  # levels: Python's JSON parser recurses once a level, to about 1,000
WITHIN_S = 20.0  # a deadline for what takes about a second, on a loaded 2-core machine
BUILTIN = "h200"


# -- the hostile files ------------------------------------------------------------------------


def _node_bytes(comment: bytes = b'"a test node"', data: dict[str, Any] | None = None) -> bytes:
    """A node file (``data``, else the built-in node) as one line of JSON, with ``comment``
    as the raw bytes of its ``comment`` value."""
    if data is None:
        data = json.loads(nodefile.resolve(BUILTIN).read_text(encoding="utf-8"))
    text = json.dumps({k: v for k, v in data.items() if k != "comment"}).encode()
    return b'{"comment": ' + comment + b", " + text[1:]


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # no writer: a blocking open waits forever


def _directory(path: Path) -> None:
    path.mkdir()


def _dev_zero_link(path: Path) -> None:
    os.symlink("/dev/zero", path)  # endless zeros


def _character_device(path: Path) -> None:
    require_root()  # mknod
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # a /dev/zero of its own


def _sparse(path: Path) -> None:
    with path.open("wb") as out:
        out.truncate(20 * 1000**3)  # 20 GB of holes: no disk, all size


def _large(path: Path) -> None:
    """A valid node file of 200 MiB: its comment is one long string."""
    filler = 200 * 1024 * 1024
    with path.open("wb") as out:
        out.write(b'{"comment": "')
        chunk = b"x" * (1 << 20)
        for _ in range(filler // len(chunk)):
            out.write(chunk)
        out.write(b'", ' + _node_bytes()[1:])


def _deep_arrays(path: Path) -> None:
    path.write_bytes(b"[" * DEEP + b"]" * DEEP)


def _deep_objects(path: Path) -> None:
    path.write_bytes(b'{"a":' * DEEP + b"0" + b"}" * DEEP)


def _not_utf8(path: Path) -> None:
    path.write_bytes(_node_bytes(b'"caf\xe9 au lait"'))  # Latin-1, not UTF-8


def _long_number(path: Path) -> None:
    path.write_bytes(_node_bytes(b"9" * 5000))  # Python refuses ints of more than 4,300 digits


@dataclass(frozen=True)
class Hostile:
    name: str
    make: Callable[[Path], None]  # makes the thing at a path where nothing is
    says: str  # a pattern for what the one line says after "node file <path>"


HOSTILE = (
    Hostile("fifo", _fifo, r" is a FIFO, not a regular file"),
    Hostile("directory", _directory, r" is a directory, not a regular file"),
    Hostile("dev-zero-link", _dev_zero_link, r" is a character device, not a regular file"),
    Hostile("character-device", _character_device, r" is a character device, not a regular file"),
    Hostile("sparse-20-GB", _sparse, r" is 20\.0 GB, more than the 1\.0 MiB it may be"),
    Hostile("regular-200-MiB", _large, r" is 200\.0 MiB, more than the 1\.0 MiB it may be"),
    Hostile("deep-arrays", _deep_arrays, r": nested deeper than 32 levels"),
    Hostile("deep-objects", _deep_objects, r": nested deeper than 32 levels"),
    Hostile("not-utf-8", _not_utf8, r": not UTF-8 \(byte \d+\)"),
    Hostile("long-number", _long_number, r": not JSON \(a number of more than \d+ digits\)"),
)


def place(hostile: Hostile, path: Path) -> None:
    """Rename ``hostile`` into place at ``path``, as the contract says a new version comes
    (a directory cannot replace a file: the file is removed first)."""
    staged = path.with_name(f".{path.name}.hostile")
    hostile.make(staged)
    if staged.is_dir() and not staged.is_symlink():
        path.unlink(missing_ok=True)
        os.rename(staged, path)
    else:
        os.replace(staged, path)


def make_room(path: Path) -> None:
    """Remove a directory at ``path``, so that the next good version can be renamed there."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()


# -- the agent in its cgroup ------------------------------------------------------------------


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get_json(self, route: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{route}", timeout=10) as resp:
            assert resp.status == 200
            return json.loads(resp.read())


@contextlib.contextmanager
def cgroup() -> Iterator[MemoryCgroup]:
    """The 256 MB memory cgroup the agent runs in. Whatever is still in it at the end (a GPU
    worker that outlived a killed daemon) is killed, so that nothing is left behind."""
    with memory_cgroup(MEMORY_LIMIT) as group:
        try:
            yield group
        finally:
            for pid in group.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not group.processes(), what="the cgroup empty", timeout_s=10)


def spawn(base: Path, node_path: Path, group: MemoryCgroup) -> Agent:
    """``python -m agent.daemon`` as ``tests.support.agent_process.launch_agent`` starts it,
    moved into ``group`` before exec (the GPU worker it starts is then in it too)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("NV_DEBUG", None)
    command = [
        sys.executable, "-m", "agent.daemon",
        "-l", f"127.0.0.1:{port}",
        "-s", str(base / "plugins"),
        "-d", str(base / "volumes"),
        "--simulate", str(node_path),
    ]  # fmt: skip
    log_path = base / "agent.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=group.enter,  # noqa: PLW1509 - writes one file, then exec
        )
    return Agent(proc, port, log_path)


@contextlib.contextmanager
def running(base: Path, node: NodeFile, group: MemoryCgroup) -> Iterator[LifeAgent]:
    """A ready agent serving ``node`` in ``group`` (``tests.support.node_life``); stopped
    afterwards."""
    with start_agent(base, node, preexec=group.enter) as agent:
        yield agent


def temperature(agent: LifeAgent) -> int:
    return int(agent.get_json("/gpu/status/json")["Devices"][0]["Temperature"])


def healthy(agent: LifeAgent) -> bool:
    return bool(agent.get_json("/gpu/health/json")["Devices"][0]["Healthy"])


def stop_with_sigterm(agent: Agent | LifeAgent) -> int:
    """SIGTERM, and the exit code: it must come within WITHIN_S."""
    agent.proc.send_signal(signal.SIGTERM)
    return agent.proc.wait(timeout=WITHIN_S)


def lines_naming(log: str, path: Path) -> list[str]:
    return [line for line in log.splitlines() if f"node file {path}" in line]


def _said(agent: Agent | LifeAgent, pattern: re.Pattern[str]) -> bool:
    return pattern.search(agent.log()) is not None


# -- at start ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.name for h in HOSTILE])
def test_at_start_a_hostile_node_file_stops_the_agent_with_one_line(
    tmp_path: Path, hostile: Hostile
) -> None:
    path = tmp_path / "node.json"
    place(hostile, path)
    with cgroup() as group:
        agent = spawn(tmp_path, path, group)
        try:
            code = agent.proc.wait(timeout=WITHIN_S)
        finally:
            stop_process(agent.proc)
        assert group.oom_kills == 0
    log = agent.log()
    assert code == EXIT_STARTUP_FAILED, log
    assert "Traceback" not in log
    (line,) = lines_naming(log, path)
    assert re.search(r"Error: node file " + re.escape(str(path)) + hostile.says + "$", line), line


# -- while running ----------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> NodeFile:
    """The built-in node at ``node.json``, GPU 0 at 41 °C (to tell its versions apart)."""
    file = NodeFile(tmp_path / "node.json", BUILTIN, timing=False)
    file.data["devices"][0]["status"]["temperature_c"] = 41
    file.write()
    return file


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.name for h in HOSTILE])
def test_while_running_a_hostile_version_is_one_line_and_the_next_good_one_is_taken(
    tmp_path: Path, node: NodeFile, hostile: Hostile
) -> None:
    kept = re.compile(
        r"GPU worker: node file "
        + re.escape(str(node.path))
        + hostile.says
        + r": keeping what the file said before$",
        re.MULTILINE,
    )
    with cgroup() as group:
        with running(tmp_path, node, group) as agent:
            assert temperature(agent) == 41
            place(hostile, node.path)
            wait_until(
                functools.partial(_said, agent, kept),
                what="the line about the hostile version",
                timeout_s=WITHIN_S,
                proc=agent.proc,
            )
            # Served as the file said before, and answering.
            assert temperature(agent) == 41
            assert healthy(agent)

            node.data["devices"][0]["status"]["temperature_c"] = 42
            make_room(node.path)
            node.event(0, "double_bit_ecc")
            wait_until(
                lambda: not healthy(agent),
                what="the event of the next good version delivered",
                timeout_s=WITHIN_S,
                proc=agent.proc,
            )
            assert temperature(agent) == 42
            assert stop_with_sigterm(agent) == 0
        assert group.oom_kills == 0
    log = agent.log()
    assert "Traceback" not in log
    assert len(lines_naming(log, node.path)) == 1, lines_naming(log, node.path)
    assert "Stopped" in log


# -- SIGTERM ----------------------------------------------------------------------------------


def test_sigterm_stops_the_agent_while_its_node_file_is_a_fifo(
    tmp_path: Path, node: NodeFile
) -> None:
    """The daemon's driver watch and the worker's event watch both look at the FIFO (the
    SIGHUP makes the daemon look at once); neither may block, so SIGTERM ends the agent."""
    fifo = HOSTILE[0]
    assert fifo.name == "fifo"
    kept = re.compile(re.escape(f"node file {node.path}") + fifo.says + ": keeping")
    with cgroup() as group:
        with running(tmp_path, node, group) as agent:
            place(fifo, node.path)
            wait_until(
                functools.partial(_said, agent, kept),
                what="the worker's line about the FIFO",
                timeout_s=WITHIN_S,
                proc=agent.proc,
            )
            agent.proc.send_signal(signal.SIGHUP)
            wait_until(
                lambda: "Reload: driver 580.159.04, unchanged" in agent.log(),
                what="the daemon's look at the FIFO (SIGHUP)",
                timeout_s=WITHIN_S,
                proc=agent.proc,
            )
            assert stop_with_sigterm(agent) == 0
        assert group.oom_kills == 0
    assert agent.log().rstrip().endswith("Stopped")


# -- the costliest files within the bounds ----------------------------------------------------


def _empty_objects(size: int) -> bytes:
    count = (size - 2) // 3
    return b"[" + b",".join([b"{}"] * count) + b"]"


def _short_strings(size: int) -> bytes:
    count = (size - 2) // 7
    return b"[" + b",".join(b'"%04x"' % (n % 65536) for n in range(count)) + b"]"


@pytest.mark.parametrize(
    "filler", [_empty_objects, _short_strings], ids=["empty-objects", "short-strings"]
)
def test_the_costliest_node_file_within_the_bounds_fits_in_256_mb(
    tmp_path: Path, node: NodeFile, filler: Callable[[int], bytes]
) -> None:
    """Valid node files just under the size bound whose comment is what costs Python the
    most memory per byte (about 25 times its size), each parsed by the worker (its event
    is delivered) and by the daemon (SIGHUP: it looks at once), one after the other."""
    room = nodefile.MAX_BYTES - len(_node_bytes(data=node.data)) - 200
    comment = filler(room)
    with cgroup() as group:
        with running(tmp_path, node, group) as agent:
            for number in range(1, 4):
                node.data["events"].append({"id": f"c{number}", "gpu": 0, "kind": "xid", "xid": 13})
                costly = _node_bytes(comment, node.data)
                assert nodefile.MAX_BYTES - 300 < len(costly) <= nodefile.MAX_BYTES
                staged = node.path.with_name(".costly")
                staged.write_bytes(costly)
                os.replace(staged, node.path)
                wait_until(
                    functools.partial(_counted, agent, "XID 13 (", number),
                    what=f"the event of costly version {number}",
                    timeout_s=WITHIN_S,
                    proc=agent.proc,
                )
                agent.proc.send_signal(signal.SIGHUP)
                wait_until(
                    functools.partial(_counted, agent, "Reload: driver", number),
                    what=f"the daemon's look at costly version {number}",
                    timeout_s=WITHIN_S,
                    proc=agent.proc,
                )
            assert temperature(agent) == 41
            assert stop_with_sigterm(agent) == 0
        assert group.oom_kills == 0
        peak = group.peak_bytes
    assert "Traceback" not in agent.log()
    assert peak is None or peak < MEMORY_LIMIT


def _counted(agent: Agent | LifeAgent, text: str, count: int) -> bool:
    return agent.log().count(text) >= count
