"""Other specs of our kind: what a spec defines, and where ours stands beside them."""

from __future__ import annotations

from typing import Any

import pytest

from cdi import others
from cdi.others import OtherSpec

OURS = frozenset({"0", "GPU-a", "0:0", "all"})
RUN, ETC = "/run/cdi", "/etc/cdi"


def other(path: str, names: set[str], kind: str = "nvidia.com/gpu") -> OtherSpec:
    return OtherSpec(path, path.rsplit("/", 1)[0], kind, frozenset(names))


@pytest.mark.parametrize(
    ("document", "summary"),
    [
        (
            {"kind": "nvidia.com/gpu", "devices": [{"name": "0"}, {"name": "all"}, {"x": 1}]},
            ("nvidia.com/gpu", frozenset({"0", "all"})),
        ),
        ({"kind": "nvidia.com/gpu"}, ("nvidia.com/gpu", frozenset())),
        ({"kind": "nvidia.com/gpu", "devices": "all"}, ("nvidia.com/gpu", frozenset())),
        (
            {"kind": "vendor.com/x", "devices": [{"name": "bad name"}]},
            ("vendor.com/x", frozenset()),
        ),
        ({"kind": "no-slash", "devices": [{"name": "0"}]}, None),
        ({"devices": [{"name": "0"}]}, None),
        (["kind", "nvidia.com/gpu"], None),
        (None, None),
    ],
)
def test_what_a_spec_defines(document: Any, summary: Any) -> None:
    assert others.summarize(document) == summary


def test_a_spec_beside_ours_with_our_names_makes_ours_step_aside() -> None:
    toolkit = other(f"{RUN}/nvidia.yaml", {"0", "all", "GPU-a"})
    stand = others.standing("nvidia.com/gpu", OURS, {RUN}, [toolkit])
    assert stand.aside
    assert stand.clashing == (toolkit,)
    assert stand.elsewhere == ()
    assert stand.names_in_force == {"0", "all", "GPU-a"}


def test_specs_elsewhere_of_another_kind_or_without_our_names_do_not() -> None:
    static = other(f"{ETC}/nvidia.yaml", {"0", "all"})
    another_kind = other(f"{RUN}/mine.yaml", {"0"}, kind="nvidia-docker.com/gpu")
    other_names = other(f"{RUN}/extra.yaml", {"gpu-extra"})
    stand = others.standing("nvidia.com/gpu", OURS, {RUN}, [static, another_kind, other_names])
    assert not stand.aside
    assert stand.elsewhere == (static,)
    assert others.standing("nvidia-docker.com/gpu", OURS, {RUN}, [static]).elsewhere == ()


def test_the_later_directory_of_the_engines_list_wins() -> None:
    order = [ETC, RUN]
    assert others.later(ETC, RUN, order) == RUN
    assert others.later(RUN, ETC, order) == RUN
    assert others.later("/srv/cdi", RUN, order) is None
