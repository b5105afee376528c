"""``nvidia-docker-start-hook``: Podman's start gate, an OCI runtime hook (docs/leases.md).

Podman has no authorization plugins, but its OCI runtime runs the hooks of
``/etc/containers/oci/hooks.d`` before a container's process starts, at every ``podman run``
and ``podman start``, and a hook that exits non-zero stops that start with its standard
error in Podman's message. This one asks the agent, as dockerd's authorization plugin
does, whether the lease table lets the container start:

1. reads the container's state on standard input (``id``, ``bundle``) and the bundle's
   ``config.json``: the NVIDIA device nodes it is given (``linux.devices``: paths under
   ``/dev/nvidia``, or NVIDIA's major 195) and its ``nvidia-docker.*`` annotations (the
   wrapper gives Podman's containers the lease's labels as annotations too);
2. a container given no NVIDIA device starts at once: the agent is not asked;
3. else posts them to the agent's plugin socket (``POST /NvidiaDocker.MayStart``,
   ``plugin.authz.hook_ask_of``) and exits 1 with the agent's line when it refuses:
   ``Error: OCI runtime error: ... stderr: nvidia-docker: container 3f2a1b9c0d4e may not
   start: it names GPUs leased to others: GPU 3 by container ...``.

It fails open: an agent that does not answer within ``--timeout`` (its socket gone, the agent
stopped for an upgrade), an agent without the route, or an answer that is not the protocol
lets the container start, with one line on standard error (which the runtime shows only
when a hook fails). A call that is not a runtime's (no state on standard input, a bundle
without a readable ``config.json``) exits 1.

The runtime runs hooks with an empty environment: the socket is named by ``--socket``.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os.path
import socket
import sys
import time
from collections.abc import Mapping, Sequence

PROG = "nvidia-docker-start-hook"
DEFAULT_SOCKET = "/run/docker/plugins/nvidia-docker.sock"
ROUTE = "/NvidiaDocker.MayStart"
MEDIA_TYPE = "application/vnd.docker.plugins.v1.2+json"
DEFAULT_TIMEOUT_S = 5.0
NVIDIA_MAJOR = 195
ANNOTATION_PREFIX = "nvidia-docker."
MAX_ANSWER_BYTES = 64 * 1024


class HookError(Exception):
    """The hook was not called as a runtime calls it: one line, exit status 1."""


def read_ask(state_text: str) -> dict[str, object] | None:
    """The agent's ask for the container of an OCI state: ``{"Id", "Devices",
    "Annotations"}``; None when its config gives it no NVIDIA device."""
    try:
        state = json.loads(state_text)
        container, bundle = state["id"], state["bundle"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise HookError(
            "no OCI container state with an 'id' and a 'bundle' on standard input"
        ) from None
    if not isinstance(container, str) or not isinstance(bundle, str):
        raise HookError("the OCI container state's 'id' and 'bundle' are not strings")
    path = os.path.join(bundle, "config.json")
    try:
        with open(path, encoding="utf-8") as config_file:
            config = json.load(config_file)
        linux = config.get("linux") or {}
        raw_devices = linux.get("devices") or []
        raw_annotations = config.get("annotations") or {}
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        raise HookError(f"cannot read {path}: {err}") from None
    if not isinstance(raw_devices, list):
        raise HookError(f"cannot read {path}: its linux.devices is not a list")
    devices = [
        {"Path": d["path"], "Major": d.get("major"), "Minor": d.get("minor")}
        for d in raw_devices
        if isinstance(d, dict) and _is_nvidia(d)
    ]
    if not devices:
        return None
    annotations = (
        {
            key: value
            for key, value in raw_annotations.items()
            if isinstance(key, str) and key.startswith(ANNOTATION_PREFIX)
        }
        if isinstance(raw_annotations, dict)
        else {}
    )
    return {"Id": container, "Devices": devices, "Annotations": annotations}


def _is_nvidia(device: Mapping[str, object]) -> bool:
    path = device.get("path")
    if not isinstance(path, str):
        return False
    return path.startswith("/dev/nvidia") or device.get("major") == NVIDIA_MAJOR


def ask_agent(socket_path: str, ask: Mapping[str, object], timeout_s: float) -> str | None:
    """The agent's refusal of ``ask`` (its line), or None: allowed. ``OSError`` and
    ``ValueError`` when there is no answer that says either, ``TimeoutError`` (an
    ``OSError``) when the whole exchange, connect to last byte, takes over ``timeout_s``.

    One HTTP/1.0 request on the unix socket, its answer read to the end (the agent closes
    it), written here rather than through ``http.client``, whose imports (the ``email``
    package) took 30 ms of each hook's run on the development machine: a GPU container's
    start pays for every millisecond of this program."""
    body = json.dumps(ask).encode()
    head = (
        f"POST {ROUTE} HTTP/1.0\r\nHost: nvidia-docker\r\nContent-Type: application/json\r\n"
        f"Accept: {MEDIA_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    raw = bytearray()
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_left(deadline))
        sock.connect(socket_path)
        sock.settimeout(_left(deadline))
        sock.sendall(head + body)
        while True:
            sock.settimeout(_left(deadline))
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
            if len(raw) > MAX_ANSWER_BYTES:
                raise ValueError(
                    f"the answer to POST {ROUTE} is larger than {MAX_ANSWER_BYTES} bytes"
                )
    status_line, _, rest = bytes(raw).partition(b"\r\n")
    _, _, content = rest.partition(b"\r\n\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ValueError("not an HTTP answer")
    status = int(parts[1])
    if status == 404:
        raise ValueError("the agent has no start gate (an agent older than the hook?)")
    if status != 200:
        raise ValueError(f"HTTP {status} to POST {ROUTE}")
    answer = json.loads(content)
    if not isinstance(answer, dict) or not isinstance(answer.get("Allow"), bool):
        raise ValueError(f"the answer to POST {ROUTE} has no Allow")
    if answer.get("Err"):
        raise ValueError(f"the agent took the ask as a bad one: {answer['Err']}")
    if answer["Allow"]:
        return None
    return str(answer.get("Msg") or "refused by the lease table")


def _left(deadline: float) -> float:
    """Seconds left until ``deadline``; ``TimeoutError`` once none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(errno.ETIMEDOUT, "timed out")
    return left


def _seconds(text: str) -> float:
    """``--timeout``: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An OCI runtime hook: asks the nvidia-docker agent whether a container "
        "may start on the GPUs it is given (Podman's start gate).",
    )
    parser.add_argument(
        "--socket",
        default=DEFAULT_SOCKET,
        help=f"the agent's plugin socket (default: {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the agent's answer before allowing the start "
        f"(default: {DEFAULT_TIMEOUT_S:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``nvidia-docker-start-hook``."""
    args = _parser().parse_args(argv)
    try:
        ask = read_ask(sys.stdin.read())
    except HookError as err:
        sys.stderr.write(f"{PROG}: {err}\n")
        return 1
    if ask is None:
        return 0
    try:
        refusal = ask_agent(args.socket, ask, args.timeout)
    except (OSError, ValueError) as err:
        why = (
            err.strerror
            if isinstance(err, OSError) and err.strerror
            else str(err) or type(err).__name__
        )
        sys.stderr.write(f"{PROG}: allowed without the agent's answer ({args.socket}): {why}\n")
        return 0
    if refusal is None:
        return 0
    sys.stderr.write(f"nvidia-docker: {refusal}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
