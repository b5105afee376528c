"""``nvidia-docker-ctl``: operator commands that run off the node (Mesos flags, fleet queries).

Each command group lives in its own module and is added here with one line.
"""

from __future__ import annotations

import click

from controller.ctl.endpoint import endpoint
from controller.ctl.fleet import docker_cli, info, status
from controller.ctl.health import health
from controller.ctl.mesos import mesos


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Operate NVIDIA Docker GPU nodes: Mesos agent flags, fleet status, endpoints."""


main.add_command(mesos)
main.add_command(endpoint)
main.add_command(info)
main.add_command(status)
main.add_command(docker_cli)
main.add_command(health)

if __name__ == "__main__":
    main()
