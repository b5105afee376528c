"""The controller's edge: the environment is read there only, and nothing configures logging at
import. Each command builds one ``Options`` at its edge (the ctl's group, the wrapper's main)
and hands it down; a module below that reads ``os.environ`` would bring back settings that no
declaration, help or test knows of."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from controller.options import Options, declarations

REPO = Path(__file__).resolve().parents[3]
CONTROLLER = REPO / "controller"
EDGES = {"controller/ctl/main.py", "controller/wrapper/cli.py"}
# reading the environment without naming os.environ: HOME through ~, COLUMNS through the
# terminal size; the edges do those for the parts below
ENVIRONMENT_READERS = {
    "environ",
    "getenv",
    "environb",
    "getenvb",
    "expanduser",
    "get_terminal_size",
}


def _readers(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for item in ast.walk(tree):
        name = None
        if isinstance(item, ast.Attribute) and item.attr in ENVIRONMENT_READERS:
            name = item.attr
        elif isinstance(item, ast.ImportFrom) and item.module in ("os", "os.path", "shutil"):
            names = {a.name for a in item.names} & ENVIRONMENT_READERS
            name = ", ".join(sorted(names)) or None
        if name is not None:
            line = getattr(item, "lineno", 0)
            found.append(f"{path.relative_to(REPO)}:{line}: {name}")
    return found


def test_only_the_edges_read_the_environment() -> None:
    outside = [
        line
        for path in sorted(CONTROLLER.rglob("*.py"))
        if str(path.relative_to(REPO)) not in EDGES
        for line in _readers(path)
    ]
    assert outside == []
    # the check sees what it looks for: the edges do read it
    assert all(_readers(REPO / edge) for edge in EDGES)


def test_importing_the_controller_configures_no_logging() -> None:
    probe = (
        "import logging, pkgutil, importlib, controller\n"
        "def state():\n"
        "    return sorted((name, l.propagate, len(l.handlers), l.level)\n"
        "        for name, l in logging.Logger.manager.loggerDict.items()\n"
        "        if isinstance(l, logging.Logger) and (l.handlers or not l.propagate)),"
        " len(logging.getLogger().handlers)\n"
        "before = state()\n"
        "for m in pkgutil.walk_packages(controller.__path__, 'controller.'):\n"
        "    importlib.import_module(m.name)\n"
        "import sys\n"
        "sys.stdout.write(repr((before, state())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO), "NV_DEBUG": ""},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    before, after = ast.literal_eval(done.stdout)
    assert after == before


def test_each_variable_is_declared_once() -> None:
    variables = [d.env for _, d, _ in declarations(Options) if d.env is not None]
    assert len(variables) == len(set(variables))
    flags = [f for _, d, _ in declarations(Options) for f in d.flags]
    assert len(flags) == len(set(flags))


def test_options_come_from_the_environment_and_flags_win() -> None:
    environ = {"HOME": "/home/ops", "USER": "ops", "NV_FLEET_PARALLEL": "8", "NV_TLS_CA": "~/ca"}
    options = Options.build(environ, {"parallel": "16"})
    assert (options.parallel, options.tls_ca, options.user) == (16, "/home/ops/ca", "ops")
    assert options.ssh_known_hosts == ("/home/ops/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
    assert options.ssh_config == "/home/ops/.ssh/config"
    assert Options.build({**environ, "NV_DEBUG": "0"}).debug is False
    assert Options.build({**environ, "NV_DEBUG": "1"}).debug is True


def test_each_command_reads_only_its_own_variables() -> None:
    environ = {"HOME": "/h", "USER": "u", "NV_FLEET_TIMEOUT": "soon", "NV_CDI": "maybe"}
    wrapper = Options.build({**environ, "NV_CDI": "yes"}, command="wrapper")
    assert (wrapper.cdi, wrapper.timeout_s) == ("yes", 10.0)  # the ctl's variable: not read
    ctl = Options.build({**environ, "NV_FLEET_TIMEOUT": "5"})
    assert (ctl.timeout_s, ctl.cdi) == (5.0, "auto")  # the wrapper's variable: not read
