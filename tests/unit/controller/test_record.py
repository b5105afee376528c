"""``controller.record``: the same value classes as frozen, slotted dataclasses, without
importing ``dataclasses`` (the wrapper's run path: docs/nvidia-docker.md, "Speed").

Each behaviour is checked against the frozen dataclass written from the same class body.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from controller.options import Options, declarations
from controller.record import FrozenInstanceError, field, fields, is_record, record, replace
from controller.transport.endpoint import Endpoint, parse_endpoint
from controller.transport.tls import TlsOptions

REPO = Path(__file__).resolve().parents[3]


@record
class Point:
    """A record, as the run path writes them."""

    x: int
    y: int = 0
    label: str | None = None
    seen: tuple[str, ...] = field(default=(), compare=False)

    @property
    def norm(self) -> int:
        return abs(self.x) + abs(self.y)


@dataclasses.dataclass(frozen=True, slots=True)
class DataPoint:
    """The same class body as a frozen dataclass."""

    x: int
    y: int = 0
    label: str | None = None
    seen: tuple[str, ...] = dataclasses.field(default=(), compare=False)


def test_construction_is_a_dataclass_s() -> None:
    pairs = [
        (Point(1), DataPoint(1)),
        (Point(1, 2, label="a"), DataPoint(1, 2, label="a")),
        (Point(x=3, seen=("s",)), DataPoint(x=3, seen=("s",))),
    ]
    for ours, theirs in pairs:
        assert repr(ours) == repr(theirs).replace("DataPoint", "Point")
        assert (ours.x, ours.y, ours.label, ours.seen) == (
            theirs.x,
            theirs.y,
            theirs.label,
            theirs.seen,
        )
    assert Point(3, -4).norm == 7
    assert vars(Point)["__slots__"] == ("x", "y", "label", "seen")
    assert not hasattr(Point(1), "__dict__")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda cls: cls(), "missing"),
        (lambda cls: cls(1, x=2), "multiple values for argument 'x'"),
        (lambda cls: cls(1, z=2), "unexpected keyword argument 'z'"),
        (lambda cls: cls(1, 2, None, (), 5), "positional arguments but"),
    ],
)
def test_wrong_arguments_are_type_errors_as_with_a_dataclass(call: object, message: str) -> None:
    for cls in (Point, DataPoint):
        with pytest.raises(TypeError, match=message):
            call(cls)  # type: ignore[operator]


def test_frozen_equal_hashable_copyable() -> None:
    point = Point(1, 2, seen=("a",))
    with pytest.raises(FrozenInstanceError, match="cannot assign to field 'x'"):
        point.x = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del point.y
    # seen is not compared, as dataclasses.field(compare=False) leaves it out
    assert point == Point(1, 2, seen=("b",))
    assert DataPoint(1, 2, seen=("a",)) == DataPoint(1, 2, seen=("b",))
    assert hash(point) == hash(Point(1, 2))
    assert point != Point(1, 3)
    other: object = DataPoint(1, 2)
    assert point != other  # another class is never equal
    assert {point, Point(1, 2)} == {point}
    for copied in (copy.copy(point), copy.deepcopy(point), pickle.loads(pickle.dumps(point))):
        assert copied == point
        assert copied.seen == ("a",)


def test_replace_and_fields() -> None:
    point = Point(1, 2, "a")
    assert replace(point, y=5) == Point(1, 5, "a")
    assert point == Point(1, 2, "a")  # unchanged
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        replace(point, z=1)
    names = [name for name, _default, _meta in fields(Point)]
    assert names == [f.name for f in dataclasses.fields(DataPoint)]
    assert is_record(Point)
    assert not is_record(DataPoint)


def test_a_field_without_a_default_after_one_with_is_refused() -> None:
    with pytest.raises(TypeError, match="a field without a default follows one with"):

        @record
        class Wrong:
            a: int = 0
            b: int  # type: ignore[misc]


def test_a_method_that_names_its_class_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Wrong.__repr__ uses super\(\) or __class__"):

        @record
        class Wrong:
            a: int = 0

            def __repr__(self) -> str:
                return super().__repr__()


def test_the_run_path_s_classes() -> None:
    """Endpoint (its own __init__), TlsOptions and Options behave as they did."""
    endpoint = parse_endpoint("ssh://admin@node2:2222")
    assert endpoint == Endpoint("ssh", "node2", 2222, 3476, "admin", "argument")  # defaults not
    assert hash(endpoint) == hash(Endpoint("ssh", "node2", 2222, 3476, "admin", "argument"))
    assert repr(Endpoint("local")) == (
        "Endpoint(transport='local', host='localhost', ssh_port=22, http_port=3476, user=None, "
        "source='default', tls=False, ssh_defaults=frozenset())"
    )
    assert TlsOptions("/ca") == TlsOptions(ca="/ca")
    assert TlsOptions("/ca").over(TlsOptions(cert="/c")) == TlsOptions("/ca", "/c")
    options = Options.build({"HOME": "/h", "USER": "u", "NV_GPU": "auto:2"})
    assert options.home == "/h"
    assert options == Options.build({"HOME": "/h", "USER": "u", "NV_GPU": "auto:2", "X": "1"})
    with pytest.raises(FrozenInstanceError):
        options.debug = True  # type: ignore[misc]
    assert [name for name, _, _ in declarations(Options)][:3] == ["nv_host", "docker", "gpus"]


def test_no_dataclasses_at_import() -> None:
    probe = (
        "import sys\n"
        "import controller.options, controller.wrapper.gpu_args\n"
        "assert 'dataclasses' not in sys.modules, 'dataclasses'\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
