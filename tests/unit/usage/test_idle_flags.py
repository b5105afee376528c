"""Bad values of the idle policy's flags stop the agent at start with one line saying what
is wrong (agent.config, docs/usage.md "Settings")."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from agent import cli
from agent.config import options


@pytest.mark.parametrize(
    ("args", "env", "wrong"),
    [
        (["--idle-after", "nan"], {}, "'nan': give seconds as a finite number, 1 or more"),
        (["--idle-after", "inf"], {}, "'inf': give seconds as a finite number, 1 or more"),
        ([], {"NVIDIA_DOCKER_PLUGIN_IDLE_AFTER": "1e400"}, "'inf': give seconds as a finite"),
        (["--idle-after", "0.5"], {}, "0.5 is not in the range x>=1.0"),
        (["--idle-after", "1h"], {}, "'1h' is not a valid float range"),
        (["--idle-policy", "kill"], {}, "'kill' is not one of 'notify', 'release', 'stop'"),
    ],
)
def test_a_bad_idle_flag_is_one_line_at_start(
    args: list[str], env: dict[str, str], wrong: str
) -> None:
    unset: dict[str, str | None] = {o.env_var: None for _, o, _ in options()}
    result = CliRunner().invoke(cli.command, args, env={**unset, **env})
    assert result.exit_code == 2, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert wrong in error
