"""``docker --context NAME``: the node behind a context, judged against the real docker CLI.

Contexts are made with ``docker context create`` in a private ``DOCKER_CONFIG`` (no daemon is
needed for that); ``docker context show`` says which context docker itself would use, and our
resolution must pick the same one, in docker's order.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from controller.errors import EndpointError
from controller.options import Options
from controller.transport.docker_context import context_host, docker_address
from controller.transport.endpoint import resolve
from controller.wrapper.docker_args import scan

DOCKER = shutil.which("docker")
needs_docker = pytest.mark.skipif(DOCKER is None, reason="the docker CLI is not installed")


def opts(environ: dict[str, str]) -> Options:
    """The options the wrapper's edge builds from this environment."""
    return Options.build({"HOME": "/nonexistent", **environ})


def _docker(config: Path, *args: str, env: dict[str, str] | None = None) -> str:
    assert DOCKER is not None
    done = subprocess.run(
        [DOCKER, *args],
        env={"DOCKER_CONFIG": str(config), "PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    config = tmp_path / "docker-config"
    if DOCKER is not None:
        _docker(config, "context", "create", "gpu-a", "--docker", "host=ssh://ops@gpu-a:2222")
        _docker(config, "context", "create", "gpu-b", "--docker", "host=tcp://10.0.0.2:2376")
    return config


@needs_docker
def test_a_context_is_the_node_docker_would_use(config: Path) -> None:
    env = {"DOCKER_CONFIG": str(config), "USER": "alice"}
    assert context_host("gpu-a", opts(env)) == "ssh://ops@gpu-a:2222"
    endpoint, warning = resolve(opts(env), docker_context_option="gpu-a")
    assert (endpoint.transport, endpoint.host, endpoint.ssh_port, endpoint.user) == (
        "ssh",
        "gpu-a",
        2222,
        "ops",
    )
    assert endpoint.http_port == 3476  # the agent's port on the node, through the tunnel
    assert endpoint.source == "docker context gpu-a"
    assert warning is None
    endpoint, _ = resolve(opts(env), docker_context_option="gpu-b")
    assert endpoint.uri() == "http://10.0.0.2:3476"  # 2376 is docker's port, not the agent's


@needs_docker
@pytest.mark.parametrize(
    ("extra_env", "expected"),
    [
        ({}, "default"),
        ({"DOCKER_CONTEXT": "gpu-b"}, "gpu-b"),
        ({"DOCKER_HOST": "tcp://10.9.9.9:2375", "DOCKER_CONTEXT": "gpu-b"}, "default"),
        ("use gpu-a", "gpu-a"),
    ],
)
def test_the_same_context_as_docker_context_show(
    config: Path, extra_env: dict[str, str] | str, expected: str
) -> None:
    env: dict[str, str] = {}
    if isinstance(extra_env, str):
        _docker(config, "context", *extra_env.split())
    else:
        env = extra_env
    shown = _docker(config, "context", "show", env=env)
    assert shown == expected
    ours = docker_address(opts({"DOCKER_CONFIG": str(config), **env}))
    if shown == "default":
        assert ours == ((env["DOCKER_HOST"], "DOCKER_HOST") if "DOCKER_HOST" in env else None)
    else:
        assert ours == (
            context_host(shown, opts({"DOCKER_CONFIG": str(config)})),
            f"docker context {shown}",
        )


@needs_docker
def test_command_line_order(config: Path) -> None:
    env = {"DOCKER_CONFIG": str(config), "DOCKER_HOST": "tcp://10.9.9.9:2375"}
    # --context wins over everything, -H over the environment
    assert docker_address(opts(env), "tcp://10.0.0.7:2375", "gpu-b") == (
        "tcp://10.0.0.2:2376",
        "docker context gpu-b",
    )
    assert docker_address(opts(env), "tcp://10.0.0.7:2375") == ("tcp://10.0.0.7:2375", "-H")
    assert docker_address(opts(env)) == ("tcp://10.9.9.9:2375", "DOCKER_HOST")
    # the default context is DOCKER_HOST, or the local daemon
    assert docker_address(opts(env), None, "default") == (
        "tcp://10.9.9.9:2375",
        "docker context default",
    )
    assert docker_address(opts({"DOCKER_CONFIG": str(config)}), None, "default") is None


def test_an_unknown_context_is_one_line(tmp_path: Path) -> None:
    env = {"DOCKER_CONFIG": str(tmp_path)}
    with pytest.raises(EndpointError) as info:
        resolve(opts(env), docker_context_option="nope")
    assert str(info.value) == (
        f"docker context 'nope' does not exist (in {tmp_path}); docker context ls lists them"
    )


def test_the_wrapper_reads_context_options() -> None:
    assert scan(["--context", "gpu-a", "run", "img"]).docker_context == "gpu-a"
    assert scan(["-c", "gpu-b", "run", "img"]).docker_context == "gpu-b"
    assert scan(["--context=gpu-c", "ps"]).docker_context == "gpu-c"
    assert scan(["run", "--cpu-shares", "4", "img"]).docker_context is None
