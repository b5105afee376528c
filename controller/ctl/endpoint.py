"""``nvidia-docker-ctl endpoint [VALUE]``: which node and route ``nvidia-docker`` would use."""

from __future__ import annotations

import json
import os

import click

from controller.errors import EndpointError
from controller.transport.endpoint import Endpoint, default_user, parse_endpoint, resolve


def _ssh_route(chosen: Endpoint) -> str | None:
    """Where an SSH node really is, after ~/.ssh/config (HostName, User, Port, ProxyJump)."""
    if chosen.transport != "ssh":
        return None
    from controller.transport.ssh_config import config_path, resolve_route  # noqa: PLC0415

    try:
        return resolve_route(chosen, config_path(os.environ), default_user()).describe()
    except EndpointError as err:
        raise click.ClickException(str(err)) from None


@click.command()
@click.argument("value", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the endpoint as one JSON object.")
def endpoint(value: str | None, as_json: bool) -> None:
    """Show the node behind VALUE (an NV_HOST value or a node name).

    Without VALUE: the node nvidia-docker would ask in this environment (NV_HOST, else
    docker's address: DOCKER_HOST, DOCKER_CONTEXT or the current docker context, else the
    local node). SSH nodes also show their route after ~/.ssh/config (ssh_route).
    """
    warning = None
    try:
        if value is None:
            chosen, warning = resolve(os.environ)
        else:
            chosen = parse_endpoint(value)
    except EndpointError as err:
        raise click.ClickException(str(err)) from None
    route = _ssh_route(chosen)
    if as_json:
        fields = chosen.as_dict()
        if route is not None:
            fields["ssh_route"] = route
        click.echo(json.dumps(fields, sort_keys=True))
    else:
        click.echo(chosen.describe())
        if route is not None:
            click.echo(f"{'ssh_route':<10} {route}")
    if warning:
        click.echo(f"Warning: {warning}", err=True)
