"""Which nodes a fleet command asks: NODE arguments, a nodes file, an Ansible inventory.

- A NODE argument or a nodes-file line is an address in the ``NV_HOST`` grammar
  (``node1:``, ``http://10.0.0.1:3476``, ``ssh://admin@node2:``); the node's name is the
  text as written. Nodes files take one per line; ``#`` starts a comment; blank lines are
  skipped; ``-`` reads standard input.
- An inventory host becomes an endpoint from its variables (``inventory_endpoint``).

``user`` is the SSH login of nodes that name none, ``home`` what ``~`` means in an
inventory's paths: both the edge's (``Options``). Every mistake raises ``UsageError`` (the
inventory's: ``InventoryError``) with one line naming the file and line or host.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from controller.env_text import expand_home
from controller.errors import EndpointError, UsageError
from controller.fleet.inventory import InventoryError, InventoryHost, load_inventory
from controller.fleet.query import FleetNode
from controller.transport.endpoint import DEFAULT_HTTP_PORT, DEFAULT_SSH_PORT, Endpoint
from controller.transport.endpoint import parse_endpoint as _parse
from controller.transport.tls import TlsOptions

TRANSPORT_VAR = "nvidia_docker_transport"  # ssh (default) | http | https
PORT_VAR = "nvidia_docker_agent_listen_port"  # the Ansible role's variable: the agent's HTTP port
ENDPOINT_VAR = "nvidia_docker_endpoint"  # a whole NV_HOST address, wins over the rest
INVENTORY_TRANSPORTS = ("ssh", "http", "https")
# The role's variables that turn TLS on for an agent (docs/ansible.md).
ROLE_TLS_VARS = ("nvidia_docker_agent_tls_cert", "nvidia_docker_agent_tls_cert_content")
# The client's TLS and token for a host; each falls back to the role's variable of the same
# meaning when that one is a plain path (the role's CA checks the agents' certificates too).
TLS_VARS = {
    "ca": ("nvidia_docker_tls_ca", "nvidia_docker_agent_tls_ca"),
    "cert": ("nvidia_docker_tls_cert", None),
    "key": ("nvidia_docker_tls_key", None),
    "token_file": ("nvidia_docker_token_file", "nvidia_docker_agent_token_file"),
}

_Bad = Callable[[str], InventoryError]


def nodes_from_arguments(values: Iterable[str], user: str) -> list[FleetNode]:
    nodes = []
    for value in values:
        try:
            nodes.append(FleetNode(value, _parse(value, source="NODE", user=user)))
        except EndpointError as exc:
            raise UsageError(f"NODE {exc}") from None
    return nodes


def nodes_from_file(path: str, user: str) -> list[FleetNode]:
    """One node per line (``NV_HOST`` grammar); ``#`` comments; ``-`` is standard input."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"nodes file {path}: cannot read it: {why}") from None
    nodes = []
    for number, line in enumerate(text.splitlines(), start=1):
        value = line.split("#", 1)[0].strip()
        if not value:
            continue
        if len(value.split()) > 1:
            raise UsageError(f"nodes file {path}, line {number}: one node per line, got {value!r}")
        try:
            nodes.append(FleetNode(value, _parse(value, source=f"{path}:{number}", user=user)))
        except EndpointError as exc:
            raise UsageError(f"nodes file {path}, line {number}: {exc}") from None
    return nodes


def nodes_from_inventory(path: str, limit: str | None, user: str, home: str) -> list[FleetNode]:
    inventory = load_inventory(path)
    hosts = inventory.select(limit)
    if not hosts:
        what = f"--limit {limit!r} selects" if limit else "it lists"
        raise InventoryError(f"inventory {path}: {what} no hosts")
    return [
        FleetNode(
            h.name,
            inventory_endpoint(h, path, user),
            _identity(h, home),
            inventory_tls(h, path, home),
        )
        for h in hosts
    ]


def inventory_tls(host: InventoryHost, path: str, home: str) -> TlsOptions | None:
    """A host's CA, client certificate and token file (``TLS_VARS``), None when none is set."""

    def bad(message: str) -> InventoryError:
        return InventoryError(f"inventory {path}, host {host.name}: {message}")

    values: dict[str, str | None] = {}
    for field_name, (own, role) in TLS_VARS.items():
        value = _text(host.vars, own, bad, "") if own in host.vars else ""
        if not value and role is not None and role in host.vars and not _template(host.vars[role]):
            value = _text(host.vars, role, bad, "")
        values[field_name] = expand_home(value, home) if value else None
    if not any(values.values()):
        return None
    return TlsOptions(
        ca=values["ca"], cert=values["cert"], key=values["key"], token_file=values["token_file"]
    )


def inventory_endpoint(host: InventoryHost, path: str, user: str) -> Endpoint:
    """Where a host's agent answers, from its inventory variables.

    ``nvidia_docker_endpoint`` (an ``NV_HOST`` address) wins. Otherwise the address is
    ``ansible_host`` (else the inventory name), the transport ``nvidia_docker_transport``
    (``ssh``, the default: what reaches Ansible reaches the agent, which may listen on the
    node's localhost only; ``http``; or ``https``, the agent serving TLS, as it does on every
    address, and so inside an SSH tunnel too, when the role's ``nvidia_docker_agent_tls_cert``
    is set), the agent's port ``nvidia_docker_agent_listen_port``, and
    over SSH ``ansible_port`` and ``ansible_user`` as Ansible uses them (else ``user``).
    """
    variables = host.vars

    def bad(message: str) -> InventoryError:
        return InventoryError(f"inventory {path}, host {host.name}: {message}")

    if ENDPOINT_VAR in variables:
        value = _text(variables, ENDPOINT_VAR, bad)
        try:
            return _parse(value, source=f"{ENDPOINT_VAR} of {host.name}", user=user)
        except EndpointError as exc:
            raise bad(str(exc)) from None
    if variables.get("ansible_connection") == "local":
        http_port = _port(variables, PORT_VAR, DEFAULT_HTTP_PORT, bad)
        return Endpoint("http", "localhost", http_port=http_port)
    transport = _text(variables, TRANSPORT_VAR, bad, "ssh").lower()
    if transport not in INVENTORY_TRANSPORTS:
        raise bad(f"{TRANSPORT_VAR} must be ssh, http or https, not {transport!r}")
    address = _text(variables, "ansible_host", bad, "") or _text(
        variables, "ansible_ssh_host", bad, host.name
    )
    if address.startswith("[") and address.endswith("]"):
        address = address[1:-1]
    if not address or any(c.isspace() for c in address) or "/" in address:
        raise bad(f"bad address {address!r} in ansible_host")
    http_port = _port(variables, PORT_VAR, DEFAULT_HTTP_PORT, bad)
    # the role installs a certificate: its agent serves TLS only, on every address
    # set at all is enough: its value, often a template (pki/{{ inventory_hostname }}.pem), is
    # the role's to read
    role_tls = any(_set(variables.get(v)) for v in ROLE_TLS_VARS)
    if transport in ("http", "https"):
        tls = transport == "https" or role_tls
        return Endpoint("http", address, http_port=http_port, source=path, tls=tls)
    ssh_port = _port(variables, "ansible_port", 0, bad) or _port(
        variables, "ansible_ssh_port", DEFAULT_SSH_PORT, bad
    )
    login = _text(variables, "ansible_user", bad, "") or _text(
        variables, "ansible_ssh_user", bad, ""
    )
    return Endpoint(
        "ssh",
        address,
        ssh_port=ssh_port,
        http_port=http_port,
        user=login or user,
        source=path,
        tls=role_tls,
    )


def _identity(host: InventoryHost, home: str) -> str | None:
    value = host.vars.get("ansible_ssh_private_key_file") or host.vars.get(
        "ansible_private_key_file"
    )
    return expand_home(str(value), home) if value else None


def _template(value: Any) -> bool:
    """A Jinja2 template, which this tool does not evaluate."""
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _set(value: Any) -> bool:
    """A role variable given a value (the role's defaults are empty strings)."""
    return value is not None and value is not False and str(value).strip() != ""


def _text(variables: Mapping[str, Any], key: str, bad: _Bad, default: str | None = None) -> str:
    value = variables.get(key, default)
    if value is None:
        raise bad(f"{key} is not set")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise bad(f"{key} must be a string, not {value!r}")
    text = str(value).strip()
    if "{{" in text or "{%" in text:
        raise bad(
            f"{key} is a Jinja2 template ({text!r}), which this tool does not evaluate; "
            "set the value itself"
        )
    return text


def _port(variables: Mapping[str, Any], key: str, default: int, bad: _Bad) -> int:
    value = variables.get(key)
    if value is None or value == "":
        return default
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 0 < int(text) < 65536:
        raise bad(f"{key} must be a port number (1 to 65535), not {value!r}")
    return int(text)
