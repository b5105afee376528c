"""A state directory the agent cannot write stops its start, before anything is written."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from agent import server
from agent.config import Config, ListenAddress
from agent.errors import StartupError
from tests.support.services import free_port


def _config(tmp_path: Path, **settings: object) -> Config:
    return Config(
        listen=ListenAddress("127.0.0.1", free_port()),
        simulate="h200",
        ldcache=None,
        socket_dir=tmp_path / "plugins",
        volume_dir=tmp_path / "volumes",
        cdi_spec_dir=tmp_path / "cdi",
        docker_socket=tmp_path / "no-docker.sock",
        podman_socket=tmp_path / "no-podman.sock",
        **settings,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("settings", "holds"),
    [
        ({}, "the lease table's leases.json and the usage ledger's usage.db"),
        ({"usage_ledger": False}, "the lease table's leases.json"),
    ],
    ids=["ledger", "no-ledger"],
)
async def test_a_state_directory_under_a_file_stops_the_start_in_one_line(
    tmp_path: Path, settings: dict[str, object], holds: str
) -> None:
    (tmp_path / "var").write_text("x")
    state_dir = tmp_path / "var" / "state"
    config = _config(tmp_path, state_dir=state_dir, **settings)
    async with contextlib.AsyncExitStack() as parts:
        with pytest.raises(StartupError) as err:
            await server.start(config, parts)
    assert str(err.value) == (
        f"cannot use the state directory {state_dir}: Not a directory ({tmp_path}/var is a "
        "regular file): give --state-dir a directory the agent can create and write (it "
        f"holds {holds})"
    )
    # nothing was written: no plugin socket, no volume, no CDI spec
    assert sorted(os.listdir(tmp_path)) == ["var"]


async def test_a_state_directory_made_at_start_is_the_agent_s_alone(tmp_path: Path) -> None:
    """Made with mode 0700 whatever the umask (its files are 0600 too): as the usage ledger
    made it before the start checked it."""
    state_dir = tmp_path / "var" / "lib" / "state"
    old = os.umask(0o022)
    try:
        server._check_state_dir(_config(tmp_path, state_dir=state_dir))
    finally:
        os.umask(old)
    assert state_dir.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "var" / "lib").stat().st_mode & 0o777 == 0o755
    assert os.listdir(state_dir) == []  # the probe is gone
