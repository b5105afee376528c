"""``controller.wrapper.docker_cli``: a command's answer as ``subprocess.run(capture_output=True,
text=True, stdin=DEVNULL)`` gives it, without importing ``subprocess``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.wrapper.docker_cli import ask

ENV = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}


@pytest.mark.parametrize(
    "script",
    [
        "echo out; echo err >&2; exit 3",
        "printf 'a\\r\\nb\\n'; printf 'é\\n' >&2",
        "cat; echo done",  # standard input is /dev/null: cat ends at once
        "kill -9 $$",  # killed by a signal: a negative code
    ],
)
def test_the_answer_is_subprocess_s(script: str) -> None:
    ours = ask(["sh", "-c", script], ENV)
    theirs = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=ENV,
        check=False,
    )
    assert (ours.returncode, ours.stdout, ours.stderr) == (
        theirs.returncode,
        theirs.stdout,
        theirs.stderr,
    )


def test_both_outputs_at_length_do_not_block() -> None:
    writer = (
        "import sys\n"
        "for i in range(64):\n"
        "    sys.stdout.write('o' * 16384); sys.stderr.write('e' * 16384)\n"
    )
    done = ask([sys.executable, "-c", writer], ENV, timeout_s=30)
    assert done.returncode == 0
    assert done.stdout == "o" * 16384 * 64
    assert done.stderr == "e" * 16384 * 64


def test_the_environment_is_the_one_given() -> None:
    done = ask(["sh", "-c", 'echo "$NVD_PROBE"'], {**ENV, "NVD_PROBE": "given"})
    assert done.stdout == "given\n"


def test_not_found_and_timeout() -> None:
    with pytest.raises(FileNotFoundError):
        ask(["nvd-no-such-command-here"], ENV)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        ask(["sleep", "30"], ENV, timeout_s=0.3)
    assert time.monotonic() - started < 10
    assert "sleep" not in _children()  # killed and reaped: nothing left behind


def _children() -> list[str]:
    """The command names of this process's children (zombies included)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name, _, rest = text.partition(" (")[2].rpartition(") ")
        if int(rest.split()[1]) == os.getpid():
            found.append(name)
    return found


def test_the_command_is_found_on_the_given_environments_path(tmp_path: Path) -> None:
    """As ``subprocess.run(env=...)`` finds it: on the PATH the command is given (the
    docker the wrapper's environment names), not this process's."""
    tool = tmp_path / "bin" / "only-there"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho found\n")
    tool.chmod(0o755)
    environment = {**ENV, "PATH": f"{tool.parent}:{ENV['PATH']}"}
    assert ask(["only-there"], environment).stdout == "found\n"
    with pytest.raises(FileNotFoundError):
        ask(["only-there"], ENV)
