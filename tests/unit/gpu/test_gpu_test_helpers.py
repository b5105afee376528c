"""The nvidia-smi parsers of tests/gpu, on the fixture machines' real output.

The GPU tests run once, on a borrowed machine: their parsers are checked here first.
"""

from __future__ import annotations

from tests.gpu.test_nvml_real import parse_topo
from tests.support.fixture_files import FIXTURES


def test_parse_topo_two_h200() -> None:
    text = (FIXTURES / "h200x2" / "topo.txt").read_text()
    assert parse_topo(text, 2) == [["X", "NV18"], ["NV18", "X"]]


def test_parse_topo_one_h200() -> None:
    text = (FIXTURES / "h200" / "topo.txt").read_text()
    assert parse_topo(text, 1) == [["X"]]
