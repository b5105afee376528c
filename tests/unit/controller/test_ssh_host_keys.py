"""What the SSH transport says about a changed host key: the command it gives must work."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest

from controller.transport.endpoint import parse_endpoint
from controller.transport.ssh_config import SshHop
from controller.transport.ssh_tunnel import SshOptions, SshTunnel


def _removal_command(port: int) -> str:
    new_key = paramiko.RSAKey.generate(1024)
    old_key = paramiko.RSAKey.generate(1024)
    tunnel = SshTunnel(
        parse_endpoint(f"ssh://ops@10.0.0.7:{port}"), SshOptions(user="ops", home="/nonexistent")
    )
    hop = SshHop("10.0.0.7", "10.0.0.7", port, "ops")
    error = tunnel._describe(
        paramiko.BadHostKeyException("10.0.0.7", new_key, old_key), hop, "10.0.0.7", 10
    )
    message = str(error)
    assert "has CHANGED" in message
    command = message.split("remove the old key with: ")[1]
    return command.removeprefix("ssh-keygen -R ").strip("'")


@pytest.mark.parametrize(("port", "line_name"), [(22, "10.0.0.7"), (2222, "[10.0.0.7]:2222")])
def test_changed_key_removal_command_finds_the_known_hosts_line(
    tmp_path: Path, port: int, line_name: str
) -> None:
    """ssh writes a port-22 host as ``host`` and others as ``[host]:port``; the line's
    ``ssh-keygen -R NAME`` must remove that entry."""
    key = paramiko.RSAKey.generate(1024)
    known = tmp_path / "known_hosts"
    known.write_text(f"{line_name} {key.get_name()} {key.get_base64()}\n")
    name = _removal_command(port)
    subprocess.run(["ssh-keygen", "-R", name, "-f", str(known)], check=True, capture_output=True)
    assert known.read_text() == ""
