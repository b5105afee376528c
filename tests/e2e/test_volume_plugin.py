"""The volume plugin of a real agent process, used by a real dockerd.

The agent runs ``--simulate h200`` over a fake 580.159.04 driver root (real ELF libraries,
a real ldconfig cache); dockerd finds it through /etc/docker/plugins/nvidia-docker.spec.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from tests.support.plugin_agent import PluginAgent

pytestmark = pytest.mark.e2e

ACCEPT = {"Accept": "application/vnd.docker.plugins.v1.2+json"}
IMAGE = "nvd-test/busybox-volume:1"


def tree(root: Path) -> list[tuple[str, int, int, int]]:
    """Everything under ``root``: path, mode, size, inode (to see any change on disk)."""
    found = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        found.append((str(path.relative_to(root)), st.st_mode, st.st_size, st.st_ino))
    return found


@pytest.fixture(scope="module")
def image(plugin_agent: PluginAgent) -> str:
    return plugin_agent.engine.import_busybox(IMAGE)


@pytest.fixture
def no_volume(plugin_agent: PluginAgent) -> Iterator[PluginAgent]:
    """Each test starts without the driver volume and leaves none behind."""
    plugin_agent.engine.docker("volume", "rm", "-f", plugin_agent.volume_name, check=False)
    yield plugin_agent
    plugin_agent.engine.docker("volume", "rm", "-f", plugin_agent.volume_name, check=False)


def test_the_agent_announces_its_socket_in_the_spec_file(plugin_agent: PluginAgent) -> None:
    assert plugin_agent.spec_file.read_text().strip() == f"unix://{plugin_agent.socket_path}"
    assert plugin_agent.socket_path.stat().st_mode & 0o777 == 0o660
    assert "Driver files found: driver 580.159.04: 2 binaries" in plugin_agent.log()


def test_docker_volume_create_ls_inspect_rm(no_volume: PluginAgent) -> None:
    agent, docker = no_volume, no_volume.engine.docker
    name = agent.volume_name
    assert docker("volume", "create", "-d", "nvidia-docker", name).stdout.strip() == name

    listed = docker("volume", "ls", "--format", "{{.Driver}} {{.Name}}").stdout.splitlines()
    assert f"nvidia-docker {name}" in listed
    (info,) = json.loads(docker("volume", "inspect", name).stdout)
    on_disk = agent.volume_dir / "nvidia_driver" / agent.driver.version
    assert info["Driver"] == "nvidia-docker"
    assert info["Mountpoint"] == str(on_disk)
    assert (on_disk / "lib64" / "libcuda.so.1").resolve().name == "libcuda.so.580.159.04"
    assert sorted(p.name for p in (on_disk / "bin").iterdir()) == [
        "nvidia-debugdump",
        "nvidia-smi",
    ]

    docker("volume", "rm", name)
    assert name not in docker("volume", "ls", "-q").stdout.split()
    assert not on_disk.exists()


def test_a_container_sees_the_driver_libraries_and_soname_links(
    no_volume: PluginAgent, image: str
) -> None:
    agent = no_volume
    volume = f"{agent.volume_name}:/usr/local/nvidia:ro"
    run = agent.engine.docker(
        "run", "--rm", "--volume-driver=nvidia-docker", "-v", volume, image,
        "ls", "-l", "/usr/local/nvidia/lib64",
    )  # fmt: skip
    listing = run.stdout
    entries = {line.split()[8] for line in listing.splitlines() if len(line.split()) >= 9}
    assert agent.driver.expected_lib64() <= entries, listing
    assert "libcuda.so.1 -> libcuda.so.580.159.04" in listing
    assert "libcuda.so -> libcuda.so.580.159.04" in listing
    assert "libGLX_indirect.so.0 -> libGLX_nvidia.so.580.159.04" in listing
    # The static fake nvidia-smi runs from the volume; the volume is read-only.
    smi = agent.engine.docker(
        "run", "--rm", "-v", volume, image, "/usr/local/nvidia/bin/nvidia-smi"
    )  # fmt: skip
    assert smi.stdout.strip() == "nvidia-smi (fake) driver 580.159.04"
    write = agent.engine.docker(
        "run", "--rm", "-v", volume, image, "sh", "-c", "echo x > /usr/local/nvidia/x",
        check=False,
    )  # fmt: skip
    assert write.returncode != 0
    assert "Read-only file system" in write.stderr


def test_concurrent_containers_share_one_volume(no_volume: PluginAgent, image: str) -> None:
    agent = no_volume
    volume = f"{agent.volume_name}:/usr/local/nvidia:ro"

    def start(_: int) -> str:
        return agent.engine.docker(
            "run", "--rm", "--volume-driver=nvidia-docker", "-v", volume, image,
            "readlink", "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
        ).stdout.strip()  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(start, range(4)))
    assert answers == ["libnvidia-ml.so.580.159.04"] * 4
    parent = agent.volume_dir / "nvidia_driver"
    assert [p.name for p in parent.iterdir()] == [agent.driver.version]


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("nvidia_driver_1.2.3", "invalid volume version: nvidia_driver_1.2.3"),
        ("nvidia_driver_..", "bad volume format: nvidia_driver_.."),
        ("cuda_12.0", "unsupported volume: cuda_12.0"),
    ],
)
def test_docker_volume_create_rejects_bad_names(
    no_volume: PluginAgent, name: str, error: str
) -> None:
    before = tree(no_volume.volume_dir)
    failed = no_volume.engine.docker("volume", "create", "-d", "nvidia-docker", name, check=False)
    assert failed.returncode != 0
    assert error in failed.stderr
    assert tree(no_volume.volume_dir) == before


async def _post(
    agent: PluginAgent, method: str, data: bytes, headers: dict[str, str]
) -> tuple[int, str, dict[str, str]]:
    connector = aiohttp.UnixConnector(path=str(agent.socket_path))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(f"http://plugin/{method}", data=data, headers=headers) as resp,
    ):
        return resp.status, resp.headers["Content-Type"], await resp.json(content_type=None)


@pytest.mark.parametrize(
    ("method", "body", "headers", "status", "err"),
    [
        ("VolumeDriver.Create", b"{not json", ACCEPT, 400, "bad request: the body is not valid"),
        ("VolumeDriver.Create", b"[1]", ACCEPT, 400, "bad request: the body must be a JSON"),
        ("VolumeDriver.Create", b'{"Name": "nvidia_driver_580.159.04"}', {}, 406, "Accept"),
        ("VolumeDriver.Remove", b'{"Name": "nvidia_driver_.."}', ACCEPT, 200, "bad volume format"),
        ("VolumeDriver.Remove", b'{"Name": "nvidia_driver_../.."}', ACCEPT, 200, "bad volume"),
        ("VolumeDriver.Create", b'{"Name": "nvidia_driver_/etc"}', ACCEPT, 200, "bad volume"),
        ("VolumeDriver.Mount", b'{"Name": "nvidia_driver_9.9", "ID": "x"}', ACCEPT, 200, "no such"),
        ("VolumeDriver.Create", b'{"Name": "nvidia_driver_9.9"}', ACCEPT, 200, "invalid volume"),
        ("VolumeDriver.Get", b'{"Name": "opencl_1.0"}', ACCEPT, 200, "unsupported volume"),
    ],
)
def test_bad_requests_on_the_socket_change_nothing(
    plugin_agent: PluginAgent,
    method: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    err: str,
) -> None:
    before = tree(plugin_agent.volume_dir)
    got_status, content_type, answer = asyncio.run(_post(plugin_agent, method, body, headers))
    assert (got_status, content_type) == (status, "application/vnd.docker.plugins.v1+json")
    assert answer["Err"].startswith(err) or err in answer["Err"]
    assert tree(plugin_agent.volume_dir) == before
    assert plugin_agent.proc.poll() is None  # the daemon lives on


def test_the_plugin_is_not_on_tcp(plugin_agent: PluginAgent) -> None:
    """The REST port answers the REST API only: no plugin method there."""
    status, _, _ = asyncio.run(_tcp_post(plugin_agent.port))
    assert status == 404
    assert os.path.exists(plugin_agent.socket_path)


async def _tcp_post(port: int) -> tuple[int, str, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/Plugin.Activate", headers=ACCEPT) as resp,
    ):
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()
