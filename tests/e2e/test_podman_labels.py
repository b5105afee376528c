"""Podman's image labels remembered by ``nvidia-docker`` while the store is unchanged
(``controller.wrapper.podman_labels``), with a real Podman (Debian 12's 4.3.1).

``NV_DOCKER=podman nvidia-docker run`` needs the image's labels to decide whether the
container wants GPUs; Podman has no daemon to ask, so each run started ``podman image
inspect``. Here a private Podman store holds a GPU image (``com.nvidia.volumes.needed``) and
a plain one, and each run says (``NV_DEBUG``) where its labels came from. What the labels
decide is seen from outside: a GPU image needs the node's agent, which this test points at a
closed port (the run stops with the agent's line, before Podman runs anything), and a plain
image goes to Podman unchanged (which refuses an unknown ``--runtime``: no container).

Checked: the first two runs inspect, the ones after remember; ``podman tag`` pointing the
name at the plain image, ``podman rmi`` and a pull-less run of the missing name are seen at
the next run; another ``--root`` is another memory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.podman import Podman, private_podman
from tests.support.prerequisites import require_root
from tests.support.wrapper import wrapper_command

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAME = "nvd-labels/cuda:12.4"
PLAIN = "nvd-labels/plain:1"
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
REFUSED_RUNTIME = "nvd-test-no-such-runtime"
INSPECTED = "labels from docker image inspect"
REMEMBERED = "labels from podman image inspect, remembered"


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    require_root()
    with private_podman() as podman:
        podman.import_busybox(NAME, GPU_LABELS)
        podman.import_busybox(PLAIN, {})
        yield podman


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Runs:
    """``nvidia-docker run`` through one Podman, with a cache directory of the test's."""

    def __init__(self, podman: Podman, cache: Path) -> None:
        self.podman = podman
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
        self.env.update(
            NV_DOCKER=" ".join(podman.command),
            NV_DEBUG="1",
            NV_HOST=f"http://127.0.0.1:{_closed_port()}",
            PYTHONPATH=str(REPO),
            XDG_CACHE_HOME=str(cache),
        )

    def run(self, image: str, *options: str) -> tuple[str, str]:
        """Where the labels came from, and what the run became: ``gpus`` (the agent was
        needed), ``podman`` (ran unchanged), or ``missing`` (Podman said the image is not
        there)."""
        done = subprocess.run(
            [*wrapper_command(), "run", "--rm", f"--runtime={REFUSED_RUNTIME}", *options,
             image, "true"],
            env=self.env, capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        said = done.stderr
        source = REMEMBERED if REMEMBERED in said else INSPECTED if INSPECTED in said else ""
        if "cannot connect to the agent" in said:
            became = "gpus"
        elif REFUSED_RUNTIME in said:
            became = "podman"
        elif "image not known" in said.lower() or "no such image" in said.lower():
            became = "missing"
        else:
            became = f"unexpected (exit {done.returncode}): {said[-800:]}"
        return source.rsplit(" ", 1)[-1] if source else "none", became


def test_labels_are_remembered_until_the_store_changes(podman: Podman, tmp_path: Path) -> None:
    runs = Runs(podman, tmp_path / "cache")
    first = [runs.run(NAME) for _ in range(4)]
    assert first == [
        ("inspect", "gpus"), ("inspect", "gpus"), ("remembered", "gpus"), ("remembered", "gpus"),
    ]  # fmt: skip
    assert runs.run(PLAIN) == ("inspect", "podman")  # another name: asked

    podman("tag", PLAIN, NAME)  # the name now means the plain image: no GPUs
    assert runs.run(NAME) == ("inspect", "podman")
    assert runs.run(NAME) == ("remembered", "podman")

    podman("rmi", NAME)  # the name goes: asked again (Podman then says what it says)
    assert runs.run(NAME, "--pull", "never")[0] == "inspect"
    podman.import_busybox(NAME, GPU_LABELS)
    assert runs.run(NAME) == ("inspect", "gpus")


def test_another_store_is_another_memory(podman: Podman, tmp_path: Path) -> None:
    runs = Runs(podman, tmp_path / "cache")
    assert [runs.run(PLAIN)[0] for _ in range(3)] == ["inspect", "inspect", "remembered"]
    other = Podman(Path(tempfile.mkdtemp(prefix="nvd-podman-")))  # another --root (short:
    try:  # Podman refuses a run root longer than 50 characters)
        other.import_busybox(PLAIN, GPU_LABELS)  # there, the name is a GPU image
        elsewhere = Runs(other, tmp_path / "cache")
        assert [elsewhere.run(PLAIN) for _ in range(3)] == [
            ("inspect", "gpus"), ("inspect", "gpus"), ("remembered", "gpus"),
        ]  # fmt: skip
        assert runs.run(PLAIN) == ("remembered", "podman")  # the first store's, still
    finally:
        other("rmi", "--all", "--force", check=False)
        shutil.rmtree(other.base, ignore_errors=True)
