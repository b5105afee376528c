"""The layering rules of the README ("Architecture"), checked on every import of our code.

Imports point one way: ``controller`` -> ``agent`` -> ``plugin``, ``mesos``, ``cdi``.
``agent.gpu``, ``plugin``, ``mesos`` and ``cdi`` import nothing of ours (but ``agent.gpu``
reads files through ``agent.files``, which imports only the standard library); nothing imports
``controller``, and ``controller`` imports neither ``plugin`` nor ``cdi`` (the agent speaks
for them); only ``agent/gpu/`` imports pynvml and only ``agent/metrics/``
prometheus_client; in ``controller``, paramiko only in the SSH tunnel (and its ``~/.ssh/config``
reader) and aiohttp only in the HTTP client; the wrapper's fast path imports nothing but the
standard library at module level; the lease table (``agent.leases``) only the GPU model, the
health rule, the device selection and the standard library, none of its I/O or clocks; the
engines' edge (``agent.engines``) none of the parts that use it (the API, the lease wiring,
attribution, the server). Every import counts, also one inside a function (a lazy import is
still a dependency), and ``if TYPE_CHECKING`` blocks too.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "plugin", "mesos", "controller", "cdi")


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted
    line: int
    top_level: bool  # at module level (not inside a function or class body)

    def __str__(self) -> str:
        where = "" if self.top_level else " (inside a function)"
        return f"{self.module.replace('.', '/')}.py:{self.line} imports {self.target}{where}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top = {id(node) for node in tree.body}
    for statement in tree.body:  # `if TYPE_CHECKING:` and try/except at module level
        if isinstance(statement, ast.If | ast.Try):
            top.update(id(child) for child in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                targets = [f"{prefix}.{node.module}" if node.module else prefix]
            else:
                targets = [node.module or ""]
        else:
            continue
        found += [Import(module, t, node.lineno, id(node) in top) for t in targets]
    return found


def _all_imports() -> list[Import]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _imports(path)
    return found


IMPORTS = _all_imports()


def _is(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def _violations(
    importer: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> list[str]:
    return [
        str(imp)
        for imp in IMPORTS
        if _is(imp.module, importer)
        and any(_is(imp.target, f) for f in forbidden)
        and not any(_is(imp.target, a) for a in allowed)
    ]


def test_the_scan_sees_lazy_and_relative_imports() -> None:
    """The checker must be able to fail: it finds the lazy imports we know are there."""
    lazy = {(i.module, i.target) for i in IMPORTS if not i.top_level}
    assert ("agent.gpu.backends", "agent.gpu.nvml_backend") in lazy
    assert ("controller.wrapper.cli", "controller.wrapper.gpu_args") in lazy
    assert len(IMPORTS) > 200


@pytest.mark.parametrize(
    ("importer", "forbidden", "allowed"),
    [
        ("plugin", ("agent", "mesos", "controller", "cdi"), ()),
        ("mesos", ("agent", "plugin", "controller", "cdi"), ()),
        ("cdi", ("agent", "plugin", "mesos", "controller"), ()),
        (
            "agent.gpu",
            ("agent", "plugin", "mesos", "controller", "cdi"),
            ("agent.gpu", "agent.files"),
        ),
        ("agent.files", ("agent", "plugin", "mesos", "controller", "cdi"), ()),
        ("agent", ("controller",), ()),
        ("controller", ("plugin", "cdi"), ()),
    ],
)
def test_imports_point_one_way(
    importer: str, forbidden: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    assert _violations(importer, forbidden, allowed) == []


@pytest.mark.parametrize(
    ("library", "only_in"),
    [
        ("pynvml", ("agent.gpu",)),
        # ssh_config: paramiko's own parser of ~/.ssh/config (hand-parsing it would misread
        # Host patterns and token expansion)
        ("paramiko", ("controller.transport.ssh_tunnel", "controller.transport.ssh_config")),
        ("aiohttp", ("agent", "plugin", "controller.transport.client")),
        ("click", ("agent.cli", "controller.ctl")),
        ("prometheus_client", ("agent.metrics",)),
    ],
)
def test_libraries_stay_in_their_rooms(library: str, only_in: tuple[str, ...]) -> None:
    outside = [
        str(imp)
        for imp in IMPORTS
        if _is(imp.target, library) and not any(_is(imp.module, room) for room in only_in)
    ]
    assert outside == []


FAST_PATH = ("controller.wrapper.cli", "controller.wrapper.docker_args", "controller.errors")


def test_the_wrappers_fast_path_imports_only_the_standard_library_at_load() -> None:
    stdlib = sys.stdlib_module_names | {"__future__"}
    ours = ("controller.wrapper", "controller.errors", "controller")
    bad = [
        str(imp)
        for imp in IMPORTS
        if imp.module in FAST_PATH
        and imp.top_level
        and imp.target.split(".")[0] not in stdlib
        and imp.target not in ours
        and not any(_is(imp.target, f) for f in FAST_PATH)
    ]
    assert bad == []


def test_agent_files_imports_only_the_standard_library() -> None:
    """``agent.gpu`` may import ``agent.files`` because it brings nothing else along."""
    stdlib = sys.stdlib_module_names | {"__future__"}
    bad = [
        str(imp)
        for imp in IMPORTS
        if imp.module == "agent.files" and imp.target.split(".")[0] not in stdlib
    ]
    assert bad == []
    assert any(imp.module == "agent.files" for imp in IMPORTS)


# What the lease table, a pure model, may import of ours, and the standard library it may not.
LEASES_MAY_IMPORT = ("agent.leases", "agent.gpu.model", "agent.health.rule", "agent.node.selection")
NOT_PURE = (
    "asyncio", "io", "os", "pathlib", "select", "selectors", "shutil", "signal", "socket",
    "subprocess", "sys", "tempfile", "threading", "time",
)  # fmt: skip


def test_the_lease_table_is_a_pure_model() -> None:
    """``agent.leases``: GPU facts, health and holders in, decisions out; no I/O, no clock."""
    stdlib = sys.stdlib_module_names | {"__future__"}
    bad = [
        str(imp)
        for imp in IMPORTS
        if _is(imp.module, "agent.leases")
        and not any(_is(imp.target, allowed) for allowed in LEASES_MAY_IMPORT)
        and (imp.target.split(".")[0] not in stdlib or imp.target.split(".")[0] in NOT_PURE)
    ]
    assert bad == []
    assert any(_is(imp.module, "agent.leases") for imp in IMPORTS)


def _agent_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``agent`` it imports (a package's import: its __init__)."""
    modules = {_module_name(p) for p in (ROOT / "agent").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in IMPORTS:
        if imp.module in graph and imp.target in modules:
            graph[imp.module].add(imp.target)
        elif imp.module in graph and imp.target.rpartition(".")[0] in modules:
            graph[imp.module].add(imp.target.rpartition(".")[0])  # from package import name
    return graph


def test_the_agents_modules_import_each_other_without_a_cycle() -> None:
    graph = _agent_graph()
    assert sum(map(len, graph.values())) > 150  # the scan sees the agent's imports
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


# The engines' edge (their API client, containers and events) knows the engines and the
# lease table's values, not the parts that use it: attribution and the lease wiring import
# it, never the other way.
ENGINES_MAY_NOT_IMPORT = (
    "agent.api", "agent.leasing", "agent.server", "agent.cli", "agent.daemon",
    "agent.attribution", "agent.node", "agent.metrics", "agent.health", "agent.cdi_spec",
    "agent.gpu",
)  # fmt: skip


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        # The HTTP edge knows HTTP, TLS, tokens and sockets, not the node it serves.
        (
            "agent.edge",
            ("agent.api", "agent.node", "agent.health", "agent.metrics", "agent.cdi_spec"),
        ),
        # The health rule sees only what the worker reports.
        ("agent.health.rule", ("agent.api", "agent.node", "agent.edge", "agent.metrics")),
        # Nothing but the entry points knows how the daemon is put together.
        (
            "agent.api",
            ("agent.server", "agent.cli", "agent.daemon"),
        ),
        ("agent.node", ("agent.server", "agent.cli", "agent.daemon", "agent.edge")),
        ("agent.engines", ENGINES_MAY_NOT_IMPORT),
    ],
)
def test_the_agents_rooms(importer: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(importer, forbidden) == []


def test_the_agents_top_level_holds_at_most_a_dozen_modules() -> None:
    top = sorted(p.name for p in (ROOT / "agent").glob("*.py"))
    assert len(top) <= 12, top
