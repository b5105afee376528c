"""Every setting declared once (agent.config): the command line is made from the declarations."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from agent import cli
from agent.config import Config, ListenAddress, options, parse_listen


def _parsed(monkeypatch: pytest.MonkeyPatch, *args: str, **env: str) -> Config:
    """The Config the command line builds, without serving it."""
    built: list[Config] = []
    monkeypatch.setattr(cli, "_check_tls_options", lambda *_: None)
    monkeypatch.setattr(cli, "loop_factory", lambda _choice: _stop(built))

    def build(**settings: Any) -> Config:
        built.append(Config(**settings))
        return built[-1]

    monkeypatch.setattr(cli, "Config", build)
    unset: dict[str, str | None] = {o.env_var: None for _, o, _ in options()}  # the suite's own
    result = CliRunner().invoke(
        cli.command, list(args), env={**unset, **env}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    (config,) = built
    return config


def _stop(_built: list[Config]) -> Any:
    raise SystemExit(0)


def test_every_field_is_an_option_with_its_own_flag_and_variable() -> None:
    names = [f.name for f in fields(Config)]
    declared = options()
    assert [name for name, _, _ in declared] == names
    params = {p.name: p for p in cli.command.params if isinstance(p, click.Option)}
    for name, option, default in declared:
        param = params[name]
        assert param.envvar == option.env_var
        assert option.env_var.startswith("NVIDIA_DOCKER_PLUGIN_")
        assert option.long_flag in param.opts
        assert param.help == option.help
        assert param.default == default
    flags = [f for p in params.values() for f in (*p.opts, *p.secondary_opts)]
    assert len(flags) == len(set(flags))


def test_the_short_flags_of_nvidia_docker_plugin_1_0_are_kept() -> None:
    params = {p.name: p.opts for p in cli.command.params}
    assert "-l" in params["listen"]
    assert "-d" in params["volume_dir"]
    assert "-s" in params["socket_dir"]
    assert "-v" in params["version"]


def test_flags_then_environment_then_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert _parsed(monkeypatch) == Config()
    config = _parsed(
        monkeypatch,
        "-l",
        "[::1]:4000",
        "--max-connections",
        "7",
        NVIDIA_DOCKER_PLUGIN_VOLUMES=str(tmp_path),
        NVIDIA_DOCKER_PLUGIN_MAX_CONNECTIONS="9",
        NVIDIA_DOCKER_PLUGIN_PLAIN_LOOPBACK="false",
    )
    assert config.listen == ListenAddress("::1", 4000)
    assert config.max_connections == 7  # the flag wins
    assert config.volume_dir == tmp_path
    assert config.plain_loopback is False


def test_an_empty_cdi_spec_dir_turns_the_spec_off_as_a_flag_or_a_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Config().cdi_spec_dir == Path("/var/run/cdi")
    assert _parsed(monkeypatch).cdi_spec_dir == Path("/var/run/cdi")
    assert _parsed(monkeypatch, "--cdi-spec-dir", "").cdi_spec_dir is None
    assert _parsed(monkeypatch, NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR="").cdi_spec_dir is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("127.0.0.1:0", "'127.0.0.1:0': port 0 is out of range (1 to 65535)"),
        ("127.0.0.1:99999", "'127.0.0.1:99999': port 99999 is out of range (1 to 65535)"),
        ("localhost", "'localhost': expected HOST:PORT, e.g. localhost:3476"),
        (
            "::1:3476",
            "'::1:3476': an IPv6 address goes in brackets, with the port after them: "
            "[IPv6]:PORT, e.g. [::1]:3476",
        ),
        ("::1", "'::1': an IPv6 address goes in brackets"),
        ("[::1:3476", "'[::1:3476': expected [IPv6]:PORT, e.g. [::1]:3476"),
        ("[]:3476", "'[]:3476': expected [IPv6]:PORT, e.g. [::1]:3476"),
    ],
)
def test_a_bad_listen_address_says_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_listen(value)
    result = CliRunner().invoke(cli.command, ["-l", value])
    assert result.exit_code == 2
    assert message in result.output


def test_listen_addresses_as_shown() -> None:
    assert str(parse_listen(":3476")) == "*:3476"
    assert str(parse_listen("[fd00::1]:3476")) == "[fd00::1]:3476"


def test_the_go_forms_of_1_0s_flags_are_read_as_1_0_read_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """1.0 parsed -l, -d and -s with Go's flag package: -l=ADDR and --d DIR are its forms too."""
    built: list[Config] = []
    monkeypatch.setattr(cli, "_check_tls_options", lambda *_: None)
    monkeypatch.setattr(cli, "loop_factory", lambda _choice: _stop(built))

    def build(**settings: Any) -> Config:
        built.append(Config(**settings))
        return built[-1]

    monkeypatch.setattr(cli, "Config", build)
    for _, option, _ in options():
        monkeypatch.delenv(option.env_var, raising=False)
    volumes, sockets = tmp_path / "volumes", tmp_path / "plugins"
    argv = ["nvidia-docker-plugin", "-l=[::1]:4000", f"--d={volumes}", "--s", str(sockets)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 0
    (config,) = built
    assert config.listen == ListenAddress("::1", 4000)
    assert config.volume_dir == volumes
    assert config.socket_dir == sockets
    assert cli.go_flag_forms(["--listen=:1", "-lhost:2", "--simulate", "h200"]) == [
        "--listen=:1",
        "-lhost:2",
        "--simulate",
        "h200",
    ]


def test_an_engine_socket_in_docker_host_form_is_its_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--docker-socket unix:///var/run/docker.sock`` (DOCKER_HOST's form) was the relative
    path ``unix:/var/run/docker.sock``: never reached, containers shown by id."""
    config = _parsed(
        monkeypatch,
        "--docker-socket",
        "unix:///var/run/docker.sock",
        NVIDIA_DOCKER_PLUGIN_PODMAN_SOCKET="unix:///run/podman/podman.sock",
    )
    assert config.docker_socket == Path("/var/run/docker.sock")
    assert config.podman_socket == Path("/run/podman/podman.sock")
    assert _parsed(monkeypatch, "--docker-socket", "/x:y/d.sock").docker_socket == Path(
        "/x:y/d.sock"
    )


@pytest.mark.parametrize("value", ["tcp://127.0.0.1:2375", "ssh://gpu-node"])
def test_an_engine_socket_of_another_scheme_is_refused_in_one_line(value: str) -> None:
    result = CliRunner().invoke(cli.command, ["--docker-socket", value])
    assert result.exit_code == 2
    assert "give the engine's unix socket, as a path or unix://PATH" in result.output


def test_each_gpu_aware_engine_socket_counts_for_the_descriptors_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _parsed(monkeypatch).engine_sockets == 0
    podman = _parsed(
        monkeypatch, NVIDIA_DOCKER_PLUGIN_PODMAN_ENGINE_SOCKET="/run/nvidia-docker/podman.sock"
    )
    assert podman.podman_engine_socket == Path("/run/nvidia-docker/podman.sock")
    assert podman.engine_sockets == 1
    both = _parsed(
        monkeypatch,
        "--engine-socket", "/run/nvidia-docker/docker.sock",
        "--podman-engine-socket", "/run/nvidia-docker/podman.sock",
    )  # fmt: skip
    assert both.engine_sockets == 2
    assert _parsed(monkeypatch, "--podman-engine-socket", "").podman_engine_socket is None
