"""A real ELF program standing in for a container CLI: it prints one line and records how
it was run (``cli_program``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.prerequisites import require_command


def cli_program(path: Path, line: str, calls: Path) -> Path:
    """Compile ``path``: a program that prints ``line`` and appends its arguments, one
    line a run, to ``calls``."""
    require_command("gcc", "apt-get install gcc libc6-dev")
    source = path.with_name(path.name + ".c")
    source.write_text(
        "#include <stdio.h>\n"
        "int main(int argc, char **argv) {\n"
        f'  FILE *calls = fopen("{calls}", "a");\n'
        '  for (int i = 1; i < argc; i++) fprintf(calls, "%s%s", i > 1 ? " " : "", argv[i]);\n'
        "  fputc(10, calls); fclose(calls);\n"
        f'  puts("{line}");\n'
        "  return 0;\n}\n"
    )
    built = path.with_name(path.name + ".new")
    subprocess.run(["gcc", "-O1", "-o", str(built), str(source)], check=True, timeout=120)
    built.replace(path)  # a new file, as a package upgrade writes
    return path
