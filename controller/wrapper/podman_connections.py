"""Where a Podman client talks to: the URL its options, variables and settings choose.

``destinations(options, env, settings, conf_files, uid)`` is the URL a client of Podman's
service (``podman-remote``, ``podman --remote``, ``--url``, ``--connection``; a containers.conf
with ``remote = true``) of user ``uid`` talks to, chosen as Podman 5 chooses it (its
``cmd/podman/root.go``, and containers/common's ``pkg/config/connections.go``,
``GetConnection``), read from a few small files without running Podman:

1. its options: ``--connection NAME`` (``-c``), else ``--url``, else ``--context NAME`` (not
   ``default``), else ``-H``/``--host`` (``--connection`` with ``--context``: Podman refuses);
2. its variables: ``CONTAINER_CONNECTION`` (a name), else ``CONTAINER_HOST``;
3. the default connection: ``Default`` in ``podman-connections.json``, else containers.conf's
   ``active_service``; where none is named, containers.conf's ``remote_uri`` (Podman 4 reads
   it, Podman 5 no longer does: both it and the default socket are given, either may be
   the one);
4. Podman's default socket: ``$XDG_RUNTIME_DIR/podman/podman.sock`` for a user, as Podman
   finds its runtime directory; ``/run/podman/podman.sock`` for root.

A connection's name is one of ``podman-connections.json`` (Podman 5's, written by ``podman
system connection add``: ``PODMAN_CONNECTIONS_CONF``, else beside the user's containers.conf;
its keys read as Go reads them, whatever their case), else a table
``[engine.service_destinations.NAME]`` of the containers.conf files (Podman 4's, read with
``tomllib``: a file that is not TOML names none, as Podman refuses it; a later file wins),
its ``URI`` (``uri``). A name given (option or variable) that is neither, or with a
connections file Podman cannot parse (not JSON, a value of another type, nested deeper than
the parser goes, over ``MAX_SETTINGS_BYTES``): Podman fails, and there is no URL (``[]``). A
default name that is neither, or such a file: Podman talks to its default socket.

What differs in Podman 4 and is not followed: ``CONTAINER_HOST`` before
``CONTAINER_CONNECTION``, and ``--context NAME`` before ``--url``.
"""

from __future__ import annotations

import os

from controller.wrapper import podman_labels

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

ROOT_SOCKET = "/run/podman/podman.sock"  # Podman's default service socket for root
CONNECTIONS_FILE = "podman-connections.json"  # Podman 5's connections, beside containers.conf
_ENGINE_KEYS = ("remote", "active_service", "remote_uri")  # containers.conf's, [engine]
_DESTINATIONS = ("engine", "service_destinations")  # containers.conf's table of connections


class _Unreadable(Exception):
    """A connections file Podman cannot parse."""


def engine_settings(conf_files: Sequence[str]) -> dict[str, str]:
    """What the containers.conf files (in Podman's order: a later one wins) set of
    ``remote``, ``active_service`` and ``remote_uri``."""
    settings: dict[str, str] = {}
    for file in conf_files:
        found = podman_labels.conf_values(file, _ENGINE_KEYS)
        settings.update((key, values[-1]) for key, values in found.items())
    return settings


def destinations(
    options: Mapping[str, str],
    env: Mapping[str, str],
    settings: Mapping[str, str],
    conf_files: Sequence[str],
    uid: int,
) -> list[str]:
    """The URL a Podman client of user ``uid`` talks to, with its global ``options`` (name:
    value), in ``env``, with containers.conf's ``settings`` (``engine_settings``) and files:
    one, or two where Podman 4 and 5 differ, or none where Podman fails (see the module
    docstring)."""
    if "connection" in options:
        return [] if "context" in options else _named(options["connection"], env, conf_files)
    if "url" in options:
        return [options["url"]]
    if options.get("context", "default") != "default":
        return _named(options["context"], env, conf_files)
    if "host" in options:
        return [options["host"]]
    if env.get("CONTAINER_CONNECTION"):
        return _named(env["CONTAINER_CONNECTION"], env, conf_files)
    if env.get("CONTAINER_HOST"):
        return [env["CONTAINER_HOST"]]
    socket = "unix:" + default_socket(env, uid)
    try:
        default, connections = _connections(env)
    except _Unreadable:
        return [socket]
    default = default or settings.get("active_service", "")
    if not default:
        remote_uri = settings.get("remote_uri")
        return [remote_uri, socket] if remote_uri else [socket]
    url = _uri(default, connections, conf_files)
    return [url if url is not None else socket]


def default_socket(env: Mapping[str, str], uid: int) -> str:
    """Podman's default service socket for ``uid``: root's, else in the runtime directory as
    Podman finds it (``XDG_RUNTIME_DIR``, else ``/run/user/<uid>`` where that is the
    user's, else ``$TMPDIR/podman-run-<uid>``)."""
    if uid == 0:
        return ROOT_SOCKET
    runtime = env.get("XDG_RUNTIME_DIR") or ""
    if not runtime:
        runtime = f"/run/user/{uid}"
        try:
            if os.stat(runtime).st_uid != uid:
                runtime = ""
        except OSError:
            runtime = ""
    if not runtime:
        runtime = os.path.join(env.get("TMPDIR") or "/tmp", f"podman-run-{uid}")
    return os.path.join(runtime, "podman", "podman.sock")


def _named(name: str, env: Mapping[str, str], conf_files: Sequence[str]) -> list[str]:
    """The URL of the connection ``name`` given; none where Podman fails on it."""
    try:
        _, connections = _connections(env)
    except _Unreadable:
        return []
    url = _uri(name, connections, conf_files)
    return [url] if url is not None else []


def _uri(name: str, connections: Mapping[str, str], conf_files: Sequence[str]) -> str | None:
    """The URI of connection ``name``: the connections file's, else containers.conf's
    ``[engine.service_destinations.NAME]`` (a later file wins); None: no such connection."""
    if name in connections:
        return connections[name]
    found = None
    for file in conf_files:
        found = _destination_uri(file, name) or found
    return found


def _destination_uri(path: str, name: str) -> str | None:
    """``[engine.service_destinations.NAME]``'s ``uri`` in the containers.conf at ``path``,
    read with ``tomllib`` (its first ``MAX_SETTINGS_BYTES``); None: not there, or a file
    that is not TOML (Podman refuses it too)."""
    import tomllib  # noqa: PLC0415 (a connection by name only: about 2 ms to import)

    try:
        with open(path, "rb") as file:
            data = file.read(podman_labels.MAX_SETTINGS_BYTES)
        table: object = tomllib.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return None
    for key in (*_DESTINATIONS, name):
        table = table.get(key) if isinstance(table, dict) else None
    uri = table.get("uri") if isinstance(table, dict) else None
    return uri if isinstance(uri, str) and uri else None


def _connections(env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Podman 5's connections file: its default connection's name (``""``: none) and its
    connections' URIs by name; none where there is no file; ``_Unreadable`` where Podman
    cannot parse it."""
    from controller import json_codec  # noqa: PLC0415 (a client without a URL only)

    if "PODMAN_CONNECTIONS_CONF" in env:  # set, even empty: that file
        path = env["PODMAN_CONNECTIONS_CONF"]
    else:
        config = podman_labels.user_config_dir(env)
        path = os.path.join(config, "containers", CONNECTIONS_FILE) if config else ""
    try:
        with open(path, "rb") as file:
            data = file.read(podman_labels.MAX_SETTINGS_BYTES + 1)
    except FileNotFoundError:
        return "", {}
    except OSError as error:
        raise _Unreadable from error
    if len(data) > podman_labels.MAX_SETTINGS_BYTES:
        raise _Unreadable
    try:
        found = json_codec.loads(data)
    except (ValueError, RecursionError) as error:  # nested deeper than the parser goes
        raise _Unreadable from error
    connection = _object(_field(_object(found), "Connection"))
    urls = {
        name: _string(_field(_object(destination), "URI"))
        for name, destination in _object(_field(connection, "Connections")).items()
    }
    return _string(_field(connection, "Default")), urls


def _field(value: Mapping[str, object], name: str) -> object:
    """Field ``name`` of a JSON object, as Go's encoding/json finds it for a struct's field:
    its key matched whatever its case, the last one found winning (None: not there)."""
    found = None
    for key, item in value.items():
        if key.lower() == name.lower():
            found = item
    return found


def _object(value: object) -> dict[str, object]:
    """A JSON object as Go decodes it into a struct or map (``null``: empty); any other
    value: ``_Unreadable``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Unreadable
    return value


def _string(value: object) -> str:
    """A JSON string as Go decodes it (``null``: empty); any other value: ``_Unreadable``."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _Unreadable
    return value
