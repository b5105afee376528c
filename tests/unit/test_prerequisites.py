"""The test suite's own rules: a missing prerequisite skips here but fails in CI, and the
machine-wide locks of concurrent test runs exclude each other and leave nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.prerequisites import require_command, unavailable
from tests.support.services import machine_lock

REPO = Path(__file__).resolve().parents[2]
_CAPTURE: dict[str, Any] = {"capture_output": True, "text": True, "cwd": REPO, "timeout": 120}


def test_a_missing_prerequisite_skips_on_a_developer_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs gcc"):
        unavailable("needs gcc")


def test_a_missing_prerequisite_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"needs gcc .*CI=true"):
        unavailable("needs gcc")
    with pytest.raises(pytest.fail.Exception, match="needs no-such-tool-here"):
        require_command("no-such-tool-here", "nowhere")


def test_commands_of_this_python_s_environment_are_found_off_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    python = Path(sys.executable)
    assert require_command(python.name, "python") == str(python)


def test_a_skip_in_ci_is_reported_as_a_failure(tmp_path: Path) -> None:
    """The suite's hook (tests/conftest.py) turns even a plain pytest.skip into a failure."""
    test = tmp_path / "test_skips.py"
    test.write_text("import pytest\n\ndef test_it():\n    pytest.skip('no frobnicator here')\n")
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"),
        *("-c", str(REPO / "pyproject.toml"), "-o", "addopts=", str(test)),
    ]
    ci = subprocess.run(
        command, env={"PATH": "/usr/bin:/bin", "CI": "true"}, **_CAPTURE, check=False
    )
    assert ci.returncode == 1, ci.stdout
    assert "skipped in CI (CI=true), where every test must run: no frobnicator here" in ci.stdout
    here = subprocess.run(command, env={"PATH": "/usr/bin:/bin"}, **_CAPTURE, check=False)
    assert here.returncode == 0, here.stdout
    assert "1 skipped" in here.stdout


def test_machine_lock_excludes_another_process_and_is_freed_when_it_dies() -> None:
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tests.support.services import machine_lock\n"
        "with machine_lock('unit-test-lock'):\n"
        "    print('held', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(REPO)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        with (
            pytest.raises(TimeoutError, match="held by another test run"),
            machine_lock("unit-test-lock", timeout_s=0.3),
        ):
            pass
        holder.kill()  # dies holding the lock: the kernel frees it
    with machine_lock("unit-test-lock", timeout_s=5):
        pass
