"""The remembered ``--version`` of this machine's real container CLIs
(``controller.wrapper.cli_versions``): Debian's Podman and docker CLIs (built with
``-trimpath``: their files do not record their versions, so the CDI question needs this),
and the docker CLI on ``PATH``. What is remembered is what the CLI's own ``version``
command says of its client, and a second question runs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from controller.wrapper.cli_versions import cli_version
from controller.wrapper.docker_args import scan
from controller.wrapper.engine_cdi import CLI_VERSION, ask_engine
from controller.wrapper.go_build_info import linked_value
from tests.support.podman import private_podman
from tests.support.prerequisites import require_command, unavailable


def _clis() -> list[str]:
    found = {shutil.which("docker"), shutil.which("podman"), "/usr/bin/docker", "/usr/bin/podman"}
    return sorted({os.path.realpath(p) for p in found if p and os.access(p, os.X_OK)})


def client_version(cli: str) -> str:
    """What ``<cli> version`` says of its client (Docker's prints it with no daemon too;
    Podman's is asked of a private store, never the machine's)."""
    if os.path.basename(cli) == "podman":
        with private_podman() as podman:
            return podman("version", "--format", "{{.Client.Version}}").stdout.strip()
    done = subprocess.run(
        [cli, "version", "--format", "{{.Client.Version}}"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"},
    )  # fmt: skip
    return done.stdout.strip()


@pytest.mark.parametrize("cli", _clis())
def test_a_real_cli_s_version_is_its_client_s(cli: str, tmp_path: Path) -> None:
    environment = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)}
    asked: list[str] = []
    said = cli_version(cli, environment, asked)
    assert said is not None
    name = "podman" if said[0] == "podman" else "docker"
    assert os.path.basename(cli) == name
    assert said[1] == client_version(cli)
    assert cli_version(cli, environment, asked) == said
    assert asked == [f"{name} --version", f"{name} --version, remembered"]


def test_real_podman_s_cdi_question_runs_it_once(tmp_path: Path) -> None:
    """``NV_DOCKER=podman``: Debian 12's Podman 4.3 reads CDI, known after one ``podman
    --version`` and from memory afterwards; the same as ``podman version`` says."""
    podman = require_command("podman", "apt-get install podman")
    environment = {
        "PATH": f"{os.path.dirname(podman)}:/usr/bin:/bin",
        "XDG_CACHE_HOME": str(tmp_path),
    }
    command = scan(["run", "--rm", "nvidia/cuda:12.4", "true"])
    first = ask_engine(("podman",), command, environment)
    again = ask_engine(("podman",), command, environment)
    with private_podman() as private:  # several words: `version`, as before
        asked = ask_engine(tuple(private.command), command, environment)
    assert asked.asked == ("docker version",)
    assert first.asked == ("podman --version",)
    assert again.asked == ("podman --version, remembered",)
    assert first.engine == again.engine == asked.engine == f"Podman {client_version(podman)}"
    assert first.reads_cdi is again.reads_cdi is asked.reads_cdi is True


def test_debian_s_docker_cli_is_one_that_needs_it() -> None:
    """Why this exists: Debian's docker CLI does not record its version for
    ``go_build_info`` (it is built with ``-trimpath``)."""
    debian = Path("/usr/bin/docker")
    if not debian.exists():
        unavailable("Debian's docker CLI is not installed (apt-get install docker.io)")
    assert linked_value(str(debian), CLI_VERSION) is None
