"""A CDI spec directory that others can write to, against the real daemon (root).

Whoever can write to ``--cdi-spec-dir`` may plant links, FIFOs, directories, devices or huge
files at the names the agent uses. The agent must never write through a link (it would
overwrite and expose any file as root), never block or run out of memory on what it finds,
keep rewriting the spec when the node changes, and try again after a failure (a full disk)
with backoff and at SIGHUP. Each test runs a real agent on the simulated ``h200x2-mig``
node, its spec directory private; the ones about size and blocking run it under a 256 MB
memory cgroup (docs/cdi.md, "What the agent does with its spec directory").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cdi_node import NODE, SPEC_NAME, make_dev_root
from tests.support.fake_driver import FakeDriver
from tests.support.memory_cgroup import MemoryCgroup, memory_cgroup
from tests.support.node_life import Agent, NodeFile, start_agent
from tests.support.prerequisites import require_root
from tests.support.services import mounted_tmpfs, wait_until

pytestmark = pytest.mark.e2e

LIMIT = 256 * 1024 * 1024
VICTIM_TEXT = "root:$6$secret-hash:19000:0:99999:7:::\n"


@contextlib.contextmanager
def cdi_agent(
    base: Path, driver: FakeDriver, *, group: MemoryCgroup | None = None
) -> Iterator[tuple[Agent, NodeFile]]:
    make_dev_root(base / "devroot")
    node = NodeFile(base / "node.json", NODE, timing=False)
    with start_agent(
        base,
        node,
        ldcache=driver.ldcache,
        search_path=driver.search_path,
        extra=["--cdi-spec-dir", str(base / "cdi"), "--cdi-dev-root", str(base / "devroot")],
        preexec=group.enter if group is not None else None,
    ) as agent:
        yield agent, node


def spec_of(base: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((base / "cdi" / SPEC_NAME).read_text())
    return document


def gpu1_in_all(base: Path) -> bool:
    path = base / "cdi" / SPEC_NAME
    if not stat.S_ISREG(path.lstat().st_mode):
        return True
    devices = json.loads(path.read_text())["devices"]
    (everything,) = [d for d in devices if d["name"] == "all"]
    return "/dev/nvidia1" in [n["path"] for n in everything["containerEdits"]["deviceNodes"]]


def make_gpu1_unhealthy(agent: Agent, node: NodeFile, base: Path) -> None:
    """An XID 79 on GPU 1: the agent must rewrite the spec without GPU 1 in ``all``."""
    node.event(1, "xid", 79)
    wait_until(lambda: not gpu1_in_all(base), what="GPU 1 out of the spec's 'all'", timeout_s=60)


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "shadow"
    path.write_text(VICTIM_TEXT)
    path.chmod(0o600)
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == VICTIM_TEXT
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def agent_pids(agent: Agent) -> list[int]:
    """The daemon and its children (the GPU worker): the pids an attacker would guess."""
    children = Path(f"/proc/{agent.proc.pid}/task/{agent.proc.pid}/children").read_text().split()
    return [agent.proc.pid, *map(int, children)]


def test_links_planted_at_temporary_names_are_never_written_through(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    require_root()
    shadow = victim(tmp_path)
    with cdi_agent(tmp_path, fake_driver) as (agent, node):
        spec_dir = tmp_path / "cdi"
        planted = []
        for pid in agent_pids(agent):  # the names a writer using its pid would take
            for name in (f".{SPEC_NAME}.{pid}.tmp", f"{SPEC_NAME}.{pid}.tmp", f".{SPEC_NAME}.tmp"):
                link = spec_dir / name
                if not link.exists():
                    link.symlink_to(shadow)
                    planted.append(link)
        make_gpu1_unhealthy(agent, node, tmp_path)
        assert_untouched(shadow)
        assert all(link.is_symlink() for link in planted)
        spec = spec_dir / SPEC_NAME
        assert stat.S_ISREG(spec.lstat().st_mode)
        assert stat.S_IMODE(spec.stat().st_mode) == 0o644
        assert agent.get("/cdi/spec")[1] == spec.read_bytes()


def test_a_link_at_the_specs_own_name_is_replaced_not_followed(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    require_root()
    shadow = victim(tmp_path)
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / SPEC_NAME).symlink_to(shadow)
    with cdi_agent(tmp_path, fake_driver) as (agent, _node):
        spec = tmp_path / "cdi" / SPEC_NAME
        assert stat.S_ISREG(spec.lstat().st_mode)
        assert_untouched(shadow)
        assert "symbolic link, not a regular file; replacing it" in agent.log()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse-20-GB", "char-device"])
def test_whatever_is_at_the_specs_name_at_start_neither_blocks_nor_exhausts_the_agent(
    tmp_path: Path, fake_driver: FakeDriver, kind: str
) -> None:
    require_root()
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    spec = spec_dir / SPEC_NAME
    if kind == "fifo":
        os.mkfifo(spec)
    elif kind == "dev-zero":
        spec.symlink_to("/dev/zero")
    elif kind == "char-device":
        os.mknod(spec, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # another /dev/zero
    else:
        with spec.open("wb") as out:
            out.truncate(20 * 1000**3)
    with memory_cgroup(LIMIT) as group:
        with cdi_agent(tmp_path, fake_driver, group=group) as (agent, node):
            assert "Ready" in agent.log()
            assert stat.S_ISREG(spec.lstat().st_mode)
            assert spec.stat().st_size < 1024 * 1024
            assert spec_of(tmp_path)["kind"] == "nvidia.com/gpu"
            make_gpu1_unhealthy(agent, node, tmp_path)  # and it keeps following the node
            assert agent.proc.poll() is None
        assert group.oom_kills == 0, f"killed for memory under {group.layout}"
    assert "Traceback" not in agent.log()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_what_is_planted_at_the_old_temporary_name_does_not_stop_rewrites(
    tmp_path: Path, fake_driver: FakeDriver, kind: str
) -> None:
    require_root()
    with cdi_agent(tmp_path, fake_driver) as (agent, node):
        for pid in agent_pids(agent):
            planted = tmp_path / "cdi" / f".{SPEC_NAME}.{pid}.tmp"
            if kind == "fifo":
                os.mkfifo(planted)
            else:
                planted.mkdir()
        make_gpu1_unhealthy(agent, node, tmp_path)  # the unhealthy GPU leaves 'all'
        assert "not written" not in agent.log()


def test_a_directory_in_the_way_is_one_line_and_retried_until_it_is_gone(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    require_root()
    spec = tmp_path / "cdi" / SPEC_NAME
    spec.mkdir(parents=True)
    with cdi_agent(tmp_path, fake_driver) as (agent, _node):
        assert "Ready" in agent.log()
        lines = [line for line in agent.log().splitlines() if "not written" in line]
        assert lines, agent.log()
        assert "a directory is in the way" in lines[0]
        assert "trying again in 1 s" in lines[0]
        assert agent.get("/gpu/info/json")[0] == 200  # serving meanwhile
        spec.rmdir()
        wait_until(spec.is_file, what="the spec, once the directory is gone")
        wait_until(lambda: "written again after the failure" in agent.log(), what="log line")
    assert "Traceback" not in agent.log()


def tiny_file_system(path: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    return mounted_tmpfs(path, f"size={size}")


def fill(directory: Path) -> Path:
    """A file that takes every free block of ``directory``'s file system."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as out:
        while True:
            out.write(b"\0" * 4096)
            out.flush()
    return filler


def test_a_full_disk_is_retried_and_a_sighup_writes_at_once(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    require_root()
    with (
        tiny_file_system(tmp_path / "cdi", "2m") as spec_dir,
        cdi_agent(tmp_path, fake_driver) as (agent, node),
    ):
        spec = spec_dir / SPEC_NAME
        before = spec.read_bytes()
        filler = fill(spec_dir)
        node.event(1, "xid", 79)
        wait_until(lambda: "No space left on device" in agent.log(), what="the failed rewrite")
        assert spec.read_bytes() == before  # the old spec stays whole
        assert [p.name for p in spec_dir.iterdir() if p.name.endswith(".tmp")] == []
        wait_until(  # tried again, with backoff
            lambda: agent.log().count("No space left on device") >= 2, what="a retry"
        )
        agent.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "Reload: CDI spec failed" in agent.log(), what="the reload's one line")
        filler.unlink()
        agent.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: not gpu1_in_all(tmp_path), what="the spec written after SIGHUP")
        failed_lines = [line for line in agent.log().splitlines() if "not written" in line]
        assert all("trying again in" in line for line in failed_lines)
    assert "Traceback" not in agent.log()
