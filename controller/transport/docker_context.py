"""Which daemon address a docker command line means, contexts included, as the docker CLI decides.

``docker_address(options, host_option, context_option)`` returns the address docker itself
would use and where it came from, or None for the local daemon. Docker's order (the CLI's
``resolveContextName``):

1. ``--context NAME`` (``-c``) on the command line;
2. ``-H``/``--host`` on the command line (the default context with that host);
3. ``DOCKER_HOST`` (the default context);
4. ``DOCKER_CONTEXT``;
5. ``currentContext`` in ``config.json`` (``docker context use NAME``);
6. the default context: the local daemon.

A context's address is ``Endpoints.docker.Host`` of its ``meta.json``, which docker keeps in
``$DOCKER_CONFIG/contexts/meta/<sha256 of the name>/meta.json`` (``DOCKER_CONFIG`` defaults to
``~/.docker``; the edge's ``Options`` carry both, ``DOCKER_HOST`` and ``DOCKER_CONTEXT``).
Reading the file costs no process start (``docker context inspect`` would cost
tens of milliseconds on every ``nvidia-docker run``). The context named ``default`` is
``DOCKER_HOST`` or the local daemon. A context that does not exist is an ``EndpointError``
naming it, as docker refuses it too.
"""

from __future__ import annotations

from controller import json_codec
from controller.errors import EndpointError

TYPE_CHECKING = False  # pathlib, hashlib: imported only to read a context's file
if TYPE_CHECKING:
    from pathlib import Path

    from controller.options import Options

DEFAULT_CONTEXT = "default"


def config_dir(options: Options) -> Path:
    """Docker's configuration directory: ``DOCKER_CONFIG``, else ``~/.docker``."""
    from pathlib import Path  # noqa: PLC0415 (see TYPE_CHECKING above)

    return Path(options.docker_config_dir)


def current_context(options: Options) -> str | None:
    """``currentContext`` of ``config.json`` (``docker context use``), if any."""
    path = _joined(options.docker_config_dir, "config.json")  # the local run reads it
    try:
        with open(path, encoding="utf-8") as file:
            data = json_codec.loads(file.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise EndpointError(f"docker configuration {path} cannot be read: {err}") from None
    name = data.get("currentContext") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name else None


def _joined(directory: str, name: str) -> str:
    """``str(pathlib.Path(directory) / name)`` without importing pathlib (with urllib.parse
    and fnmatch, about 3 ms): the path as pathlib spells it (no empty or ``.`` parts; a
    leading ``//`` kept, as POSIX allows), so that messages name it as pathlib would."""
    root = "//" if directory.startswith("//") and not directory.startswith("///") else ""
    root = root or ("/" if directory.startswith("/") else "")
    parts = [part for part in f"{directory}/{name}".split("/") if part and part != "."]
    return root + "/".join(parts)


def context_host(name: str, options: Options) -> str | None:
    """The docker address of context ``name`` (None: the local daemon)."""
    if name == DEFAULT_CONTEXT:
        return (options.docker_host or "").strip() or None
    import hashlib  # noqa: PLC0415 (a context's file only)

    digest = hashlib.sha256(name.encode()).hexdigest()
    path = config_dir(options) / "contexts" / "meta" / digest / "meta.json"
    try:
        meta = json_codec.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EndpointError(
            f"docker context {name!r} does not exist (in {config_dir(options)}); "
            "docker context ls lists them"
        ) from None
    except (OSError, ValueError) as err:
        raise EndpointError(f"docker context {name!r}: cannot read {path}: {err}") from None
    endpoints = meta.get("Endpoints") if isinstance(meta, dict) else None
    docker = endpoints.get("docker") if isinstance(endpoints, dict) else None
    host = docker.get("Host") if isinstance(docker, dict) else None
    if not isinstance(host, str) or not host.strip():
        return None
    return host.strip()


def docker_address(
    options: Options,
    host_option: str | None = None,
    context_option: str | None = None,
) -> tuple[str, str] | None:
    """(address, source) of the daemon docker would talk to, or None for the local one."""
    if context_option:
        host = context_host(context_option, options)
        return (host, f"docker context {context_option}") if host else None
    if host_option:
        return host_option, "-H"
    docker_host = (options.docker_host or "").strip()
    if docker_host:
        return docker_host, "DOCKER_HOST"
    name = (options.docker_context or "").strip() or current_context(options)
    if name:
        host = context_host(name, options)
        return (host, f"docker context {name}") if host else None
    return None
