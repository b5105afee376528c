"""Paths resolved inside another root: links followed there, never out of it."""

from __future__ import annotations

import os
from pathlib import Path

from cdi import rooted


def test_absolute_and_relative_links_stay_in_the_root(tmp_path: Path) -> None:
    (tmp_path / "usr/local/cuda-13.1/compat").mkdir(parents=True)
    (tmp_path / "usr/local/cuda").symlink_to("cuda-13.1")  # relative, as CUDA images have it
    (tmp_path / "etc/alternatives").mkdir(parents=True)
    (tmp_path / "etc/alternatives/egl.json").symlink_to("/usr/local/cuda/compat")  # absolute
    assert rooted.resolve(tmp_path, "/usr/local/cuda/compat") == "/usr/local/cuda-13.1/compat"
    assert rooted.resolve(tmp_path, "/etc/alternatives/egl.json") == "/usr/local/cuda-13.1/compat"
    assert rooted.resolve(tmp_path, "/usr/./local//cuda/") == "/usr/local/cuda-13.1"


def test_dotdot_and_absolute_targets_never_leave_the_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("the root's own\n")
    (tmp_path / "up").symlink_to("../../../../../etc")
    (tmp_path / "abs").symlink_to("/etc/passwd")
    assert rooted.resolve(tmp_path, "/up/passwd") == "/etc/passwd"
    assert rooted.resolve(tmp_path, "/../../etc/passwd") == "/etc/passwd"
    assert rooted.resolve(tmp_path, "/abs") == "/etc/passwd"
    assert rooted.on_host(tmp_path, "/etc/passwd").read_text() == "the root's own\n"


def test_missing_paths_and_loops_are_none(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("/a")
    (tmp_path / "dangling").symlink_to("/nowhere")
    assert rooted.resolve(tmp_path, "/a") is None
    assert rooted.resolve(tmp_path, "/dangling") is None
    assert rooted.resolve(tmp_path, "/missing/file") is None


def test_the_host_root_is_the_plain_real_path(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert rooted.resolve(Path("/"), str(tmp_path / "link")) == os.path.realpath(tmp_path / "real")
