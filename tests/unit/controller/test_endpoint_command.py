"""``nvidia-docker-ctl endpoint``: what an operator sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.ctl.main import main
from tests.support.cli import cli_runner
from tests.unit.controller.ctl_lines import WARNING_LINE, error_of


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    base = {"NV_HOST": "", "DOCKER_HOST": "", "USER": "alice"}
    result = cli_runner().invoke(main, ["endpoint", *args], env={**base, **(env or {})})
    return result.exit_code, result.stdout, result.stderr


def test_environment_local() -> None:
    code, out, _ = run()
    assert code == 0
    assert "transport  local" in out
    assert "source     default" in out


def test_environment_ssh_with_warning() -> None:
    code, out, err = run(env={"NV_HOST": "ssh://admin@10.0.0.1:22:80"})
    assert code == 0
    assert "route      SSH to 10.0.0.1:22 as admin, then http://localhost:80 on that node" in out
    (warning,) = err.splitlines()
    match = WARNING_LINE.match(warning)
    assert match
    assert match.group(1).startswith("NV_HOST is set but DOCKER_HOST is not")


def test_docker_host_port_is_not_the_agents() -> None:
    code, out, _ = run("--json", env={"DOCKER_HOST": "tcp://10.0.0.1:2375"})
    assert code == 0
    assert json.loads(out) == {
        "transport": "http",
        "host": "10.0.0.1",
        "ssh_port": 22,
        "http_port": 3476,
        "tls": False,
        "user": None,
        "source": "DOCKER_HOST",
        "uri": "http://10.0.0.1:3476",
    }


@pytest.mark.parametrize(
    "value", ["ssh://[fd00::1]:", "node7:", "http://127.0.0.1:8080", "https://node7:"]
)
def test_given_value_round_trips(value: str) -> None:
    code, out, _ = run("--json", value)
    assert code == 0
    uri = json.loads(out)["uri"]
    again = json.loads(run("--json", uri)[1])
    assert again["uri"] == uri


def test_invalid_value_is_a_usage_error_in_one_line() -> None:
    code, out, err = run("ftp://x")
    assert code == 2
    assert out == ""
    assert error_of(err).startswith("invalid remote host URI 'ftp://x': unknown scheme ftp://")


def test_ssh_route_follows_the_ssh_config(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpu7\n  HostName 10.0.0.7\n  User ops\n  ProxyJump jump:2222\n")
    code, out, _ = run("ssh://gpu7::3476", env={"NV_SSH_CONFIG": str(config)})
    assert code == 0
    assert "ssh_route  ops@10.0.0.7:22 via alice@jump:2222" in out
    code, out, _ = run("--json", "ssh://root@gpu7", env={"NV_SSH_CONFIG": str(config)})
    assert json.loads(out)["ssh_route"] == "root@10.0.0.7:22 via alice@jump:2222"
    code, out, _ = run("ssh://gpu7", env={"NV_SSH_CONFIG": "none"})
    assert "ssh_route  alice@gpu7:22" in out
