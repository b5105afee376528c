"""The GPU worker's NVML without libcuda: the empty ``libcuda.so.1`` first on its path.

The loader behaviour the design rests on is checked against a library this machine has
(``liblzma.so.5``: dpkg needs it, so it is in every Debian linker cache) and that Python
itself does not load at start (Debian's python3 links ``libz.so.1``: an empty one first on
its path would stop the interpreter): an empty file of that name first on
``LD_LIBRARY_PATH`` makes the load fail instead of the search going on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.gpu.backend import GpuBackendError
from agent.gpu.hidden_libcuda import (
    EMPTY_LIBCUDA_DIR,
    with_empty_libcuda,
    without_empty_libcuda,
)
from agent.gpu.worker_client import WorkerClient

SHADOWED = "liblzma.so.5"
LOAD = """
import ctypes, sys
try:
    ctypes.CDLL(sys.argv[1])
except OSError as err:
    print(err)
"""


def _load(name: str, env: dict[str, str]) -> str:
    """What a fresh process says when it loads ``name`` ("" when it loaded)."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD, name], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_package_ships_an_empty_libcuda() -> None:
    path = Path(EMPTY_LIBCUDA_DIR, "libcuda.so.1")
    assert path.is_file()
    assert path.stat().st_size == 0


def test_an_empty_file_first_on_the_path_stops_the_search(tmp_path: Path) -> None:
    assert _load(SHADOWED, dict(os.environ)) == "", f"{SHADOWED} should load here"
    (tmp_path / SHADOWED).write_bytes(b"")
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    assert _load(SHADOWED, env) == f"{tmp_path}/{SHADOWED}: file too short"


def test_the_workers_environment_finds_the_empty_libcuda_first() -> None:
    env = with_empty_libcuda(dict(os.environ))
    assert _load("libcuda.so.1", env) == f"{EMPTY_LIBCUDA_DIR}/libcuda.so.1: file too short"


@pytest.mark.parametrize(
    ("before", "worker"),
    [
        (None, EMPTY_LIBCUDA_DIR),
        ("/opt/cuda/lib64", f"{EMPTY_LIBCUDA_DIR}:/opt/cuda/lib64"),
        ("/a:/b", f"{EMPTY_LIBCUDA_DIR}:/a:/b"),
        (f"{EMPTY_LIBCUDA_DIR}:/a", f"{EMPTY_LIBCUDA_DIR}:/a"),  # never twice
    ],
)
def test_on_and_off_the_path(before: str | None, worker: str) -> None:
    environ = {"HOME": "/root"} if before is None else {"HOME": "/root", "LD_LIBRARY_PATH": before}
    env = with_empty_libcuda(environ)
    assert env == {"HOME": "/root", "LD_LIBRARY_PATH": worker}
    back = without_empty_libcuda(env)
    if before is None:
        assert back == {"HOME": "/root"}  # removed, not left empty (= the current directory)
    else:
        assert back["LD_LIBRARY_PATH"] == before.replace(f"{EMPTY_LIBCUDA_DIR}:", "")
    assert environ.get("LD_LIBRARY_PATH") == before  # the caller's mapping is left alone


def test_a_path_without_it_is_left_as_it_was() -> None:
    odd = {"LD_LIBRARY_PATH": "/a::/b:"}  # empty entries are the user's business
    assert without_empty_libcuda(odd) == odd


async def _spawn_env(monkeypatch: pytest.MonkeyPatch, simulate: str | None) -> dict[str, str]:
    seen: dict[str, str] = {}

    def popen(command: list[str], **kwargs: Any) -> Any:
        seen.update(kwargs["env"])
        raise OSError("not started in this test")

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(GpuBackendError, match="cannot start the GPU worker"):
        await WorkerClient.spawn(simulate=simulate)
    return seen


async def test_the_real_worker_starts_with_the_empty_libcuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")
    env = await _spawn_env(monkeypatch, None)
    assert env["LD_LIBRARY_PATH"] == f"{EMPTY_LIBCUDA_DIR}:/usr/local/nvidia/lib64"
    assert os.environ["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"  # the daemon's own


async def test_a_simulated_worker_starts_with_the_path_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")
    env = await _spawn_env(monkeypatch, "h200")
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
