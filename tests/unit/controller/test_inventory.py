"""Ansible inventories: INI, YAML and --list JSON, judged against ansible-inventory itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from controller.errors import ControllerError
from controller.fleet.inventory import InventoryError, expand_range, load_inventory
from controller.fleet.nodes import nodes_from_file, nodes_from_inventory
from controller.fleet.query import FleetNode
from tests.support.prerequisites import require_command

USER, HOME = "alice", "/home/alice"  # the edge's $USER and $HOME


def inventory_nodes(path: str, limit: str | None) -> list[FleetNode]:
    return nodes_from_inventory(path, limit, USER, HOME)


def file_nodes(path: str) -> list[FleetNode]:
    return nodes_from_file(path, USER)


INI = """\
# fleet of rack 7
lonely ansible_host=10.9.9.9

[gpu]
node[01:03] nvidia_docker_agent_listen_port=3477
node9:2222 ansible_host=10.0.0.9 ansible_user=admin  # trailing comment
"quoted" x='a b'

[gpu:vars]
nvidia_docker_transport=ssh
ansible_user=ops

[dgx]
dgx-[a:b].dc1 ansible_port=22

[dgx:vars]
nvidia_docker_transport=http

[cluster:children]
gpu
dgx

[cluster:vars]
nvidia_docker_agent_listen_port=3476
ansible_user=clusteruser
"""

YAML = """\
all:
  vars:
    nvidia_docker_transport: ssh
  hosts:
    head:
      ansible_host: 10.1.0.1
  children:
    gpu:
      vars: &gv
        ansible_user: ops
      hosts:
        node[1:3]:
        node9: {ansible_host: 10.0.0.9, ansible_port: 2222}
      children:
        h200:
          hosts:
            node1:
              nvidia_docker_agent_listen_port: 3477
    other:
      vars: *gv
      hosts:
        x:
"""


# [IPv6]:port host lines, which Ansible reads as hosts (not as [group] headers)
IPV6_INI = """\
[fd00::1:2:3]:22
[fd00::5]:2222 x=1
[2001:db8::1]:2200

[gpu]
[fd00::9]:2201 nvidia_docker_transport=http
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "text"), [("hosts", INI), ("hosts.yml", YAML), ("hosts", IPV6_INI)]
)
def test_same_hosts_groups_and_vars_as_ansible_inventory(
    tmp_path: Path, name: str, text: str
) -> None:
    ansible_inventory = require_command(
        "ansible-inventory", "ansible-core: pip install -e '.[test]'"
    )
    path = write(tmp_path, name, text)
    listed = subprocess.run(
        [ansible_inventory, "-i", str(path), "--list"],
        capture_output=True,
        check=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin:" + str(Path(ansible_inventory).parent),
            "HOME": str(tmp_path),
            "ANSIBLE_LOCAL_TEMP": str(tmp_path),
        },
    )
    reference = json.loads(listed.stdout)
    ours = load_inventory(path)
    hostvars = reference["_meta"]["hostvars"]
    assert sorted(h.name for h in ours.hosts) == sorted(hostvars)
    for host in ours.hosts:
        assert dict(host.vars) == hostvars[host.name], host.name

    def members(group: str) -> set[str]:
        entry = reference.get(group, {})
        found = set(entry.get("hosts", []))
        for child in entry.get("children", []):
            found |= members(child)
        return found

    for group in reference:
        if group != "_meta":
            assert set(ours.groups[group]) == members(group), group
    # and the --list output itself reads back to the same hosts and variables
    listed_file = write(tmp_path, "fleet.json", listed.stdout.decode())
    again = load_inventory(listed_file)
    assert {h.name: dict(h.vars) for h in again.hosts} == hostvars


def _ansible_inventory_list(path: Path, home: Path) -> dict[str, Any]:
    tool = require_command("ansible-inventory", "ansible-core: pip install -e '.[test]'")
    listed = subprocess.run(
        [tool, "-i", str(path), "--list"],
        capture_output=True,
        check=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin:" + str(Path(tool).parent),
            "HOME": str(home),
            "ANSIBLE_LOCAL_TEMP": str(home),
        },
    )
    reference: dict[str, Any] = json.loads(listed.stdout)
    return reference


def _vars_dirs(root: Path) -> None:
    """group_vars/ and host_vars/ in every form Ansible reads, with values that collide."""
    (root / "group_vars" / "gpu").mkdir(parents=True)
    (root / "host_vars").mkdir()
    (root / "group_vars" / "all.yml").write_text(
        "nvidia_docker_transport: http\nfrom_all_dir: 1\nansible_user: all-dir-user\n"
    )
    # a directory: every file, sorted; hidden files and backups skipped
    (root / "group_vars" / "gpu" / "10-first.yml").write_text("layer: first\nport_a: 1\n")
    (root / "group_vars" / "gpu" / "20-second.yaml").write_text("layer: second\n")
    (root / "group_vars" / "gpu" / "30-third").write_text("tls: {ca: /etc/ca.pem}\n")
    (root / "group_vars" / "gpu" / ".hidden.yml").write_text("layer: hidden\n")
    (root / "group_vars" / "gpu" / "40-backup.yml~").write_text("layer: backup\n")
    (root / "group_vars" / "gpu" / "notes.txt").write_text("layer: wrong extension\n")
    # no extension wins over .yml
    (root / "group_vars" / "cluster").write_text("nvidia_docker_agent_listen_port: 3999\n")
    (root / "group_vars" / "cluster.yml").write_text("nvidia_docker_agent_listen_port: 1\n")
    (root / "group_vars" / "h200.json").write_text('{"nvidia_docker_agent_listen_port": 3478}')
    (root / "host_vars" / "node01.yml").write_text("ansible_host: 10.0.0.1\nlayer: host\n")
    (root / "host_vars" / "node9").write_text("ansible_port: 2200\n")
    (root / "host_vars" / "node1.yaml").write_text("")  # empty: no variables
    (root / "group_vars" / "unknown-group.yml").write_text("never: used\n")


@pytest.mark.parametrize(("name", "text"), [("hosts", INI), ("hosts.yml", YAML)])
def test_group_vars_and_host_vars_as_ansible_inventory(
    tmp_path: Path, name: str, text: str
) -> None:
    inventory_dir = tmp_path / "inventory"
    inventory_dir.mkdir()
    _vars_dirs(inventory_dir)
    path = write(inventory_dir, name, text)
    reference = _ansible_inventory_list(path, tmp_path)
    hostvars = reference["_meta"]["hostvars"]
    ours = load_inventory(path)
    assert sorted(h.name for h in ours.hosts) == sorted(hostvars)
    for host in ours.hosts:
        assert dict(host.vars) == hostvars[host.name], host.name
    # the files were read at all (not only both sides empty)
    assert any(h.vars.get("layer") == "second" for h in ours.hosts)
    assert any(h.vars.get("from_all_dir") == 1 for h in ours.hosts)


def test_vault_files_are_skipped_and_inline_vault_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text("$ANSIBLE_VAULT;1.1;AES256\n6162636465660a\n")
    path = write(tmp_path, "hosts", "[gpu]\nnode1 nvidia_docker_transport=http\n")
    (node,) = inventory_nodes(str(path), None)
    assert node.endpoint.uri() == "http://node1:3476"
    (tmp_path / "group_vars" / "all.yml").write_text(
        "secret: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n"
    )
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert str(info.value).startswith(f"inventory {path}: vars file ")
    assert "a !vault value" in str(info.value)


def test_tls_variables_of_a_host(tmp_path: Path) -> None:
    text = (
        "[gpu]\n"
        "a nvidia_docker_transport=https nvidia_docker_tls_ca=/pki/ca.pem\n"
        "b nvidia_docker_transport=https nvidia_docker_agent_tls_ca=/pki/role-ca.pem "
        "nvidia_docker_agent_token_file=/pki/tokens\n"
        "c nvidia_docker_transport=http\n"
    )
    nodes = {n.name: n for n in inventory_nodes(str(write(tmp_path, "hosts", text)), None)}
    assert nodes["a"].endpoint.uri() == "https://a:3476"
    assert nodes["a"].tls is not None
    assert nodes["a"].tls.ca == "/pki/ca.pem"
    # the role's variables of the same meaning are used when the tool's are not set
    assert nodes["b"].tls is not None
    assert (nodes["b"].tls.ca, nodes["b"].tls.token_file) == ("/pki/role-ca.pem", "/pki/tokens")
    assert nodes["c"].tls is None


def test_the_roles_templated_tls_variables_turn_tls_on_without_being_read(tmp_path: Path) -> None:
    # docs/ansible.md's own example: the role's certificate is a template per host, its CA
    # too here; the inventory was refused as a whole ('is a Jinja2 template')
    (tmp_path / "group_vars").mkdir()
    write(
        tmp_path,
        "group_vars/gpu.yml",
        "nvidia_docker_transport: http\n"
        "nvidia_docker_agent_tls_cert: pki/{{ inventory_hostname }}.pem\n"
        "nvidia_docker_agent_tls_key_content: '{{ vault_agent_keys[inventory_hostname] }}'\n"
        "nvidia_docker_agent_tls_ca: '{{ pki_dir }}/ca.pem'\n",
    )
    path = write(tmp_path, "hosts", "[gpu]\nnode1\nnode2 nvidia_docker_tls_ca=/pki/ca.pem\n")
    nodes = {n.name: n for n in inventory_nodes(str(path), None)}
    assert nodes["node1"].endpoint.uri() == "https://node1:3476"
    assert nodes["node1"].tls is None  # the role's CA is a template: --ca, else the system's
    assert nodes["node2"].tls is not None
    assert nodes["node2"].tls.ca == "/pki/ca.pem"


def test_ini_endpoints(tmp_path: Path) -> None:
    nodes = {n.name: n for n in inventory_nodes(str(write(tmp_path, "hosts", INI)), None)}
    # gpu's vars win over those of its parent group cluster
    assert nodes["node01"].endpoint.uri() == "ssh://ops@node01:22:3477"
    # the host's own user wins over its groups'; host:port is the SSH port
    assert nodes["node9"].endpoint.uri() == "ssh://admin@10.0.0.9:2222:3476"
    assert nodes["dgx-a.dc1"].endpoint.uri() == "http://dgx-a.dc1:3476"
    assert list(nodes)[:2] == ["lonely", "node01"]  # file order


def test_a_local_connection_is_the_agent_on_localhost_at_its_port(tmp_path: Path) -> None:
    text = "here ansible_connection=local\nthere ansible_connection=local " + (
        "nvidia_docker_agent_listen_port=3477\n"
    )
    nodes = {n.name: n for n in inventory_nodes(str(write(tmp_path, "hosts", text)), None)}
    assert nodes["here"].endpoint.uri() == "http://localhost:3476"  # the agent's default port
    assert nodes["there"].endpoint.uri() == "http://localhost:3477"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hosts", "[gpu]\nnode1:2222\n[fd00::5]:2223\nfd00::6\n"),
        ("hosts.yml", "gpu:\n  hosts:\n    node1:2222:\n    '[fd00::5]:2223':\n    fd00::6:\n"),
    ],
)
def test_a_host_with_a_port_in_ini_and_yaml_as_ansible_reads_it(
    tmp_path: Path, name: str, text: str
) -> None:
    # ansible-inventory: hosts node1 (ansible_port 2222), fd00::5 (2223) and fd00::6
    nodes = inventory_nodes(str(write(tmp_path, name, text)), None)
    assert [(n.name, n.endpoint.uri()) for n in nodes] == [
        ("node1", "ssh://alice@node1:2222:3476"),
        ("fd00::5", "ssh://alice@[fd00::5]:2223:3476"),
        ("fd00::6", "ssh://alice@[fd00::6]:22:3476"),
    ]


def test_yaml_endpoints_and_limit(tmp_path: Path) -> None:
    path = str(write(tmp_path, "hosts.yaml", YAML))
    nodes = inventory_nodes(path, "gpu:!h200")
    assert [n.name for n in nodes] == ["node2", "node3", "node9"]
    assert nodes[2].endpoint.uri() == "ssh://ops@10.0.0.9:2222:3476"
    assert [n.name for n in inventory_nodes(path, "node[12]")] == ["node1", "node2"]
    with pytest.raises(InventoryError, match="--limit 'gpu:&other' selects no hosts"):
        inventory_nodes(path, "gpu:&other")  # no host is in both
    assert [n.name for n in inventory_nodes(path, "other,head")] == ["head", "x"]


def test_limit_names_an_unknown_group(tmp_path: Path) -> None:
    path = str(write(tmp_path, "hosts.yml", YAML))
    with pytest.raises(InventoryError, match=r"--limit 'gpus': no such group or host.*gpu"):
        inventory_nodes(path, "gpus")


def test_endpoint_variable_and_bad_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "hosts",
        "a nvidia_docker_endpoint=ssh://root@10.0.0.1:2200:80\nb nvidia_docker_transport=telnet\n",
    )
    with pytest.raises(
        InventoryError, match=r"host b: nvidia_docker_transport must be ssh, http or https"
    ):
        inventory_nodes(str(path), None)
    assert inventory_nodes(str(path), "a")[0].endpoint.uri() == "ssh://root@10.0.0.1:2200:80"
    path.write_text("c nvidia_docker_agent_listen_port=99999\n")
    with pytest.raises(
        InventoryError, match=r"host c: nvidia_docker_agent_listen_port must be a port"
    ):
        inventory_nodes(str(path), None)
    path.write_text("d ansible_host='{{ inventory_hostname }}.mgmt'\n")
    with pytest.raises(InventoryError, match=r"host d: ansible_host is a Jinja2 template"):
        inventory_nodes(str(path), None)


def test_endpoints_pasted_with_a_trailing_slash(tmp_path: Path) -> None:
    """A URL with its root path, in a nodes file or in nvidia_docker_endpoint: the same node
    as without it; another path names the host and the refusal."""
    nodes = write(tmp_path, "nodes", "http://10.0.0.5:3476/\nhttps://node1:3476/  # pasted\n")
    assert [(n.name, n.endpoint.uri()) for n in file_nodes(str(nodes))] == [
        ("http://10.0.0.5:3476/", "http://10.0.0.5:3476"),
        ("https://node1:3476/", "https://node1:3476"),
    ]
    yaml = "all:\n  hosts:\n    gpu01:\n      nvidia_docker_endpoint: {}\n"
    path = write(tmp_path, "hosts.yml", yaml.format("http://10.0.0.5:3476/"))
    assert inventory_nodes(str(path), None)[0].endpoint.uri() == "http://10.0.0.5:3476"
    path.write_text(yaml.format("http://10.0.0.5:3476/v1"))
    with pytest.raises(InventoryError, match=r"host gpu01: invalid .*a path is not allowed"):
        inventory_nodes(str(path), None)


def test_link_local_hosts_keep_their_zone(tmp_path: Path) -> None:
    """ansible_host with its zone, as Ansible reads it and hands it to ssh (``fe80::1%eth0``;
    Ansible refuses a zone in a host's name); nvidia_docker_endpoint in the NV_HOST grammar,
    RFC 6874's ``%25`` too."""
    text = (
        "gpu01 ansible_host=fe80::1%eth0 ansible_port=2222\n"
        "gpu02 ansible_host=[fe80::2%eth1] nvidia_docker_transport=https\n"
        "gpu03 nvidia_docker_endpoint=http://[fe80::3%25eth0]:3476/\n"
    )
    nodes = inventory_nodes(str(write(tmp_path, "hosts", text)), None)
    assert [(n.name, n.endpoint.host, n.endpoint.uri()) for n in nodes] == [
        ("gpu01", "fe80::1%eth0", "ssh://alice@[fe80::1%25eth0]:2222:3476"),
        ("gpu02", "fe80::2%eth1", "https://[fe80::2%25eth1]:3476"),
        ("gpu03", "fe80::3%eth0", "http://[fe80::3%25eth0]:3476"),
    ]
    assert nodes[1].endpoint.server_name == "fe80::2"


def test_ini_lines_of_an_ipv6_host_and_its_port(tmp_path: Path) -> None:
    """``[IPv6]:port`` opens a host line, not a section; a zone too (Ansible refuses that in
    a host's name, as in YAML's host keys, which this reader takes as well)."""
    nodes = inventory_nodes(str(write(tmp_path, "hosts", IPV6_INI + "[fe80::1%eth0]:22\n")), None)
    assert [n.endpoint.uri() for n in nodes] == [
        "ssh://alice@[fd00::1:2:3]:22:3476",
        "ssh://alice@[fd00::5]:2222:3476",
        "ssh://alice@[2001:db8::1]:2200:3476",
        "http://[fd00::9]:3476",
        "ssh://alice@[fe80::1%25eth0]:22:3476",
    ]
    (tmp_path / "hosts").write_text("[fd00::9]\n")
    with pytest.raises(InventoryError, match=r"line 1: bad section header '\[fd00::9\]'"):
        inventory_nodes(str(tmp_path / "hosts"), None)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("h.yml", "all:\n  hosts:\n    - node1\n", "h.yml, line 3: the hosts of group 'all' must"),
        ("h.yml", "all:\n  hosts: [\n", "h.yml, line 3: not valid YAML"),
        ("h.yml", "all:\n  hostz:\n    a:\n", "h.yml, line 3: unexpected key 'hostz'"),
        ("h.yml", "- a\n- b\n", "h.yml, line 1: the top level must be a mapping"),
        ("h.json", '{"all": {"hosts": ', "h.json, line 1: not valid JSON"),
        ("h", "[gpu\nnode1\n", "h, line 1: bad section header"),
        ("h", "[gpu:kids]\nnode1\n", "h, line 1: unknown section kind :kids"),
        ("h", "[gpu]\nnode[3:1]\n", "h, line 2: empty host range"),
        ("h", "[gpu]\nnode[01:100]\n", "h, line 2: range 01:100"),
        ("h", "[gpu]\nnode1 port\n", "h, line 2: expected key=value after the host name"),
        ("h", "[gpu:vars]\nx=1\n", "h, line 1: [gpu:vars] for a group that is never defined"),
        ("h", "[a:children]\nb\n[b:children]\na\n", "groups contain each other: a -> b -> a"),
        ("h", "[gpu:vars]\njust words\n", "h, line 2: expected key=value in [gpu:vars]"),
        ("h", "#!/bin/sh\necho {}\n", "h: is a script; give its output instead"),
    ],
)
def test_malformed_inventory_names_file_and_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    assert str(caught.value).startswith(f"inventory {tmp_path}/")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="cannot read it: No such file"):
        load_inventory(tmp_path / "nope")
    with pytest.raises(InventoryError, match=r"is a directory.*ansible-inventory"):
        load_inventory(tmp_path)


def test_ranges() -> None:
    assert expand_range("node[01:03]") == ["node01", "node02", "node03"]
    assert expand_range("r[a:c]n[1:2]") == ["ran1", "ran2", "rbn1", "rbn2", "rcn1", "rcn2"]
    assert expand_range("n[0:6:3]") == ["n0", "n3", "n6"]
    assert expand_range("plain") == ["plain"]
    with pytest.raises(ValueError, match="bad host range"):
        expand_range("n[1:x]")


def test_nodes_file(tmp_path: Path) -> None:
    path = write(tmp_path, "nodes", "# rack 7\nnode1:\n\n  ssh://admin@node2:  # spare\n")
    nodes = file_nodes(str(path))
    assert [(n.name, n.endpoint.uri()) for n in nodes] == [
        ("node1:", "http://node1:3476"),
        ("ssh://admin@node2:", "ssh://admin@node2:22:3476"),
    ]
    path.write_text("node1:\nftp://node3\n")
    with pytest.raises(ControllerError, match=r"nodes file .*nodes, line 2: invalid remote host"):
        file_nodes(str(path))
    path.write_text("node1: node2:\n")
    with pytest.raises(ControllerError, match=r"line 1: one node per line"):
        file_nodes(str(path))


def test_a_nodes_file_without_nodes_is_a_usage_error_not_an_all_clear(tmp_path: Path) -> None:
    # `health --nodes FILE` on a file a script left empty asked nothing and exited 0, the
    # same as a fleet with no problem; an inventory without hosts is refused the same way
    from controller.ctl.main import main  # noqa: PLC0415
    from tests.support.cli import cli_runner  # noqa: PLC0415

    path = write(tmp_path, "nodes", "# rack 7, emptied\n\n")
    done = cli_runner().invoke(main, ["health", "--nodes", str(path)], env={"NV_HOST": ""})
    assert done.exit_code == 2
    assert done.stdout == ""
    assert f"Error: nodes file {path}: no node in it" in done.stderr
