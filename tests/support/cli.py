"""click's test runner with standard error kept apart from standard output, on every click
we support: before click 8.2 that takes ``mix_stderr=False``, from 8.2 on it is the only way
(and the argument is gone). The tests assert what goes to which stream."""

from __future__ import annotations

import inspect

from click.testing import CliRunner


def cli_runner() -> CliRunner:
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg, unused-ignore]  # click < 8.2
    return CliRunner()
