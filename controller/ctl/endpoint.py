"""``nvidia-docker-ctl endpoint [VALUE]``: which node and route ``nvidia-docker`` would use."""

from __future__ import annotations

import json

import click

from controller.ctl.flags import operator_options
from controller.options import Options
from controller.transport.endpoint import Endpoint, parse_endpoint, resolve

PROG = "nvidia-docker-ctl"


def _ssh_route(chosen: Endpoint, options: Options) -> str | None:
    """Where an SSH node really is, after ~/.ssh/config (HostName, User, Port, ProxyJump)."""
    if chosen.transport != "ssh":
        return None
    from controller.transport.ssh_config import resolve_route  # noqa: PLC0415

    return resolve_route(chosen, options.ssh_config, options.user, options.home).describe()


@click.command()
@click.argument("value", required=False)
@operator_options("output:json")
def endpoint(value: str | None, options: Options) -> None:
    """Show the node behind VALUE (an NV_HOST value or a node name).

    Without VALUE: the node nvidia-docker would ask in this environment (NV_HOST, else
    docker's address: DOCKER_HOST, DOCKER_CONTEXT or the current docker context, else the
    local node). SSH nodes also show their route after ~/.ssh/config (ssh_route). A VALUE
    that is not the NV_HOST grammar is a usage error (exit 2).
    """
    warning = None
    if value is None:
        chosen, warning = resolve(options)
    else:
        chosen = parse_endpoint(value, user=options.user)
    route = _ssh_route(chosen, options)
    if options.output == "json":
        fields = chosen.as_dict()
        if route is not None:
            fields["ssh_route"] = route
        click.echo(json.dumps(fields, sort_keys=True))
    else:
        click.echo(chosen.describe())
        if route is not None:
            click.echo(f"{'ssh_route':<10} {route}")
    if warning:
        from controller.ctl.main import say  # noqa: PLC0415

        say("Warning", warning)
