"""The docker CLI's version read from its own file (``controller.wrapper.go_build_info``).

The real docker CLI programs of this machine are read and checked against what they print
for ``--version``; files laid out as Go writes its build information (``go_program``) cover
the forms no program here has (32-bit, big-endian, other quoting) and every way a file can
fail to say it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import pytest

from controller.wrapper.go_build_info import linked_value
from tests.unit.controller.go_program import buildinfo_section, go_program, ldflags_lines

VERSION = "github.com/docker/cli/cli/version.Version"
DOCKER_CE = (  # as docker's own build scripts link the CLI (recorded Go-quoted)
    '" -X \\"github.com/docker/cli/cli/version.GitCommit=e6534b4\\" -X '
    '\\"github.com/docker/cli/cli/version.Version=28.2.2\\" -extldflags -static"'
)


def _docker_programs() -> list[str]:
    """Every docker CLI on this machine's PATH and in the usual places, once each."""
    found = {shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker"}
    return sorted({os.path.realpath(p) for p in found if p and os.access(p, os.X_OK)})


@pytest.mark.parametrize("program", _docker_programs() or ["(none)"])
def test_a_real_docker_cli_says_what_it_prints(program: str) -> None:
    if program == "(none)":
        pytest.skip("no docker CLI on this machine")
    printed = subprocess.run(
        [program, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout  # "Docker version 28.2.2, build e6534b4"
    version = printed.removeprefix("Docker version ").split(",", 1)[0]
    read = linked_value(program, VERSION)
    # docker-ce's builds record their -ldflags; Debian's (-trimpath) record none
    trimmed = b"build\t-trimpath=true" in Path(program).read_bytes()
    assert read == (None if trimmed else version), printed


@pytest.mark.parametrize(
    ("ldflags", "expected"),
    [
        (DOCKER_CE, "28.2.2"),
        ("-X github.com/docker/cli/cli/version.Version=25.0.0-rc.1", "25.0.0-rc.1"),
        ("\"-X 'github.com/docker/cli/cli/version.Version=26.1.5+dfsg1'\"", "26.1.5+dfsg1"),
        (  # the last -X of a variable wins, as in the linker
            '"-X github.com/docker/cli/cli/version.Version=20.10.0 '
            '-X github.com/docker/cli/cli/version.Version=27.0.1"',
            "27.0.1",
        ),
        ("-X github.com/docker/cli/cli/version.GitCommit=abc", None),  # not set
        ("-X github.com/docker/cli/cli/version.Version=", None),  # set to nothing
        ('"-X github.com/docker/cli/cli/version.Version=\\"\\""', None),  # an odd word
        ("\"-X 'github.com/docker/cli/cli/version.Version=28.2.2 beta'\"", None),  # two words
        ("-X github.com/docker/cli/cli/version.Version=28.2.2#1", None),  # not a version word
        ("-X example.com/github.com/docker/cli/cli/version.Version=9.9", None),  # another's
        ("-X github.com/docker/cli/cli/version.VersionSuffix=x", None),
        (None, None),  # built with -trimpath: no -ldflags setting
    ],
)
def test_the_ldflags_setting_is_read(tmp_path: Path, ldflags: str | None, expected: str) -> None:
    program = go_program(tmp_path / "docker", ldflags_lines(ldflags))
    assert linked_value(str(program), VERSION) == expected


@pytest.mark.parametrize("elf_class", [32, 64])
@pytest.mark.parametrize("order", ["little", "big"])
def test_every_elf_class_and_byte_order(
    tmp_path: Path, elf_class: Literal[32, 64], order: Literal["little", "big"]
) -> None:
    program = go_program(
        tmp_path / "docker", ldflags_lines(DOCKER_CE), elf_class=elf_class, order=order
    )
    assert linked_value(str(program), VERSION) == "28.2.2"


def test_files_that_do_not_say_it(tmp_path: Path) -> None:
    lines = ldflags_lines(DOCKER_CE)
    whole = go_program(tmp_path / "whole", lines).read_bytes()
    cases = {
        "missing": None,
        "empty": b"",
        "a script": b'#!/bin/sh\nexec docker-28.2.2 "$@"\n',
        "cut after the header": whole[:64],
        "cut in the section": whole[: whole.index(b"path\t") + 10],
    }
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        assert linked_value(str(tmp_path / name), VERSION) is None, name
    older_go = go_program(  # Go before 1.18: pointers, no build settings
        tmp_path / "older-go", lines, section=buildinfo_section("go1.17", lines, inline=False)
    )
    other_section = go_program(tmp_path / "other", lines, section_name=b".go.buildinfx")
    wrong_magic = go_program(
        tmp_path / "magic", lines, section=b"\xff Go buildinf?" + buildinfo_section("", lines)[14:]
    )
    cut_string = go_program(  # the module string says it is longer than the section
        tmp_path / "cut-string", lines, section=buildinfo_section("go1.24.3", lines)[:-40]
    )
    for program in (older_go, other_section, wrong_magic, cut_string):
        assert linked_value(str(program), VERSION) is None, program.name
    (tmp_path / "unreadable").mkdir()
    assert linked_value(str(tmp_path / "unreadable"), VERSION) is None
