"""``~/.ssh/config`` applied to ``ssh://`` endpoints: what the address writes wins, as with ssh."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.errors import EndpointError
from controller.options import Options
from controller.transport.endpoint import parse_endpoint
from controller.transport.ssh_config import resolve_route

HOME = "/home/alice"

# As in OpenSSH, the first value found wins: specific hosts come before the patterns.
CONFIG = """\
Host gpu-direct
  HostName 10.0.0.9
  ProxyJump none
Host gpu*
  User ops
  IdentityFile {keys}/gpu_key
  IdentityFile {keys}/missing_key
  ProxyJump bastion
Host gpu1
  HostName 10.0.0.1
  Port 2222
Host bastion
  HostName 192.0.2.10
  Port 2200
  User jump
Host edge
  ProxyJump admin@[fd00::7]:2022,bastion
  UserKnownHostsFile {keys}/kh1 {keys}/kh2
Host piped
  ProxyCommand nc %h %p
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "gpu_key").write_text("key")
    path = tmp_path / "config"
    path.write_text(CONFIG.format(keys=keys))
    return str(path)


def route(value: str, config: str | None) -> str:
    return resolve_route(
        parse_endpoint(value, user="alice"), config, "alice", "/home/alice"
    ).describe()


def test_alias_hostname_port_user_and_jump(config: str, tmp_path: Path) -> None:
    got = resolve_route(parse_endpoint("ssh://gpu1", user="alice"), config, "alice", HOME)
    assert got.describe() == "ops@10.0.0.1:2222 via jump@192.0.2.10:2200"
    # only the identity files that exist are offered
    assert got.target.identity_files == (str(tmp_path / "keys" / "gpu_key"),)
    assert got.config_file == config


def test_what_the_address_writes_wins(config: str) -> None:
    assert route("ssh://root@gpu1:2200:3476", config) == (
        "root@10.0.0.1:2200 via jump@192.0.2.10:2200"
    )
    assert route("ssh://root@gpu1", config) == "root@10.0.0.1:2222 via jump@192.0.2.10:2200"
    assert route("ssh://gpu1:22", config) == "ops@10.0.0.1:22 via jump@192.0.2.10:2200"


def test_no_entry_and_no_file(config: str, tmp_path: Path) -> None:
    assert route("ssh://elsewhere", config) == "alice@elsewhere:22"
    assert route("ssh://gpu1", None) == "alice@gpu1:22"
    assert route("ssh://gpu1", str(tmp_path / "absent")) == "alice@gpu1:22"


def test_proxyjump_none_chains_and_proxycommand(config: str, tmp_path: Path) -> None:
    assert route("ssh://gpu-direct", config) == "ops@10.0.0.9:22"
    edge = resolve_route(parse_endpoint("ssh://edge", user="alice"), config, "alice", HOME)
    assert edge.describe() == "alice@edge:22 via admin@[fd00::7]:2022 -> jump@192.0.2.10:2200"
    assert edge.known_hosts == (str(tmp_path / "keys" / "kh1"), str(tmp_path / "keys" / "kh2"))
    piped = resolve_route(parse_endpoint("ssh://piped", user="alice"), config, "alice", HOME)
    assert piped.proxy_command == "nc piped 22"


def test_match_blocks_are_evaluated(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(
        "Match originalhost rack7-*\n  User rackops\n  Port 2207\n"
        "Host rack7-gpu3\n  HostName 10.7.0.3\n"
        "Match host 10.7.*\n  ProxyJump bastion7\n"
        "Match all\n  Port 2299\n"
    )
    got = resolve_route(
        parse_endpoint("ssh://rack7-gpu3", user="alice"), str(path), "jumper", "/home/alice"
    )
    assert got.describe() == "rackops@10.7.0.3:2207 via jumper@bastion7:2299"
    assert route("ssh://other", str(path)) == "alice@other:2299"


def test_bad_values_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("Host bad\n  Port twenty-two\n")
    with pytest.raises(EndpointError, match=r"SSH config .*config, Host bad: Port 'twenty-two'"):
        resolve_route(parse_endpoint("ssh://bad", user="alice"), str(path), "alice", "/h")


def test_config_path_from_the_environment(tmp_path: Path) -> None:
    def config_path(environ: dict[str, str]) -> str | None:
        return Options.build({"HOME": "/home/alice", **environ}).ssh_config

    assert config_path({"NV_SSH_CONFIG": "none"}) is None
    assert config_path({"NV_SSH_CONFIG": str(tmp_path / "c")}) == str(tmp_path / "c")
    assert config_path({"NV_SSH_CONFIG": "~/my-ssh"}) == "/home/alice/my-ssh"
    assert config_path({}) == "/home/alice/.ssh/config"


def test_include_as_ssh_reads_it(tmp_path: Path) -> None:
    """``Include config.d/*`` (under ~/.ssh, sorted), ``~/``, absolute paths, a pattern that
    matches nothing, and an Include inside a Host block (whose later lines stay its own)."""
    ssh_dir = tmp_path / ".ssh"
    (ssh_dir / "config.d").mkdir(parents=True)
    (ssh_dir / "config.d" / "10-rack7").write_text("Host rack7-*\n  User rack7ops\n")
    (ssh_dir / "config.d" / "20-lab").write_text("Host lab\n  HostName 10.1.1.1\n")
    (tmp_path / "extra").write_text("Host extra\n  HostName 10.3.3.3\n")
    (tmp_path / "abs").write_text("Host abs\n  HostName 10.2.2.2\n")
    (tmp_path / "gpu1-extra").write_text("  Port 2201\nHost other\n  HostName 10.4.4.4\n")
    config = ssh_dir / "config"
    config.write_text(
        f"Include config.d/* ~/extra\nInclude={tmp_path}/abs\nInclude none-such/*\n"
        "Host gpu1\n  HostName 10.0.0.1\n  Include ~/gpu1-extra\n  User gpu1ops\n"
    )
    home = str(tmp_path)

    def described(value: str) -> str:
        endpoint = parse_endpoint(value, user="alice")
        return resolve_route(endpoint, str(config), "alice", home).describe()

    assert described("ssh://rack7-gpu3") == "rack7ops@rack7-gpu3:22"
    assert described("ssh://lab") == "alice@10.1.1.1:22"
    assert described("ssh://extra") == "alice@10.3.3.3:22"
    assert described("ssh://abs") == "alice@10.2.2.2:22"
    assert described("ssh://gpu1") == "gpu1ops@10.0.0.1:2201"
    assert described("ssh://other") == "alice@10.4.4.4:22"


def test_include_loop_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(f"Include {config}\n")
    with pytest.raises(EndpointError, match=r"Include nested more than 16 deep"):
        resolve_route(parse_endpoint("ssh://x", user="alice"), str(config), "alice", "/h")
