"""Read an Ansible inventory (INI, YAML, or ``ansible-inventory --list`` JSON) into hosts.

``load_inventory(path) -> Inventory``; ``Inventory.select(pattern)`` picks hosts the way
``ansible --limit`` does for the common patterns. Every malformed file raises
``InventoryError`` with one line naming the file and the line.

Formats, chosen by the file name as Ansible does: ``.yml``, ``.yaml`` and ``.json`` are the
YAML inventory (groups with ``hosts``, ``vars``, ``children``; a host key may carry a port,
``node1:2222`` or ``[fd00::5]:2222``, as in INI; JSON that has ``_meta`` is
``ansible-inventory --list`` output, which is how a dynamic inventory (cloud plugin, script)
is given to this tool); anything else is INI:

- ``[group]`` host lines ``name[:port] key=value ...`` (values as Python literals, quotes
  allowed, ``#`` comments); ``[group:vars]`` ``key=value`` lines (Python literals too, as
  ansible-core reads them, although Ansible's docs say strings: ``false`` stays the string
  ``"false"``, ``3476`` is a number);
  ``[group:children]`` group names; hosts before any section are ``ungrouped``;
- ranges in host names: ``node[01:20]`` (zero padded), ``rack[a:c]``, ``n[0:10:2]``.

Variables merge as in Ansible: ``all``, then groups from the outermost to the innermost
(same depth: by name), then the ``group_vars/`` and ``host_vars/`` directories next to the
inventory file (``controller.fleet.vars_dirs``, in Ansible's order), with the host's own
variables between the two. Inventory scripts, plugins and inventory directories are not read:
give the output of ``ansible-inventory -i SOURCE --list`` instead.

PyYAML is a dependency for this module: nine inventories in ten are YAML, with anchors,
flow mappings and quoting, and a hand-written subset would misread some of them.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.errors import UsageError
from controller.fleet.vars_dirs import VarsDirs, VarsFileError
from controller.transport.endpoint import is_ipv6

YAML_SUFFIXES = (".yml", ".yaml", ".json")


class InventoryError(UsageError):
    """The inventory cannot be read; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class InventoryHost:
    name: str
    groups: tuple[str, ...]  # every group the host is in, parents included, "all" first
    vars: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Inventory:
    path: str
    hosts: tuple[InventoryHost, ...]  # in the order the file names them
    groups: Mapping[str, tuple[str, ...]]  # group -> its hosts (children's included)

    def select(self, pattern: str | None) -> list[InventoryHost]:
        """The hosts ``pattern`` names (``ansible --limit`` syntax, see ``select_hosts``)."""
        return select_hosts(self, pattern)


# --- the model while reading ----------------------------------------------------------------


@dataclass
class _Group:
    name: str
    line: int
    hosts: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    vars: dict[str, Any] = field(default_factory=dict)


class _Builder:
    def __init__(self, path: str, vars_dirs: VarsDirs | None = None) -> None:
        self.path = path
        self.vars_dirs = vars_dirs
        self.groups: dict[str, _Group] = {}
        self.host_vars: dict[str, dict[str, Any]] = {}
        self.group("all", 0)
        self.group("ungrouped", 0)

    def error(self, line: int | None, message: str) -> InventoryError:
        where = f"{self.path}, line {line}" if line else self.path
        return InventoryError(f"inventory {where}: {message}")

    def group(self, name: str, line: int) -> _Group:
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = _Group(name, line)
        return group

    def add_host(self, group: str, host: str, variables: Mapping[str, Any], line: int) -> None:
        members = self.group(group, line).hosts
        if host not in members:
            members.append(host)
        self.host_vars.setdefault(host, {}).update(variables)

    def build(self) -> Inventory:
        parents: dict[str, set[str]] = {name: set() for name in self.groups}
        for group in self.groups.values():
            for child in group.children:
                parents.setdefault(child, set()).add(group.name)
        all_group = self.groups["all"]
        for name, ups in parents.items():
            if name != "all" and not ups:
                ups.add("all")
                if name not in all_group.children:
                    all_group.children.append(name)

        depth: dict[str, int] = {}

        def depth_of(name: str, trail: tuple[str, ...]) -> int:
            if name in trail:
                cycle = " -> ".join((*trail[trail.index(name) :], name))
                raise self.error(self.groups[name].line, f"groups contain each other: {cycle}")
            if name not in depth:
                ups = parents.get(name, set())
                depth[name] = 1 + max((depth_of(p, (*trail, name)) for p in ups), default=-1)
            return depth[name]

        for name in self.groups:
            depth_of(name, ())

        def ancestors(name: str) -> set[str]:
            out = {name}
            for parent in parents.get(name, ()):
                out |= ancestors(parent)
            return out

        host_groups: dict[str, set[str]] = {host: {"all"} for host in self.host_vars}
        for group in self.groups.values():
            for host in group.hosts:
                host_groups[host] |= ancestors(group.name)
        # "ungrouped": the hosts in no group but "all"
        for groups in host_groups.values():
            if groups - {"all", "ungrouped"}:
                groups.discard("ungrouped")
            else:
                groups.add("ungrouped")

        hosts = []
        for host in self.host_vars:
            ordered = sorted(host_groups[host], key=lambda g: (depth[g], g))
            merged: dict[str, Any] = {}
            for group_name in ordered:  # "all" first: its depth is 0
                merged.update(self.groups[group_name].vars)
            if self.vars_dirs is not None:  # Ansible's order (controller.fleet.vars_dirs)
                try:
                    for group_name in ordered:
                        merged.update(self.vars_dirs.group(group_name))
                    merged.update(self.host_vars[host])
                    merged.update(self.vars_dirs.host(host))
                except VarsFileError as err:
                    raise InventoryError(f"inventory {self.path}: {err}") from None
            else:
                merged.update(self.host_vars[host])
            hosts.append(InventoryHost(host, tuple(ordered), merged))
        members = {name: tuple(h.name for h in hosts if name in h.groups) for name in self.groups}
        return Inventory(self.path, tuple(hosts), members)


# --- entry point ----------------------------------------------------------------------------


def load_inventory(path: str | Path) -> Inventory:
    """Read an inventory file; raises ``InventoryError`` (one line: file, line, what)."""
    name = str(path)
    file = Path(path)
    if file.is_dir():
        raise InventoryError(
            f"inventory {name}: is a directory; give one file, or the output of "
            f"ansible-inventory -i {name} --list > fleet.json"
        )
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise InventoryError(f"inventory {name}: cannot read it: {exc.strerror or exc}") from None
    if raw.startswith(b"#!"):
        raise InventoryError(
            f"inventory {name}: is a script; give its output instead: "
            f"ansible-inventory -i {name} --list > fleet.json"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InventoryError(f"inventory {name}, line {line}: not UTF-8 text") from None
    builder = _Builder(name, VarsDirs(file.parent))
    if file.suffix.lower() in YAML_SUFFIXES:
        _read_yaml(builder, text, json_file=file.suffix.lower() == ".json")
    else:
        _read_ini(builder, text)
    return builder.build()


# --- host name ranges -----------------------------------------------------------------------

_RANGE = re.compile(r"\[([^\]:]*):([^\]:]*)(?::([^\]:]*))?\]")


def expand_range(pattern: str) -> list[str]:
    """``node[01:03]`` -> node01 node02 node03; ``[a:c]``, ``[0:10:2]``; raises ValueError."""
    match = _RANGE.search(pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"bad host range in {pattern!r} (write [01:20] or [a:f])")
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    start, end, stride_text = match.group(1), match.group(2), match.group(3)
    stride = 1
    if stride_text:
        if not stride_text.isdigit() or int(stride_text) == 0:
            raise ValueError(f"bad range step {stride_text!r} in {pattern!r}")
        stride = int(stride_text)
    if start == "":
        start = "0"
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") and len(start) > 1 else 0
        if width and len(start) != len(end):
            raise ValueError(f"range {start}:{end} in {pattern!r}: give both ends the same width")
        values = [f"{n:0{width}d}" for n in range(int(start), int(end) + 1, stride)]
    elif len(start) == 1 and len(end) == 1 and start.isalpha() and end.isalpha():
        values = [chr(c) for c in range(ord(start), ord(end) + 1, stride)]
    else:
        raise ValueError(f"bad host range [{match.group(0)[1:-1]}] in {pattern!r}")
    if not values:
        raise ValueError(f"empty host range in {pattern!r} (the start is after the end)")
    return [head + value + rest for value in values for rest in expand_range(tail)]


# --- INI ------------------------------------------------------------------------------------

_SECTION = re.compile(r"^\[([^\[\]:\s]+)(?::([A-Za-z]+))?\]\s*(?:[#;].*)?$")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _read_ini(builder: _Builder, text: str) -> None:
    section, kind = "ungrouped", "hosts"
    pending_vars: dict[str, int] = {}
    group_vars: dict[str, dict[str, Any]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and not _looks_like_host_range(line):
            match = _SECTION.match(line)
            if match is None:
                raise builder.error(
                    number,
                    f"bad section header {line!r} ([group], [group:vars] or [group:children])",
                )
            section, kind = match.group(1), (match.group(2) or "hosts")
            if kind not in ("hosts", "vars", "children"):
                raise builder.error(number, f"unknown section kind :{kind} (vars or children)")
            if kind == "vars":
                pending_vars.setdefault(section, number)
            else:
                builder.group(section, number)
            continue
        if kind == "vars":
            key, eq, value = line.partition("=")
            if not eq or not key.strip():
                raise builder.error(number, f"expected key=value in [{section}:vars], got {line!r}")
            group_vars.setdefault(section, {})[key.strip()] = _literal(value.strip())
        elif kind == "children":
            child = line.split("#", 1)[0].strip()
            if not _GROUP_NAME.match(child):
                raise builder.error(number, f"bad group name {child!r} in [{section}:children]")
            builder.group(child, number)
            children = builder.group(section, number).children
            if child not in children:
                children.append(child)
        else:
            _ini_host_line(builder, section, line, number)
    for group, number in pending_vars.items():
        if group not in builder.groups:
            raise builder.error(
                number, f"[{group}:vars] for a group that is never defined ([{group}])"
            )
        builder.groups[group].vars.update(group_vars.get(group, {}))


def _looks_like_host_range(line: str) -> bool:
    """``[01:10]node`` (rare, but legal as a host pattern) and ``[fd00::1:2:3]:22`` (an IPv6
    address and its port, as Ansible reads it; with a zone too, ``[fe80::1%eth0]:22``, as
    in a YAML inventory's host keys, where Ansible refuses it) are hosts, not sections."""
    if re.match(r"^\[[0-9a-z]*:[0-9a-z]*(:\d+)?\]\S", line):
        return True
    end = line.find("]")
    return line[end + 1 : end + 2] == ":" and is_ipv6(line[1:end])


def _ini_host_line(builder: _Builder, group: str, line: str, number: int) -> None:
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise builder.error(number, f"cannot split {line!r}: {exc}") from None
    if not words:
        return
    pattern, assignments = words[0], words[1:]
    variables: dict[str, Any] = {}
    for word in assignments:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise builder.error(number, f"expected key=value after the host name, got {word!r}")
        variables[key] = _literal(value)
    host_part, port = _split_port(pattern)
    if port is not None:
        variables.setdefault("ansible_port", port)
    try:
        names = expand_range(host_part)
    except ValueError as exc:
        raise builder.error(number, str(exc)) from None
    for name in names:
        builder.add_host(group, name, variables, number)


def _split_port(pattern: str) -> tuple[str, int | None]:
    """``host:2222`` -> (host, 2222), ``[fd00::5]:2222`` -> (fd00::5, 2222); ranges
    (``n[1:3]``) and IPv6 addresses without a port keep their colons."""
    depth, last = 0, -1
    for index, char in enumerate(pattern):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == ":" and depth == 0:
            if last >= 0:  # two colons outside brackets: an IPv6 address
                return pattern, None
            last = index
    if last > 0 and pattern[last + 1 :].isdigit():
        host = pattern[:last]
        if host.startswith("[") and host.endswith("]") and is_ipv6(host[1:-1]):
            host = host[1:-1]  # [fd00::5]:2222: an IPv6 address with a port, as Ansible reads it
        return host, int(pattern[last + 1 :])
    return pattern, None


def _literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


# --- YAML / JSON ----------------------------------------------------------------------------


def _read_yaml(builder: _Builder, text: str, *, json_file: bool) -> None:
    if json_file:
        try:
            data = json.loads(text)
        except ValueError as exc:
            line = getattr(exc, "lineno", None)
            raise builder.error(line, f"not valid JSON: {getattr(exc, 'msg', exc)}") from None
        if isinstance(data, dict) and "_meta" in data:
            _read_inventory_list(builder, data)
            return
    import yaml  # noqa: PLC0415 (only for YAML inventories)

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise builder.error(mark.line + 1 if mark else None, f"not valid YAML: {problem}") from None
    if root is None:
        return
    reader = _YamlReader(builder)
    if not isinstance(root, yaml.MappingNode):
        raise builder.error(_line(root), "the top level must be a mapping of groups (all: ...)")
    for key, value in reader.pairs(root, "the top level"):
        reader.group(key, value, parent=None)


def _line(node: Any) -> int:
    return int(node.start_mark.line) + 1


class _YamlReader:
    def __init__(self, builder: _Builder) -> None:
        import yaml  # noqa: PLC0415

        self.yaml = yaml
        self.builder = builder
        self.constructor = yaml.constructor.SafeConstructor()

    def scalar(self, node: Any, what: str) -> str:
        if not isinstance(node, self.yaml.ScalarNode) or node.tag.endswith(":null"):
            raise self.builder.error(_line(node), f"{what} must be a name")
        return str(node.value)

    def pairs(self, node: Any, what: str) -> Iterator[tuple[str, Any]]:
        if node is None or (isinstance(node, self.yaml.ScalarNode) and node.tag.endswith(":null")):
            return
        if not isinstance(node, self.yaml.MappingNode):
            kind = "a list" if isinstance(node, self.yaml.SequenceNode) else "a single value"
            raise self.builder.error(_line(node), f"{what} must be a mapping, not {kind}")
        for key, value in node.value:
            yield self.scalar(key, f"a key of {what}"), value

    def value(self, node: Any) -> Any:
        try:
            return self.constructor.construct_document(node)
        except self.yaml.YAMLError as exc:
            raise self.builder.error(_line(node), f"bad value: {exc}") from None

    def variables(self, node: Any, what: str) -> dict[str, Any]:
        return {key: self.value(value) for key, value in self.pairs(node, what)}

    def group(self, name: str, node: Any, parent: str | None) -> None:
        line = _line(node)
        group = self.builder.group(name, line)
        if parent is not None and name not in self.builder.groups[parent].children:
            self.builder.groups[parent].children.append(name)
        for key, value in self.pairs(node, f"group {name!r}"):
            if key == "hosts":
                for pattern, host_node in self.pairs(value, f"the hosts of group {name!r}"):
                    variables = self.variables(host_node, f"the variables of host {pattern!r}")
                    host_part, port = _split_port(pattern)
                    if port is not None:  # node1:2222, as in INI; the host's ansible_port wins
                        variables.setdefault("ansible_port", port)
                    try:
                        names = expand_range(host_part)
                    except ValueError as exc:
                        raise self.builder.error(_line(value), str(exc)) from None
                    for host in names:
                        self.builder.add_host(name, host, variables, line)
            elif key == "vars":
                group.vars.update(self.variables(value, f"the vars of group {name!r}"))
            elif key == "children":
                for child, child_node in self.pairs(value, f"the children of group {name!r}"):
                    self.group(child, child_node, parent=name)
            else:
                raise self.builder.error(
                    _line(value),
                    f"unexpected key {key!r} in group {name!r} (hosts, vars or children)",
                )


def _read_inventory_list(builder: _Builder, data: dict[str, Any]) -> None:
    """``ansible-inventory --list`` output: variables already merged into ``_meta``."""
    meta = data.get("_meta")
    hostvars = meta.get("hostvars", {}) if isinstance(meta, dict) else None
    if not isinstance(hostvars, dict):
        raise builder.error(None, "_meta.hostvars must be a mapping of host -> variables")
    for name, entry in data.items():
        if name == "_meta":
            continue
        if not isinstance(entry, dict):
            raise builder.error(None, f"group {name!r} must be a mapping (hosts, children)")
        group = builder.group(name, 0)
        for child in entry.get("children", []) or []:
            builder.group(str(child), 0)
            if child not in group.children:
                group.children.append(str(child))
        for host in entry.get("hosts", []) or []:
            variables = hostvars.get(host, {})
            builder.add_host(name, str(host), variables if isinstance(variables, dict) else {}, 0)
    for host, variables in hostvars.items():
        if host not in builder.host_vars and isinstance(variables, dict):
            builder.add_host("ungrouped", str(host), variables, 0)


# --- patterns (--limit) ---------------------------------------------------------------------


def select_hosts(inventory: Inventory, pattern: str | None) -> list[InventoryHost]:
    """Hosts named by an ``ansible --limit`` pattern, in inventory order.

    Terms are separated by ``,`` or ``:``; each is a group, a host, or a shell glob over
    both (``gpu*``); ``all`` and ``*`` mean every host; ``!term`` removes hosts; ``&term``
    keeps only hosts also in it. An unknown group or host is an ``InventoryError``.
    """
    hosts = list(inventory.hosts)
    if pattern is None or pattern.strip() in ("", "all", "*"):
        return hosts
    terms = [t.strip() for t in re.split(r"[,:]", pattern) if t.strip()]
    chosen: set[str] = set()
    for term in (t for t in terms if t[0] not in "!&"):
        chosen |= _term_hosts(inventory, term)
    if all(t[0] in "!&" for t in terms):
        chosen = {h.name for h in hosts}
    for term in (t for t in terms if t[0] == "&"):
        chosen &= _term_hosts(inventory, term[1:])
    for term in (t for t in terms if t[0] == "!"):
        chosen -= _term_hosts(inventory, term[1:])
    return [h for h in hosts if h.name in chosen]


def _term_hosts(inventory: Inventory, term: str) -> set[str]:
    if term in ("all", "*"):
        return {h.name for h in inventory.hosts}
    if term in inventory.groups:
        return set(inventory.groups[term])
    names = {h.name for h in inventory.hosts}
    if term in names:
        return {term}
    if any(ch in term for ch in "*?["):
        found = {n for n in names if fnmatch.fnmatchcase(n, term)}
        for group, members in inventory.groups.items():
            if fnmatch.fnmatchcase(group, term):
                found |= set(members)
        if found:
            return found
    raise InventoryError(
        f"--limit {term!r}: no such group or host in inventory {inventory.path} "
        f"(groups: {', '.join(sorted(g for g in inventory.groups if inventory.groups[g]))})"
    )
