"""A container CLI's ``--version``, asked once per program file and remembered
(``controller.wrapper.cli_versions``), and the CDI question that uses it for Podman and for
a docker CLI whose file does not record its version (``engine_cdi``).

The programs are real ELF files compiled here (gcc): each prints a version line and
appends its arguments to a calls file, so a test sees whether it was run. Real Podman and
Debian's docker CLI are checked in ``tests/e2e/test_cli_versions.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from controller.wrapper import cli_versions
from controller.wrapper.cli_versions import cache_file, cli_version, parse
from controller.wrapper.docker_args import scan
from controller.wrapper.engine_cdi import ask_engine
from tests.unit.controller.cli_program import cli_program

RUN = ["run", "--rm", "nvidia/cuda:12.4"]


def runs(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """An environment whose cache is under ``tmp_path``."""
    return {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}


@pytest.mark.parametrize(
    ("printed", "said"),
    [
        ("Docker version 26.1.5+dfsg1, build a72d7cd\n", ("Docker", "26.1.5+dfsg1")),
        ("Docker version 28.2.2, build e6534b4", ("Docker", "28.2.2")),
        ("podman version 4.3.1\n", ("podman", "4.3.1")),
        ("podman-remote version 5.4.2\n", ("podman-remote", "5.4.2")),
        ("Docker version", None),
        ("docker version 26.1.5", None),  # not what the CLI prints: not trusted
        ("podman version 4.3.1;rm", None),
        ("Usage: docker [OPTIONS] COMMAND", None),
        ("", None),
    ],
)
def test_the_version_line_is_read_strictly(printed: str, said: tuple[str, str] | None) -> None:
    assert parse(printed) == said


def test_a_program_is_asked_once_and_its_answer_remembered(
    tmp_path: Path, home: dict[str, str]
) -> None:
    calls = tmp_path / "calls"
    docker = cli_program(tmp_path / "docker", "Docker version 26.1.5+dfsg1, build a72d7cd", calls)
    asked: list[str] = []
    assert cli_version(str(docker), home, asked) == ("Docker", "26.1.5+dfsg1")
    assert cli_version(str(docker), home, asked) == ("Docker", "26.1.5+dfsg1")
    assert runs(calls) == ["--version"]
    assert asked == ["docker --version", "docker --version, remembered"]
    stored = json.loads(Path(home["XDG_CACHE_HOME"], "nvidia-docker/cli-versions.json").read_text())
    assert list(stored) == [str(docker)]
    assert stored[str(docker)]["version"] == "26.1.5+dfsg1"


def test_an_upgraded_program_is_asked_again(tmp_path: Path, home: dict[str, str]) -> None:
    calls = tmp_path / "calls"
    podman = cli_program(tmp_path / "podman", "podman version 4.3.1", calls)
    assert cli_version(str(podman), home) == ("podman", "4.3.1")
    cli_program(podman, "podman version 5.4.2", calls)  # the package manager's new file
    assert cli_version(str(podman), home) == ("podman", "5.4.2")
    assert cli_version(str(podman), home) == ("podman", "5.4.2")
    assert runs(calls) == ["--version", "--version"]


def test_the_same_file_rewritten_in_place_is_asked_again(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """Same inode, other contents (``cp`` over it): its times and size say so."""
    calls = tmp_path / "calls"
    first = cli_program(tmp_path / "first", "Docker version 20.10.24+dfsg1, build 297e128", calls)
    second = cli_program(tmp_path / "second", "Docker version 26.1.5+dfsg1, build a72d7cd", calls)
    docker = tmp_path / "docker"
    docker.write_bytes(first.read_bytes())
    docker.chmod(0o755)
    assert cli_version(str(docker), home) == ("Docker", "20.10.24+dfsg1")
    inode = docker.stat().st_ino
    with docker.open("r+b") as file:
        file.write(second.read_bytes())
    assert docker.stat().st_ino == inode
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")


def test_a_link_is_remembered_as_the_file_it_names(tmp_path: Path, home: dict[str, str]) -> None:
    calls = tmp_path / "calls"
    real = cli_program(tmp_path / "podman-4.3.1", "podman version 4.3.1", calls)
    for name in ("podman", "podman-too"):
        (tmp_path / name).symlink_to(real.name)
        assert cli_version(str(tmp_path / name), home) == ("podman", "4.3.1")
    assert runs(calls) == ["--version"]


def test_a_script_is_never_asked(tmp_path: Path, home: dict[str, str]) -> None:
    """A script's answer is whatever it runs now: the caller asks as before."""
    calls = tmp_path / "calls"
    script = tmp_path / "docker"
    script.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\necho 'podman version 4.3.1'\n")
    script.chmod(0o755)
    assert cli_version(str(script), home) is None
    assert runs(calls) == []


def test_a_program_that_says_no_version_is_not_remembered(
    tmp_path: Path, home: dict[str, str]
) -> None:
    calls = tmp_path / "calls"
    odd = cli_program(tmp_path / "docker", "Usage: docker [OPTIONS] COMMAND", calls)
    assert cli_version(str(odd), home) is None
    assert cli_version(str(odd), home) is None
    assert runs(calls) == ["--version", "--version"]
    assert not Path(home["XDG_CACHE_HOME"], "nvidia-docker/cli-versions.json").exists()


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'["a list"]', b'{"/usr/bin/docker": 7}', b"\xff\xfe", b""],
)
def test_a_damaged_cache_is_asked_around_and_replaced(
    tmp_path: Path, home: dict[str, str], content: bytes
) -> None:
    calls = tmp_path / "calls"
    docker = cli_program(tmp_path / "docker", "Docker version 26.1.5+dfsg1, build x", calls)
    store = Path(home["XDG_CACHE_HOME"], "nvidia-docker/cli-versions.json")
    store.parent.mkdir(parents=True)
    store.write_bytes(content)
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")
    assert runs(calls) == ["--version"]


def test_a_tampered_entry_is_not_believed(tmp_path: Path, home: dict[str, str]) -> None:
    """An entry whose version is not a version word is asked again (never printed or
    used as it stands)."""
    calls = tmp_path / "calls"
    docker = cli_program(tmp_path / "docker", "Docker version 26.1.5+dfsg1, build x", calls)
    assert cli_version(str(docker), home) is not None
    store = Path(home["XDG_CACHE_HOME"], "nvidia-docker/cli-versions.json")
    entries = json.loads(store.read_text())
    entries[str(docker)]["version"] = "99.0 \x1b[2J"
    store.write_text(json.dumps(entries))
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")
    assert runs(calls) == ["--version", "--version"]


def test_without_a_usable_cache_the_program_is_asked_each_time(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    docker = cli_program(tmp_path / "docker", "Docker version 26.1.5+dfsg1, build x", calls)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for environment in ({"PATH": "/bin"}, {"HOME": "relative"}, {"XDG_CACHE_HOME": str(blocked)}):
        assert cli_version(str(docker), environment) == ("Docker", "26.1.5+dfsg1")
    assert runs(calls) == ["--version"] * 3
    assert list(tmp_path.iterdir()).count(blocked) == 1
    assert not any(p.name.startswith(".cli-versions") for p in tmp_path.rglob("*"))


def test_where_the_answers_are_kept() -> None:
    assert cache_file({"HOME": "/home/ada"}) == "/home/ada/.cache/nvidia-docker/cli-versions.json"
    assert cache_file({"HOME": "/home/ada", "XDG_CACHE_HOME": "/var/cache/ada"}) == (
        "/var/cache/ada/nvidia-docker/cli-versions.json"
    )
    assert cache_file({"HOME": "/home/ada", "XDG_CACHE_HOME": "rel"}) == (
        "/home/ada/.cache/nvidia-docker/cli-versions.json"
    )
    assert cache_file({}) is None


def test_the_cache_keeps_a_bounded_number_of_programs(
    tmp_path: Path, home: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_versions, "MAX_PROGRAMS", 2)
    calls = tmp_path / "calls"
    programs = [
        cli_program(tmp_path / f"docker{i}", f"Docker version 2{i}.0.0, build x", calls)
        for i in range(3)
    ]
    for program in programs:
        cli_version(str(program), home)
    store = Path(home["XDG_CACHE_HOME"], "nvidia-docker/cli-versions.json")
    assert list(json.loads(store.read_text())) == [str(p) for p in programs[1:]]


def test_podman_is_asked_its_version_once_not_at_every_run(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """``NV_DOCKER=podman``: the CDI question is ``podman --version`` once, then the
    remembered answer (it was ``podman version``, 20 to 100 ms, at every run)."""
    calls = tmp_path / "calls"
    cli_program(tmp_path / "podman", "podman version 4.3.1", calls)
    environment = {**home, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    first = ask_engine(("podman",), scan(RUN), environment)
    again = ask_engine(("podman",), scan(RUN), environment)
    for found in (first, again):
        assert (found.engine, found.reads_cdi, found.reason) == (
            "Podman 4.3.1", True, "Podman reads CDI"
        )  # fmt: skip
    assert first.asked == ("podman --version",)
    assert again.asked == ("podman --version, remembered",)
    assert runs(calls) == ["--version"]


def test_a_podman_before_cdi_is_remembered_as_such(tmp_path: Path, home: dict[str, str]) -> None:
    calls = tmp_path / "calls"
    cli_program(tmp_path / "podman", "podman version 3.4.4", calls)
    environment = {**home, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    found = ask_engine(("podman",), scan(RUN), environment)
    assert (found.engine, found.reads_cdi) == ("Podman 3.4.4", False)
    assert found.reason == "Podman reads CDI from 4.0 on"


def test_podman_of_several_words_is_asked_as_before(tmp_path: Path, home: dict[str, str]) -> None:
    """``sudo podman``, ``podman --root ...``: ``version``, whose Client part decides."""
    calls = tmp_path / "calls"
    client = '{\\"Client\\": {\\"Version\\": \\"4.3.1\\", \\"OsArch\\": \\"linux/amd64\\"}}'
    cli_program(tmp_path / "podman", client, calls)
    environment = {**home, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    found = ask_engine(("podman", "--root", "/tmp/store"), scan(RUN), environment)
    assert (found.engine, found.reads_cdi, found.asked) == (
        "Podman 4.3.1",
        True,
        ("docker version",),
    )
    assert runs(calls) == ["--root /tmp/store version --format {{json .}}"]
    assert not Path(home["XDG_CACHE_HOME"]).exists()


def test_a_podman_that_says_nothing_clear_is_asked_version(
    tmp_path: Path, home: dict[str, str]
) -> None:
    calls = tmp_path / "calls"
    client = '{\\"Client\\": {\\"Version\\": \\"4.3.1\\", \\"OsArch\\": \\"linux/amd64\\"}}'
    cli_program(tmp_path / "podman", client, calls)  # prints JSON for --version too
    environment = {**home, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    found = ask_engine(("podman",), scan(RUN), environment)
    assert (found.engine, found.reads_cdi) == ("Podman 4.3.1", True)
    assert found.asked == ("podman --version", "docker version")
    assert runs(calls) == ["--version", "version --format {{json .}}"]


def test_a_cli_program_named_in_full_is_remembered_by_its_file(
    tmp_path: Path, home: dict[str, str]
) -> None:
    calls = tmp_path / "calls"
    podman = cli_program(tmp_path / "podman", "podman version 5.4.2", calls)
    first = ask_engine((str(podman),), scan(RUN), home)
    again = ask_engine((str(podman),), scan(RUN), home)
    assert (first.engine, first.asked) == ("Podman 5.4.2", ("podman --version",))
    assert (again.engine, again.asked) == ("Podman 5.4.2", ("podman --version, remembered",))
    assert runs(calls) == ["--version"]


def test_another_user_s_cache_is_neither_believed_nor_written(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """``sudo nvidia-docker`` that keeps the caller's ``HOME``: root does not trust the
    caller's file, and leaves no directory of its own in the caller's home."""
    if os.geteuid() != 0:
        pytest.skip("needs root to own files as another user")
    calls = tmp_path / "calls"
    docker = cli_program(tmp_path / "docker", "Docker version 26.1.5+dfsg1, build x", calls)
    caller = Path(home["XDG_CACHE_HOME"])
    caller.mkdir()
    os.chown(caller, 4321, 4321)
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")
    assert list(caller.iterdir()) == []  # nothing written there
    store = caller / "nvidia-docker" / "cli-versions.json"
    store.parent.mkdir()
    real = str(docker.resolve())
    identity = [*_file_identity(docker)]
    store.write_text(json.dumps({real: {"file": identity, "name": "Docker", "version": "99.0"}}))
    for path in (store.parent, store):
        os.chown(path, 4321, 4321)
    assert cli_version(str(docker), home) == ("Docker", "26.1.5+dfsg1")  # not 99.0
    assert runs(calls) == ["--version", "--version"]
    assert json.loads(store.read_text())[real]["version"] == "99.0"  # not replaced either
    assert store.stat().st_uid == 4321


def _file_identity(path: Path) -> tuple[int, ...]:
    stat = path.stat()
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
