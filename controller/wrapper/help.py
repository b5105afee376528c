"""What ``nvidia-docker --help`` prints before docker's own help: what the wrapper adds.

The variables and their help come from ``controller.options``' declarations (those the
wrapper reads), so this text cannot drift from what the wrapper does.
"""

from __future__ import annotations

from controller.options import brief, environment_help, help_rows

INTRO = """\
nvidia-docker: docker, with GPUs for the containers of images that ask for them.
Only `run` and `create` change, and only for an image labelled com.nvidia.volumes.needed:
the GPU devices and the driver volume are added (or, when the engine reads CDI: Podman 4+,
Docker 25+ with CDI on, --device=nvidia.com/gpu=<UUID>), then docker runs in its place.
NV_GPU=auto[:N] and docker's --gpus N|all|device=... lease free GPUs from the node's agent
first, for any image: the container gets them, the lease's labels and their NUMA cpuset.
Everything else is docker's own; `version` prints ours first.

"""
OUTRO = """\
Errors: one line, "nvidia-docker | <date> <time> Error: <message>", exit code 1.
More: docs/nvidia-docker.md. Docker's own help follows.

"""
GROUPED = (("TLS", ("NV_TLS_", "NV_TOKEN_")), ("SSH", ("NV_SSH_",)), ("docker", ("DOCKER_",)))


def wrapper_help() -> str:
    """The section, ending with a blank line."""
    rows = environment_help(wrapper=True)
    own = [(n, t) for n, t in rows if not any(n.startswith(p) for _, ps in GROUPED for p in ps)]
    table = [(name, brief(text)) for name, text in own]
    for label, prefixes in GROUPED:
        table.append((label + ":", ", ".join(n for n, _ in rows if n.startswith(prefixes))))
    lines = [INTRO, *(line + "\n" for line in help_rows(table, 2))]
    lines.append("\n" + OUTRO)
    return "".join(lines)
