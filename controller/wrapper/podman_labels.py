"""A Podman image's labels, remembered while Podman's image store is unchanged.

Why: Podman has no daemon the wrapper could ask, so the labels of a ``nvidia-docker run``'s
image (``gpu_args.image_labels``) cost one ``podman image inspect`` at every run, a Podman
start of about 27 ms on the 2-core development machine: more than the wrapper's own work
(docs/nvidia-docker.md, "Speed"). Podman (containers/storage) keeps the names and IDs of a
store's images in one file, ``<store>/<driver>-images/images.json``, and replaces it (a
new file renamed over the old) whenever an image is pulled, built, loaded, imported,
tagged, untagged or removed; an image's labels never change once it is built. So while that
file is the same file, the image a name means, and its labels, are the same.

``Memory.open(docker, global_args, environment)`` is the memory of one Podman setting: the
program (its real path and the identity of its file), its options (``NV_DOCKER``'s words
and the command's global options, ``--root`` and ``--storage-driver`` among them), the
user, the environment that moves Podman's files (``CONTAINERS_*``, ``XDG_*``, ``HOME``),
the identity of Podman's settings files (``containers.conf``, ``storage.conf``,
``registries.conf``, their ``.d`` directories and every file in those, the system's
``rootful``/``rootless`` drop-ins: where containers-config(5) says Podman reads them), and
the working directory where an option or one of those variables may name a relative path
(any option at all, or a relative value). None where nothing may be remembered: the command
is not a local ``podman`` (``podman-remote``, ``--remote``, ``--connection``, ``--url``,
``-H``/``--host``, ``--context``, ``CONTAINER_HOST``, ``sudo podman``, a containers.conf
with ``remote = true``), or the user has no cache directory. ``recall(image)``: the labels
remembered for that name with the store file's identity as it is now, else None.
``learn(image, printed)`` reads ``podman image inspect --format FORMAT``'s answer (the
labels, then ``GraphDriver``, whose ``UpperDir`` is ``<store>/<driver>/<layer>/diff``: the
store) and remembers the labels only when the store file was the same before that inspect
and after it (a first run learns where the store is; the next one remembers; the ones after
skip the inspect). The memory is a small JSON file of the user's (``user_cache``:
``podman-labels.json``).

What is not seen: a change made only in a read-only additional image store
(``additionalimagestores`` in ``storage.conf``) to an image the main store does not hold.
A ``podman rmi`` of the image, any change in the main store, and any settings file or
drop-in written, added or removed, are seen. ``NV_DEBUG=1`` says
where each run's labels came from.
"""

from __future__ import annotations

import os
import stat

from controller import json_codec
from controller.wrapper import cli_versions, docker_cli, user_cache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

FILE_NAME = "podman-labels.json"
FORMAT = "{{json .Config.Labels}}\n{{json .GraphDriver}}"
MAX_SETTINGS = 8  # Podman settings remembered (a user has one or two)
MAX_IMAGES = 64  # images remembered per setting
MAX_SETTINGS_BYTES = 1 << 20  # read at most this much of a settings file
REMEMBERED = "podman image inspect, remembered"
# Options and variables that send Podman to a service (possibly on another machine):
# what it prints then describes a store that is not this machine's.
_REMOTE_OPTIONS = (
    "--remote", "-r", "--connection", "-c", "--url", "-H", "--host", "--context", "--identity",
)  # fmt: skip
_REMOTE_VARIABLES = ("CONTAINER_HOST", "CONTAINER_CONNECTION")
# Variables that name one of Podman's settings files, and all that move its files or state.
_FILE_VARIABLES = (
    ("CONTAINERS_STORAGE_CONF", "storage"), ("CONTAINERS_CONF", "containers"),
    ("CONTAINERS_CONF_OVERRIDE", "containers"), ("CONTAINERS_REGISTRIES_CONF", "registries"),
    ("REGISTRIES_CONFIG_PATH", "registries"),
)  # fmt: skip
_VARIABLES = (
    *(name for name, _ in _FILE_VARIABLES),
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_RUNTIME_DIR",
    "HOME",
)
_SYSTEM_SETTINGS = ("/usr/share/containers", "/etc/containers")
_SETTINGS_KINDS = ("containers", "storage", "registries")


class Memory:
    """The remembered labels of one Podman setting (see the module docstring)."""

    def __init__(self, path: str, key: str, entries: dict[str, object]) -> None:
        self._path = path
        self._key = key
        self._entries = entries
        entry = entries.get(key)
        self._entry: dict[str, object] = entry if isinstance(entry, dict) else {}
        store = self._entry.get("store")
        self._store = store if isinstance(store, str) else None
        self._before = _stamp(self._store) if self._store is not None else None

    @classmethod
    def open(
        cls, docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
    ) -> Memory | None:
        """The memory of this Podman setting; None where nothing may be remembered (docker
        too)."""
        if not _local_podman(docker, global_args, environment):
            return None
        words = [*docker[1:], *global_args]
        path = user_cache.cache_file(environment, FILE_NAME)
        if path is None:
            return None
        try:
            program = os.path.realpath(docker_cli.found(docker[0], environment))
            identity = cli_versions.program_identity(program)
        except OSError:
            return None
        if identity is None:  # a script named podman: whatever it runs now
            return None
        euid = os.geteuid()
        variables = [environment.get(name) for name in _VARIABLES]
        settings, containers_conf = _settings_stamps(_settings_paths(environment, euid))
        # options or files that may name a path relative to here: a memory per directory
        relative = words or any(not os.path.isabs(environment.get(v) or "/") for v in _VARIABLES)
        here = os.getcwd() if relative else None
        key = json_codec.dumps([euid, program, identity, words, variables, settings, here])
        entries = user_cache.read(path)
        # containers.conf may make podman a client of a service (its store is the service's):
        # read once per setting, when it is learnt (a remembered one was read as it is now)
        if key not in entries and any(_says_remote(file) for file in containers_conf):
            return None
        return cls(path, key, entries)

    def recall(self, image: str) -> dict[str, str] | None:
        """The labels remembered for ``image`` with the store as it is now; else None."""
        if self._before is None:
            return None
        images = self._entry.get("images")
        known = images.get(image) if isinstance(images, dict) else None
        if not isinstance(known, dict) or known.get("stamp") != self._before:
            return None
        labels = known.get("labels")
        if not isinstance(labels, dict):
            return None
        return {str(name): str(value) for name, value in labels.items()}

    def learn(self, image: str, printed: str) -> dict[str, str]:
        """The labels in ``podman image inspect --format FORMAT``'s answer (``ValueError``
        where it is not that), remembered where the store stood still around it."""
        lines = printed.strip().split("\n")
        labels = json_codec.loads(lines[0] or "null") or {}
        if not isinstance(labels, dict):
            raise ValueError(f"labels that are not a mapping: {lines[0][:80]!r}")
        labels = {str(name): str(value) for name, value in labels.items()}
        # a store not found, or a memory that cannot be written: the next run asks
        try:  # noqa: SIM105 - contextlib is not imported on the run path
            self._remember(image, labels, _store_file(json_codec.loads(lines[1])))
        except (OSError, ValueError, IndexError):
            pass
        return labels

    def _remember(self, image: str, labels: dict[str, str], store: str | None) -> None:
        if store is None:
            return
        if store != self._store:  # where the store is, learnt: labels from the next run on
            self._save({"store": store, "images": {}})
            return
        if self._before is None or _stamp(store) != self._before:
            return
        images = self._entry.get("images")
        kept = {  # what was remembered of the store as it was before is no use
            name: known
            for name, known in (images.items() if isinstance(images, dict) else ())
            if name != image and isinstance(known, dict) and known.get("stamp") == self._before
        }
        kept[image] = {"stamp": self._before, "labels": labels}
        self._save({"store": store, "images": dict(list(kept.items())[-MAX_IMAGES:])})

    def _save(self, entry: dict[str, object]) -> None:
        entries = self._entries
        entries.pop(self._key, None)
        entries[self._key] = entry
        user_cache.write(self._path, dict(list(entries.items())[-MAX_SETTINGS:]))


def _stamp(path: str) -> list[int] | None:
    """The identity of the file or directory at ``path`` (None: not there)."""
    try:
        return user_cache.identity(os.stat(path))
    except OSError:
        return None


def _local_podman(
    docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
) -> bool:
    """``docker`` is ``podman`` itself, with no option or variable that sends it to a service
    (``sudo podman`` and ``podman-remote`` are not)."""
    if not docker or os.path.basename(docker[0]) != "podman":
        return False
    words = [*docker[1:], *global_args]
    if any(word.split("=", 1)[0] in _REMOTE_OPTIONS for word in words):
        return False
    return not any(environment.get(name) for name in _REMOTE_VARIABLES)


def containers_conf(environment: Mapping[str, str], uid: int) -> list[str]:
    """The containers.conf files the Podman of user ``uid`` reads in ``environment``, in
    Podman's order (see ``_settings_paths``; of a drop-in directory, its ``*.conf`` files)."""
    return _settings_stamps(_settings_paths(environment, uid))[1]


def user_config_dir(environment: Mapping[str, str]) -> str:
    """The user's configuration directory (``XDG_CONFIG_HOME``, else ``$HOME/.config``),
    as Podman finds it there; ``""`` where neither is an absolute path."""
    config = environment.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(config):
        home = environment.get("HOME") or ""
        config = os.path.join(home, ".config") if os.path.isabs(home) else ""
    return config


def _settings_paths(environment: Mapping[str, str], euid: int) -> list[tuple[str, str]]:
    """Podman's settings files and drop-in directories where this user's Podman reads them,
    each with its kind (``containers``, ``storage``, ``registries``): containers-config(5)'s
    ``<kind>.conf`` and ``<kind>.conf.d`` in the system's places (with the ``rootful`` or
    ``rootless`` drop-ins, by the user), then the user's own, then the files the variables
    name."""
    config = user_config_dir(environment)
    by_user = (
        (".rootful.conf.d",) if euid == 0 else (".rootless.conf.d", f".rootless.conf.d/{euid}")
    )
    places = [(directory, (".conf", ".conf.d", *by_user)) for directory in _SYSTEM_SETTINGS]
    if config:
        places.append((os.path.join(config, "containers"), (".conf", ".conf.d")))
    paths = [
        (os.path.join(directory, kind) + ending, kind)
        for directory, endings in places
        for kind in _SETTINGS_KINDS
        for ending in endings
    ]
    return [*paths, *((environment[v], kind) for v, kind in _FILE_VARIABLES if environment.get(v))]


def _settings_stamps(paths: Sequence[tuple[str, str]]) -> tuple[list[object], list[str]]:
    """The identity of each settings path and, for a drop-in directory, of each entry in it
    (a drop-in edited in place leaves its directory as it was); and the containers.conf
    files among them, which Podman reads (of a drop-in directory, its ``*.conf`` files)."""
    stamps: list[object] = []
    containers_conf: list[str] = []
    for path, kind in paths:
        try:
            found = os.stat(path)
        except OSError:
            stamps.append(None)
            continue
        stamps.append(user_cache.identity(found))
        read = [path]
        if stat.S_ISDIR(found.st_mode):
            try:
                with os.scandir(path) as entries:
                    files = sorted(entry.path for entry in entries)
            except OSError:
                files = []
            stamps.append([[os.path.basename(f), _stamp(f)] for f in files])
            read = [f for f in files if f.endswith(".conf")]
        if kind == "containers":
            containers_conf += read
    return stamps, containers_conf


def _says_remote(path: str) -> bool:
    """Whether the containers.conf file at ``path`` sets ``remote = true`` (its ``[engine]``
    table's key, which makes ``podman`` a client of a service). A line like that anywhere in
    the file counts: the cautious reading, where a mistake costs an inspect."""
    return "true" in conf_values(path, ("remote",)).get("remote", ())


def conf_values(path: str, keys: Sequence[str]) -> dict[str, list[str]]:
    """The values the containers.conf file at ``path`` gives those of ``keys`` it sets, in
    order (its first ``MAX_SETTINGS_BYTES``; quotes and comments removed), read line by
    line: a line ``key = value`` anywhere in the file counts, whatever its table."""
    try:
        with open(path, "rb") as file:
            text = file.read(MAX_SETTINGS_BYTES).decode("utf-8", "replace")
    except OSError:
        return {}
    found: dict[str, list[str]] = {}
    for line in text.split("\n") if any(key in text for key in keys) else ():
        key, equals, value = line.partition("=")
        if equals and key.strip() in keys:
            found.setdefault(key.strip(), []).append(value.partition("#")[0].strip().strip("\"'"))
    return found


def _store_file(graph_driver: object) -> str | None:
    """``<store>/<driver>-images/images.json`` from ``GraphDriver``'s ``UpperDir``
    (``<store>/<driver>/<layer>/diff``), where that file is there and the store is this
    user's; else None (a driver without ``UpperDir``, such as vfs, is not remembered)."""
    if not isinstance(graph_driver, dict):
        return None
    name, data = graph_driver.get("Name"), graph_driver.get("Data")
    upper = data.get("UpperDir") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name or "/" in name or not isinstance(upper, str):
        return None
    layers = os.path.dirname(os.path.dirname(upper))
    if not os.path.isabs(upper) or os.path.basename(upper) != "diff":
        return None
    if os.path.basename(layers) != name:
        return None
    store = os.path.dirname(layers)
    images = os.path.join(store, f"{name}-images", "images.json")
    try:
        if os.stat(store).st_uid != os.geteuid() or not os.path.isfile(images):
            return None
    except OSError:
        return None
    return images
