"""``nvidia-docker-ctl endpoint [VALUE]``: which node and route ``nvidia-docker`` would use."""

from __future__ import annotations

import json
import os

import click

from controller.errors import EndpointError
from controller.transport.endpoint import parse_endpoint, resolve


@click.command()
@click.argument("value", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the endpoint as one JSON object.")
def endpoint(value: str | None, as_json: bool) -> None:
    """Show the node behind VALUE (an NV_HOST value or a node name).

    Without VALUE: the node nvidia-docker would ask in this environment (NV_HOST, else
    DOCKER_HOST, else the local node).
    """
    warning = None
    try:
        if value is None:
            chosen, warning = resolve(os.environ)
        else:
            chosen = parse_endpoint(value)
    except EndpointError as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(chosen.as_dict(), sort_keys=True))
    else:
        click.echo(chosen.describe())
    if warning:
        click.echo(f"Warning: {warning}", err=True)
