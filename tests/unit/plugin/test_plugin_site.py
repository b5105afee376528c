"""The plugin's unix socket: permissions, stale and live sockets, cleanup, spec file."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import aiohttp
import pytest

from agent.edge.plugin_socket import PluginSiteError, start_plugin_site
from agent.node.drivers import prepare_volumes
from plugin.volumes import VolumeStore
from tests.support.fake_driver import FakeDriver


async def _activate(sock: Path) -> dict[str, object]:
    connector = aiohttp.UnixConnector(path=str(sock))
    headers = {"Accept": "application/vnd.docker.plugins.v1.2+json"}
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post("http://plugin/Plugin.Activate", headers=headers) as resp,
    ):
        answer: dict[str, object] = await resp.json(content_type=None)
        return answer


async def test_serves_on_a_0660_socket_and_cleans_up(store: VolumeStore, tmp_path: Path) -> None:
    socket_dir = tmp_path / "run" / "plugins"  # created when missing
    spec = tmp_path / "etc" / "nvidia-docker.spec"
    runner = await start_plugin_site(store, socket_dir, spec_file=spec)
    sock = socket_dir / "nvidia-docker.sock"
    try:
        mode = sock.lstat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o660
        assert spec.read_text() == f"unix://{sock}\n"
        assert await _activate(sock) == {"Implements": ["VolumeDriver"]}
        assert sorted(p.name for p in socket_dir.iterdir()) == [
            ".nvidia-docker.sock.lock",
            "nvidia-docker.sock",
        ]
    finally:
        await runner.cleanup()
    assert not sock.exists()
    assert not spec.exists()


async def test_a_socket_directory_given_with_dots_still_has_its_spec_file_removed(
    store: VolumeStore, tmp_path: Path
) -> None:
    """``-s run/../plugins``: the spec file names the resolved path, and the stop that wrote
    it recognises it as its own and removes it (dockerd would try a dead socket otherwise)."""
    (tmp_path / "run").mkdir()
    spec = tmp_path / "etc" / "nvidia-docker.spec"
    runner = await start_plugin_site(store, tmp_path / "run" / ".." / "plugins", spec_file=spec)
    try:
        assert spec.read_text() == f"unix://{tmp_path / 'plugins' / 'nvidia-docker.sock'}\n"
    finally:
        await runner.cleanup()
    assert not spec.exists()


async def test_refuses_a_socket_another_agent_serves(store: VolumeStore, tmp_path: Path) -> None:
    runner = await start_plugin_site(store, tmp_path)
    try:
        with pytest.raises(PluginSiteError) as refused:
            await start_plugin_site(store, tmp_path)
        assert str(refused.value) == (
            f"another agent (pid {os.getpid()}) is serving {tmp_path / 'nvidia-docker.sock'} "
            f"(it holds {tmp_path / '.nvidia-docker.sock.lock'}): stop it or choose another -s"
        )
        assert await _activate(tmp_path / "nvidia-docker.sock") == {"Implements": ["VolumeDriver"]}
    finally:
        await runner.cleanup()


async def test_refuses_a_live_socket_of_a_process_without_the_lock(
    store: VolumeStore, tmp_path: Path
) -> None:
    """An older agent (or anything else) listening there, without taking the lock."""
    foreign = socket.socket(socket.AF_UNIX)
    foreign.bind(str(tmp_path / "nvidia-docker.sock"))
    foreign.listen(1)
    try:
        with pytest.raises(PluginSiteError, match="another process is serving"):
            await start_plugin_site(store, tmp_path)
        assert (tmp_path / "nvidia-docker.sock").is_socket()
    finally:
        foreign.close()
    runner = await start_plugin_site(store, tmp_path)  # the failed start let the lock go
    await runner.cleanup()


async def test_the_lock_goes_with_the_agent_and_the_next_one_serves(
    store: VolumeStore, tmp_path: Path
) -> None:
    for _ in range(3):
        runner = await start_plugin_site(store, tmp_path)
        try:
            assert (tmp_path / ".nvidia-docker.sock.lock").read_text() == f"{os.getpid()}\n"
            assert await _activate(tmp_path / "nvidia-docker.sock") == {
                "Implements": ["VolumeDriver"]
            }
        finally:
            await runner.cleanup()
        assert not (tmp_path / "nvidia-docker.sock").exists()


async def test_replaces_a_stale_socket(store: VolumeStore, tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "nvidia-docker.sock"))
    stale.close()  # the file stays, nobody listens: what a killed agent leaves
    runner = await start_plugin_site(store, tmp_path)
    try:
        assert await _activate(tmp_path / "nvidia-docker.sock") == {"Implements": ["VolumeDriver"]}
    finally:
        await runner.cleanup()


async def test_refuses_to_replace_what_is_not_a_socket(store: VolumeStore, tmp_path: Path) -> None:
    (tmp_path / "nvidia-docker.sock").write_text("precious")
    with pytest.raises(PluginSiteError, match="is not a socket"):
        await start_plugin_site(store, tmp_path)
    assert (tmp_path / "nvidia-docker.sock").read_text() == "precious"


def test_prepare_volumes_finds_the_driver_and_logs_counts(
    fake_driver: FakeDriver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", "nvidia-docker-plugin")
    store = prepare_volumes(
        tmp_path / "volumes",
        fake_driver.version,
        ldcache=fake_driver.ldcache,
        search_path=str(fake_driver.bin),
    )
    assert store.driver_version == "580.159.04"
    line = next(r.getMessage() for r in caplog.records if "Driver files found" in r.getMessage())
    assert "2 binaries" in line
    assert f"{len(store.files.libraries_64)} 64-bit" in line


async def test_a_spec_file_that_cannot_be_written_is_named_and_leaves_no_socket(
    store: VolumeStore, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    spec = tmp_path / "a-file" / "nvidia-docker.spec"
    socket_dir = tmp_path / "plugins"
    with pytest.raises(PluginSiteError) as refused:
        await start_plugin_site(store, socket_dir, spec_file=spec)
    assert str(refused.value).startswith(f"--spec-file {spec} cannot be written (Not a directory)")
    assert str(refused.value).endswith(
        "give a path in a directory the agent can write (dockerd reads /etc/docker/plugins)"
    )
    assert not (socket_dir / "nvidia-docker.sock").exists()  # dockerd finds no dead socket
    runner = await start_plugin_site(store, socket_dir)  # the directory's lock was let go
    await runner.cleanup()


async def test_the_spec_file_is_written_anew_not_through_a_link_at_a_guessable_name(
    store: VolumeStore, tmp_path: Path
) -> None:
    """A link planted where a temporary file of a known name (the spec's name and the
    agent's pid) would go is neither followed nor put in the spec's place."""
    spec = tmp_path / "etc" / "nvidia-docker.spec"
    spec.parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("kept\n")
    (spec.parent / f".{spec.name}.{os.getpid()}").symlink_to(victim)
    socket_dir = tmp_path / "plugins"
    runner = await start_plugin_site(store, socket_dir, spec_file=spec)
    try:
        assert victim.read_text() == "kept\n"
        assert not spec.is_symlink()
        assert spec.read_text() == f"unix://{socket_dir / 'nvidia-docker.sock'}\n"
        assert spec.stat().st_mode & 0o777 == 0o644
    finally:
        await runner.cleanup()
