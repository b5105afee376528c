"""The Podman tests' runtime follows the cgroup layout (crun refuses hybrid machines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.podman import cgroup_layout, runtime_for


def _mount(root: Path, *, unified: bool = False, top: bool = False) -> Path:
    root.mkdir()
    if top:
        (root / "cgroup.controllers").write_text("cpu memory\n")
    else:
        (root / "memory").mkdir()
    if unified:
        (root / "unified").mkdir()
        (root / "unified" / "cgroup.controllers").write_text("\n")
    return root


@pytest.mark.parametrize(
    ("shape", "layout", "runtime"),
    [
        ({"top": True}, "v2", None),
        ({"unified": True}, "hybrid", "runc"),
        ({}, "v1", None),
    ],
)
def test_each_layout_gets_a_runtime_that_runs_there(
    tmp_path: Path, shape: dict[str, bool], layout: str, runtime: str | None
) -> None:
    root = _mount(tmp_path / "cgroup", **shape)
    assert cgroup_layout(root) == layout
    assert runtime_for(layout) == runtime


def test_this_machines_layout_is_one_of_the_three() -> None:
    assert cgroup_layout() in ("v1", "hybrid", "v2")
