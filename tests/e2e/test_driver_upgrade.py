"""A driver upgrade under load, end to end: the real daemon, a real dockerd, real volumes.

The node is simulated (``--simulate FILE``) over a fake driver root with two drivers: the
linker cache first names 580.159.04's files. The upgrade is what a package manager and an
operator do: the new driver's files are installed (the linker cache and binaries replaced,
each renamed into place), then the new kernel module is loaded (the node file renamed with
the new ``driver_version``). Meanwhile 16 clients ask ``/gpu/status/json`` on new
connections and a loop starts containers with the volume ``/docker/cli`` names; a container
created before the upgrade, with a restart policy, is restarted after it.

The plugin is registered with dockerd under a name of its own (a spec file
``/etc/docker/plugins/nvd-upgrade-<random>.spec``), so this module needs no lock on the
shared ``nvidia-docker`` name.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.dockerd import DockerEngine
from tests.support.fake_driver import (
    NEW_VERSION,
    VERSION,
    FakeDriver,
    build_fake_driver,
    install_driver,
    remove_fake_driver,
)
from tests.support.node_life import Agent, ContainerLoop, NodeFile, StatusLoad, start_agent
from tests.support.services import wait_until

pytestmark = pytest.mark.e2e

PICK_UP_LIMIT_S = 5.0
UPGRADE_ANSWER = b"driver upgrade in progress\n"  # the documented 503 (docs/api.md)
IMAGE = "nvd-test/busybox-upgrade:1"
# The restart-policy container: each start writes what its driver volume holds, then waits
# until the test lets this start end (a file named after that driver), and exits 1.
RESTARTING = (
    "v=$(readlink /usr/local/nvidia/lib64/libnvidia-ml.so.1); "
    's=$(/usr/local/nvidia/bin/nvidia-smi); echo "$v|$s" >> /out/log; '
    "while [ ! -e /out/exit-$v ]; do sleep 0.1; done; exit 1"
)


@dataclass
class Upgrade:
    old: FakeDriver
    new: FakeDriver
    node: NodeFile
    agent: Agent
    engine: DockerEngine
    plugin: str  # the name dockerd knows the plugin by


@pytest.fixture
def upgrade(tmp_path: Path, docker_engine: DockerEngine) -> Iterator[Upgrade]:
    old, new = build_fake_driver(), build_fake_driver(version=NEW_VERSION)
    plugin = f"nvd-upgrade-{secrets.token_hex(3)}"
    spec = docker_engine.plugin_specs / f"{plugin}.spec"
    node = NodeFile(tmp_path / "node.json", "h200")
    assert node.driver_version == VERSION
    try:
        with start_agent(
            tmp_path, node, ldcache=old.ldcache, search_path=old.search_path, spec_file=spec
        ) as agent:
            docker_engine.import_busybox(IMAGE)
            yield Upgrade(old, new, node, agent, docker_engine, plugin)
            listed = docker_engine.docker("ps", "-aq", "--filter", "label=nvd-upgrade")
            for container in listed.stdout.split():
                docker_engine.docker("rm", "-f", container, check=False)
            names = docker_engine.docker(
                "volume", "ls", "-q", "--filter", f"driver={plugin}", check=False
            ).stdout.split()
            if names:
                docker_engine.docker("volume", "rm", "-f", *names, check=False)
        assert "Traceback" not in agent.log()
    finally:
        spec.unlink(missing_ok=True)
        remove_fake_driver(old)
        remove_fake_driver(new)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_an_upgrade_under_load(upgrade: Upgrade, tmp_path: Path) -> None:
    agent, engine = upgrade.agent, upgrade.engine
    old_volume = f"nvidia_driver_{VERSION}"
    out = tmp_path / "out"
    out.mkdir()
    engine.docker(
        "run", "-d", "--label", "nvd-upgrade", "--restart=always",
        f"--volume-driver={upgrade.plugin}", "-v", f"{old_volume}:/usr/local/nvidia:ro",
        "-v", f"{out}:/out", IMAGE, "sh", "-c", RESTARTING,
    )  # fmt: skip
    wait_until(lambda: len(lines(out / "log")) == 1, what="the container's first start")
    assert lines(out / "log") == [f"libnvidia-ml.so.{VERSION}|nvidia-smi (fake) driver {VERSION}"]

    load = StatusLoad(agent.port, clients=16).start()
    containers = ContainerLoop(engine, agent, IMAGE, upgrade.plugin).start()
    try:
        wait_until(lambda: len(containers.runs) >= 1, what="a container before the upgrade")
        installed_at = time.monotonic()
        install_driver(upgrade.old, upgrade.new)  # the package manager's part
        wait_until(
            lambda: agent.get("/gpu/status/json")[0] == 503, what="the release", timeout_s=10
        )
        released_at = time.monotonic()
        assert agent.get("/gpu/info/json")[0] == 200  # the last facts, meanwhile
        runs_released = len(containers.runs)
        wait_until(lambda: len(containers.runs) > runs_released, what="a start while released")
        loaded_at = time.monotonic()
        upgrade.node.load_driver(NEW_VERSION)  # the new kernel module
        wait_until(lambda: agent.driver_version() == NEW_VERSION, what="pick-up", timeout_s=10)
        picked_up_at = time.monotonic()
        runs_picked_up = len(containers.runs)
        wait_until(lambda: len(containers.runs) > runs_picked_up + 1, what="starts after")
    finally:
        outcomes = load.stop()
        runs = containers.stop()

    assert picked_up_at - loaded_at < PICK_UP_LIMIT_S, picked_up_at - loaded_at
    # 16 clients: never a refused connection, never a 5xx but the documented 503 window.
    assert [o for o in outcomes if o.status is None] == []
    unexpected = [
        o for o in outcomes if o.status != 200 and (o.status, o.body) != (503, UPGRADE_ANSWER)
    ]
    assert unexpected == []
    window = [o.started_s for o in outcomes if o.status == 503]
    assert window, "no request saw the release"
    assert installed_at <= min(window)
    assert max(window) <= picked_up_at
    assert released_at <= picked_up_at
    # Every container started, before, during and after.
    assert [r for r in runs if r.returncode != 0] == []
    before = [r for r in runs if r.started_s < installed_at]
    after = [r for r in runs if r.started_s > picked_up_at]
    assert {r.output for r in before} == {f"libnvidia-ml.so.{VERSION}"}
    assert {r.volume.split(":")[0] for r in after} == {f"nvidia_driver_{NEW_VERSION}"}
    assert {r.output for r in after} == {f"libnvidia-ml.so.{NEW_VERSION}"}

    # The container created before the upgrade restarts and sees the new driver's files.
    (out / f"exit-libnvidia-ml.so.{VERSION}").touch()
    wait_until(lambda: len(lines(out / "log")) == 2, what="the restart after the upgrade")
    assert lines(out / "log")[1] == (
        f"libnvidia-ml.so.{NEW_VERSION}|nvidia-smi (fake) driver {NEW_VERSION}"
    )
    listed = engine.docker("volume", "ls", "-q", "--filter", f"driver={upgrade.plugin}").stdout
    assert old_volume in listed.split()  # until removed
    log = agent.log()
    assert log.count(f"Mount of {old_volume}: driver {VERSION} is not the one loaded") == 1
    assert f"The installed NVIDIA driver changed ({VERSION} -> {NEW_VERSION})" in log
    assert f"Driver {NEW_VERSION} picked up (was {VERSION})" in log
    assert "status answers 503 until the new kernel module is loaded" in log
