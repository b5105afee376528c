"""``group_vars/`` and ``host_vars/`` next to an inventory, read as Ansible's ``host_group_vars``.

``VarsDirs(directory)`` answers ``group(name)`` and ``host(name)``: the variables of
``group_vars/<name>`` and ``host_vars/<name>`` under ``directory``. As Ansible looks for them:
the first of ``<name>``, ``<name>.yml``, ``<name>.yaml``, ``<name>.json`` that exists; when
that is a directory, every file in it (and its subdirectories) with one of those extensions or
none, in sorted order, hidden files and ``~`` backups skipped, later files overriding earlier
ones. Each file is YAML whose top level is a mapping (or empty).

Files encrypted as a whole with ``ansible-vault`` are skipped (this tool holds no vault
password; put what it needs, such as ``nvidia_docker_tls_ca``, in a plain file, or give it
``ansible-inventory --list`` output). Values tagged ``!vault`` inside a plain file stop the
read with one line naming the file.

``controller.fleet.inventory`` merges them in Ansible's order: the inventory's own group
variables (``all`` first, then the host's groups by depth and name), then ``group_vars/all``,
then ``group_vars/<group>`` in the same group order, then the inventory's host variables,
then ``host_vars/<host>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.errors import ControllerError

EXTENSIONS = (".yml", ".yaml", ".json")
VAULT_HEADER = b"$ANSIBLE_VAULT;"


class VarsFileError(ControllerError):
    """A vars file that cannot be read; the message names it (and the line)."""


class VarsDirs:
    """The ``group_vars``/``host_vars`` directories of one inventory (read once each)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[tuple[str, str], dict[str, Any]] = {}
        self.skipped: list[Path] = []  # vault-encrypted files

    def group(self, name: str) -> dict[str, Any]:
        return self._vars("group_vars", name)

    def host(self, name: str) -> dict[str, Any]:
        return self._vars("host_vars", name)

    def _vars(self, kind: str, name: str) -> dict[str, Any]:
        key = (kind, name)
        if key not in self._cache:
            merged: dict[str, Any] = {}
            for path in _files(self.directory / kind, name):
                merged.update(self._read(path))
            self._cache[key] = merged
        return self._cache[key]

    def _read(self, path: Path) -> dict[str, Any]:
        import yaml  # noqa: PLC0415 (only when such files exist)

        try:
            raw = path.read_bytes()
        except OSError as err:
            raise VarsFileError(f"vars file {path}: cannot read it: {err.strerror}") from None
        if raw.lstrip().startswith(VAULT_HEADER):
            self.skipped.append(path)
            return {}
        try:
            data = yaml.safe_load(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise VarsFileError(f"vars file {path}: not UTF-8 text") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            if "!vault" in str(err):
                problem = "a !vault value (this tool does not decrypt; keep it in a vault file)"
            raise VarsFileError(f"vars file {path}{where}: {problem}") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise VarsFileError(f"vars file {path}: the top level must be a mapping of variables")
        return {str(k): v for k, v in data.items()}


def _files(directory: Path, name: str) -> list[Path]:
    """The files Ansible reads for ``name`` in ``directory`` (see the module docstring)."""
    for extension in ("", *EXTENSIONS):
        candidate = directory / (name + extension)
        if candidate.is_dir():
            return _directory_files(candidate)
        if candidate.is_file():
            return [candidate]
    return []


def _directory_files(directory: Path) -> list[Path]:
    found: list[Path] = []
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        if entry.name.startswith(".") or entry.name.endswith("~"):
            continue
        suffix = entry.suffix
        if entry.is_dir() and not suffix:
            found += _directory_files(entry)
        elif entry.is_file() and (not suffix or suffix in EXTENSIONS):
            found.append(entry)
    return found
