"""The CDI spec on disk: written atomically, rewritten on node changes, served on /cdi/spec."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from agent.api.routes import create_app
from agent.cdi_spec import writer as cdi_writer
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter, volume_builder
from agent.gpu import nodefile
from agent.gpu.model import NodeInfo
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from cdi.spec import LinkerCacheHook
from plugin.discovery import find_driver_files
from plugin.volumes import VolumeError, VolumeStore
from tests.support.cdi_schema import schema_errors
from tests.support.fake_driver import FakeDriver
from tests.unit.agent.conftest import CONTROL, CountingBackend

if TYPE_CHECKING:
    from tests.unit.agent.conftest import AiohttpClient

HOOK = LinkerCacheHook("/opt/nvd/bin/nvidia-docker-cdi-hook", "/sbin/ldconfig")
NODE = nodefile.load("h200x2").info


class Volumes:
    """Stands in for the plugin's store: a directory per driver version, and the calls."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: list[str] = []
        self.broken: set[str] = set()

    def __call__(self, version: str) -> Path:
        if version in self.broken:
            raise OSError(28, "No space left on device")
        self.built.append(version)
        path = self.root / "nvidia_driver" / version
        path.mkdir(parents=True, exist_ok=True)
        return path


@pytest.fixture
def volumes(tmp_path: Path) -> Volumes:
    return Volumes(tmp_path / "volumes")


def make_writer(
    tmp_path: Path, volumes: Volumes, unhealthy: set[int] | None = None
) -> CdiSpecWriter:
    sick = unhealthy if unhealthy is not None else set()
    return CdiSpecWriter(
        CdiSettings(tmp_path / "cdi", hook=HOOK),
        volumes,
        unhealthy=lambda _facts: frozenset(sick),
    )


def facts(node: NodeInfo = NODE) -> NodeFacts:
    return NodeFacts(node, CONTROL)


def spec_on_disk(writer: CdiSpecWriter) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(writer.path.read_text())
    return document


def device(document: dict[str, Any], name: str) -> list[str]:
    (found,) = [d for d in document["devices"] if d["name"] == name]
    return [node["path"] for node in found["containerEdits"]["deviceNodes"]]


async def test_the_spec_is_written_mode_0644_and_valid(tmp_path: Path, volumes: Volumes) -> None:
    writer = make_writer(tmp_path, volumes)
    os.umask(0o077)  # a strict umask must not make the spec unreadable to engines
    try:
        assert await writer.write(facts())
    finally:
        os.umask(0o022)
    assert writer.path == tmp_path / "cdi" / "nvidia-docker.json"
    assert stat.S_IMODE(writer.path.stat().st_mode) == 0o644
    doc = spec_on_disk(writer)
    assert schema_errors(doc) == []
    assert doc["cdiVersion"] == "0.5.0"
    uuids = [d.uuid for d in NODE.devices]
    assert [d["name"] for d in doc["devices"]] == ["0", uuids[0], "1", uuids[1], "all"]
    assert device(doc, "all") == ["/dev/nvidia0", "/dev/nvidia1"]
    (mount,) = doc["containerEdits"]["mounts"]
    assert mount["hostPath"] == str(volumes.root / "nvidia_driver" / "580.159.04")
    assert doc["containerEdits"]["hooks"][0]["path"] == HOOK.program
    assert writer.current == writer.path.read_bytes()
    assert sorted(p.name for p in writer.path.parent.iterdir()) == ["nvidia-docker.json"]


async def test_a_driver_upgrade_rewrites_the_spec_with_the_new_volume(
    tmp_path: Path, volumes: Volumes
) -> None:
    writer = make_writer(tmp_path, volumes)
    state = NodeState(facts())
    await writer.write(state.facts)
    state.subscribe(writer.on_node_change)
    inode = writer.path.stat().st_ino

    state.replace(facts(dataclasses.replace(NODE, driver_version="580.200.01")))
    await writer.settled()

    (mount,) = spec_on_disk(writer)["containerEdits"]["mounts"]
    assert mount["hostPath"] == str(volumes.root / "nvidia_driver" / "580.200.01")
    assert volumes.built == ["580.159.04", "580.200.01"]
    assert writer.path.stat().st_ino != inode  # a new file renamed into place


async def test_a_gpu_turning_unhealthy_leaves_all(tmp_path: Path, volumes: Volumes) -> None:
    sick: set[int] = set()
    writer = make_writer(tmp_path, volumes, sick)
    state = NodeState(facts())
    await writer.write(state.facts)
    state.subscribe(writer.on_node_change)

    sick.add(1)
    state.replace(facts())
    await writer.settled()
    doc = spec_on_disk(writer)
    assert device(doc, "all") == ["/dev/nvidia0"]
    assert device(doc, "1") == ["/dev/nvidia1"]  # still there when named


async def test_mig_devices_are_in_the_spec(tmp_path: Path, volumes: Volumes) -> None:
    writer = make_writer(tmp_path, volumes)
    node = nodefile.load("h200x2-mig").info
    await writer.write(facts(node))
    doc = spec_on_disk(writer)
    migs = node.devices[0].mig_devices
    names = [d["name"] for d in doc["devices"]]
    assert names[: 2 + 2 * len(migs)] == [
        "0",
        node.devices[0].uuid,
        *(name for m in migs for name in (f"0:{m.index}", m.uuid)),
    ]
    assert device(doc, "0:1") == ["/dev/nvidia0", *migs[1].capabilities]
    assert device(doc, str(migs[3].uuid)) == ["/dev/nvidia0", *migs[3].capabilities]
    assert schema_errors(doc) == []


async def test_node_changes_during_a_rewrite_fold_into_one_more(
    tmp_path: Path, volumes: Volumes
) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_build(version: str) -> Path:
        started.set()
        assert release.wait(10)
        return volumes(version)

    writer = CdiSpecWriter(CdiSettings(tmp_path / "cdi", hook=HOOK), slow_build)
    state = NodeState(facts())
    state.subscribe(writer.on_node_change)
    state.replace(facts(dataclasses.replace(NODE, driver_version="1.0.1")))
    assert await asyncio.to_thread(started.wait, 10)  # the first rewrite is building
    for version in ("1.0.2", "1.0.3"):
        state.replace(facts(dataclasses.replace(NODE, driver_version=version)))
    release.set()
    await writer.settled()
    assert volumes.built == ["1.0.1", "1.0.3"]  # the middle one was never current
    (mount,) = spec_on_disk(writer)["containerEdits"]["mounts"]
    assert mount["hostPath"].endswith("/1.0.3")


async def test_the_same_spec_is_not_rewritten(tmp_path: Path, volumes: Volumes) -> None:
    writer = make_writer(tmp_path, volumes)
    await writer.write(facts())
    before = writer.path.stat()
    again = make_writer(tmp_path, volumes)  # a restarted agent finds its own spec
    assert await again.write(facts())
    after = writer.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert again.current == writer.path.read_bytes()


async def test_a_volume_that_cannot_be_built_keeps_the_previous_spec(
    tmp_path: Path, volumes: Volumes, caplog: pytest.LogCaptureFixture
) -> None:
    writer = make_writer(tmp_path, volumes)
    await writer.write(facts())
    before = writer.path.read_bytes()
    volumes.broken.add("999.1")
    with caplog.at_level(logging.ERROR):
        assert not await writer.write(facts(dataclasses.replace(NODE, driver_version="999.1")))
    assert writer.path.read_bytes() == before
    assert writer.current == before
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "the driver volume of driver 999.1 cannot be built" in record.getMessage()
    assert "No space left on device" in record.getMessage()


async def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(
    tmp_path: Path, volumes: Volumes, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = make_writer(tmp_path, volumes)
    await writer.write(facts())
    before = writer.path.read_bytes()

    def full_disk(fd: int, data: memoryview) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    assert not await writer.write(facts(dataclasses.replace(NODE, driver_version="580.200.01")))
    assert writer.path.read_bytes() == before
    assert sorted(p.name for p in writer.path.parent.iterdir()) == ["nvidia-docker.json"]


async def test_closing_leaves_the_spec_in_place(tmp_path: Path, volumes: Volumes) -> None:
    writer = make_writer(tmp_path, volumes)
    await writer.write(facts())
    await writer.close()
    assert writer.path.exists()


async def test_a_dev_root_gives_host_paths(tmp_path: Path, volumes: Volumes) -> None:
    root = tmp_path / "driver-root"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "nvidia-uvm-tools").touch()  # present under the dev root only
    writer = CdiSpecWriter(CdiSettings(tmp_path / "cdi", root, HOOK), volumes)
    await writer.write(facts())
    doc = spec_on_disk(writer)
    assert doc["containerEdits"]["deviceNodes"] == [
        {"path": p, "hostPath": f"{root}{p}"}
        for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
    ]
    (gpu0,) = [d for d in doc["devices"] if d["name"] == "0"]
    assert gpu0["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": f"{root}/dev/nvidia0"}
    ]


def test_the_daemons_volume_builder_builds_the_plugins_volume(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    files = find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )
    store = VolumeStore(tmp_path / "volumes", files)
    volume = volume_builder(store)(fake_driver.version)
    assert volume == store.get(f"nvidia_driver_{fake_driver.version}")
    assert (volume / "lib64" / "libcuda.so.1").exists()
    with pytest.raises(Exception, match="invalid volume version"):
        volume_builder(store)("470.57.02")  # the store builds the running driver's only


def test_docker_cannot_remove_the_volume_the_spec_mounts_by_path(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    # Docker counts only its own containers as users of a volume: a `docker volume rm` (or
    # `docker volume prune -a`) would delete the driver files under every container given
    # GPUs through the CDI spec. An upgrade's old volume stays removable.
    files = find_driver_files(
        fake_driver.version, ldcache=fake_driver.ldcache, search_path=str(fake_driver.bin)
    )
    store = VolumeStore(tmp_path / "volumes", files)
    volume = volume_builder(store)(fake_driver.version)
    name = f"nvidia_driver_{fake_driver.version}"
    with pytest.raises(VolumeError, match=f"in use by containers that mount it by path.*: {name}$"):
        store.remove(name)
    assert (volume / "lib64" / "libcuda.so.1").exists()
    store.use_files(dataclasses.replace(files, driver_version="590.48.01"))
    volume_builder(store)("590.48.01")
    store.remove(name)
    assert not volume.exists()


# --- the REST routes ------------------------------------------------------------------------


async def client_for(
    aiohttp_client: AiohttpClient, node_name: str, writer: CdiSpecWriter | None
) -> Any:
    backend = CountingBackend(node_name)
    status = StatusService(backend, backend.node_info(), pcie_interval_s=60)
    app: web.Application = create_app(
        NodeState(NodeFacts(backend.node_info(), CONTROL)), status, cdi=writer
    )
    app.on_cleanup.append(lambda _app: status.close())
    return await aiohttp_client(app)


@pytest.mark.parametrize("prefix", ["", "/v1.0"])
async def test_the_spec_is_served_as_written(
    aiohttp_client: AiohttpClient, tmp_path: Path, volumes: Volumes, prefix: str
) -> None:
    writer = make_writer(tmp_path, volumes)
    await writer.write(facts())
    client = await client_for(aiohttp_client, "h200x2", writer)
    resp = await client.get(f"{prefix}/cdi/spec")
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert await resp.read() == writer.path.read_bytes()


async def test_no_spec_is_404_and_an_unwritten_one_503(
    aiohttp_client: AiohttpClient, tmp_path: Path, volumes: Volumes
) -> None:
    resp = await (await client_for(aiohttp_client, "h200x2", None)).get("/cdi/spec")
    assert resp.status == 404
    assert await resp.text() == "no CDI spec: this agent runs without --cdi-spec-dir\n"
    unwritten = make_writer(tmp_path, volumes)
    resp = await (await client_for(aiohttp_client, "h200x2", unwritten)).get("/cdi/spec")
    assert resp.status == 503
    assert "could not be written: see the agent's log" in await resp.text()


async def test_docker_cli_in_cdi_form(
    aiohttp_client: AiohttpClient, tmp_path: Path, volumes: Volumes
) -> None:
    client = await client_for(aiohttp_client, "h200x2-mig", make_writer(tmp_path, volumes))
    node = nodefile.load("h200x2-mig").info
    gpu0, gpu1 = node.devices
    resp = await client.get("/docker/cli", params={"format": "cdi"})
    assert resp.status == 200
    assert await resp.text() == (
        f"--device=nvidia.com/gpu={gpu0.uuid} --device=nvidia.com/gpu={gpu1.uuid}\n"
    )
    resp = await client.get("/docker/cli", params={"format": "cdi", "dev": "0:2 1"})
    mig = gpu0.mig_devices[2]
    assert await resp.text() == (
        f"--device=nvidia.com/gpu={mig.uuid} --device=nvidia.com/gpu={gpu1.uuid}\n"
    )
    body = await (await client.get("/docker/cli/json", params={"format": "cdi", "dev": "1"})).json()
    assert body == {"Kind": "nvidia.com/gpu", "Devices": [f"nvidia.com/gpu={gpu1.uuid}"]}
    resp = await client.get("/docker/cli", params={"format": "cdi", "vol": "nvidia_foo"})
    assert resp.status == 400
    assert resp.headers["X-Invalid-Parameter"] == "vol"


async def test_the_cdi_form_needs_an_agent_that_writes_a_spec(
    aiohttp_client: AiohttpClient,
) -> None:
    client = await client_for(aiohttp_client, "h200x2", None)
    resp = await client.get("/docker/cli", params={"format": "cdi"})
    assert resp.status == 400
    assert resp.headers["X-Invalid-Parameter"] == "format"
    assert await resp.text() == (
        "invalid format: cdi (this agent writes no CDI spec: start it with --cdi-spec-dir DIR)\n"
    )
    resp = await client.get("/docker/cli", params={"format": "yaml"})
    assert (resp.status, await resp.text()) == (
        400,
        "invalid format: yaml (expected legacy or cdi)\n",
    )
    legacy = await client.get("/docker/cli", params={"format": "legacy"})
    assert await legacy.read() == await (await client.get("/docker/cli")).read()


def test_readers_find_a_spec_in_their_directory_or_linked_from_it(tmp_path: Path) -> None:
    scanned = (tmp_path / "etc-cdi", tmp_path / "run-cdi")
    for directory in scanned:
        directory.mkdir()
    inside = scanned[1] / "nvidia-docker.json"
    inside.write_text("{}")
    assert cdi_writer.readers_find(inside, scanned)
    own = tmp_path / "state" / "cdi" / "nvidia-docker.json"
    own.parent.mkdir(parents=True)
    own.write_text("{}")
    assert not cdi_writer.readers_find(own, scanned)
    (scanned[1] / "other.txt").symlink_to(own)  # readers load .json and .yaml only
    assert not cdi_writer.readers_find(own, scanned)
    (scanned[1] / "nvidia-docker.json").unlink()
    (scanned[1] / "nvidia-docker.json").symlink_to(own)
    assert cdi_writer.readers_find(own, scanned)


async def test_a_spec_no_reader_sees_is_warned_about(
    tmp_path: Path, volumes: Volumes, caplog: pytest.LogCaptureFixture
) -> None:
    writer = make_writer(tmp_path, volumes)  # under tmp_path: no reader scans it
    with caplog.at_level(logging.WARNING):
        await writer.write(facts())
        await writer.write(facts())
    lines = [r.getMessage() for r in caplog.records if "CDI readers" in r.getMessage()]
    assert len(lines) == 1  # once, not at every rewrite
    assert "link /var/run/cdi/nvidia-docker.json to it" in lines[0]


# --- hostile spec directories (docs/cdi.md, "What the agent does with the spec directory") ---


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse", "link"])
async def test_whatever_is_at_the_specs_name_is_replaced_without_being_read(
    tmp_path: Path, volumes: Volumes, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = make_writer(tmp_path, volumes)
    writer.path.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    if kind == "fifo":
        os.mkfifo(writer.path)  # reading it would block forever
    elif kind == "dev-zero":
        writer.path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "sparse":
        with writer.path.open("wb") as out:
            out.truncate(20 * 1000**3)  # reading it would take 20 GB
    else:
        writer.path.symlink_to(victim)
    with caplog.at_level(logging.WARNING):
        assert await asyncio.wait_for(writer.write(facts()), 30)
    assert stat.S_ISREG(writer.path.lstat().st_mode)
    assert schema_errors(spec_on_disk(writer)) == []
    assert victim.read_text() == "secret"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    (line,) = [r.getMessage() for r in caplog.records if "replacing it" in r.getMessage()]
    assert line.startswith(f"CDI spec {writer.path}: ")


async def test_a_failed_rewrite_is_tried_again_with_backoff_until_it_works(
    tmp_path: Path, volumes: Volumes, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CdiSpecWriter(
        CdiSettings(tmp_path / "cdi", hook=HOOK), volumes, retry_first_s=0.01, retry_max_s=0.05
    )
    (tmp_path / "cdi" / cdi_writer.SPEC_NAME).mkdir(parents=True)  # in the way
    with caplog.at_level(logging.ERROR):
        writer.start(facts())
        await writer.settled()
        assert writer.failure is not None
        assert "a directory is in the way" in writer.failure
        for _ in range(3):  # it keeps trying
            caplog.clear()
            await _until(lambda: bool(caplog.records))
    (record,) = caplog.records[:1]
    assert record.getMessage().startswith(f"CDI spec {writer.path} not written: ")
    assert "; trying again in " in record.getMessage()
    assert "\n" not in record.getMessage()
    writer.path.rmdir()
    await _until(writer.path.is_file)
    await writer.settled()
    assert writer.failure is None
    assert schema_errors(spec_on_disk(writer)) == []
    await writer.close()


async def test_a_reload_writes_at_once_even_while_a_retry_waits(
    tmp_path: Path, volumes: Volumes
) -> None:
    writer = CdiSpecWriter(CdiSettings(tmp_path / "cdi", hook=HOOK), volumes, retry_first_s=3600)
    volumes.broken.add(NODE.driver_version)  # ENOSPC while the volume is built
    writer.start(facts())
    await writer.settled()
    assert writer.failure is not None
    with pytest.raises(OSError, match="No space left on device"):
        await asyncio.wait_for(writer.reload(facts()), 10)
    volumes.broken.clear()  # space again: SIGHUP need not wait an hour
    await asyncio.wait_for(writer.reload(facts()), 10)
    assert writer.failure is None
    assert writer.path.is_file()
    writer.path.unlink()  # removed by hand: a SIGHUP puts it back
    await asyncio.wait_for(writer.reload(facts()), 10)
    assert writer.path.is_file()
    await writer.close()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within 10 s"
        await asyncio.sleep(0.01)
