"""Fixtures of the GPU backend tests: a fake pynvml in place of the real one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.gpu import nvml_query, nvml_topology
from agent.gpu.nvml_backend import NvmlBackend
from tests.unit.gpu.fake_nvml import FakeCuda, FakeNvml, load_capture

MakeFake = Callable[[str], FakeNvml]


@pytest.fixture
def make_fake(monkeypatch: pytest.MonkeyPatch) -> MakeFake:
    """Install a fake pynvml built from a fixture capture (``h200`` or ``h200x2``)."""
    # A user's CUDA settings, which start() must leave as they are.
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_UNIFIED_MEMORY", "CUDA_CACHE_DISABLE"):
        monkeypatch.setenv(name, "test-value")
    monkeypatch.setattr(nvml_query, "_warned", set())  # every test warns once afresh
    monkeypatch.setattr(nvml_topology, "_ambiguous_warned", set())

    def make(name: str) -> FakeNvml:
        fake = FakeNvml(load_capture(name))
        monkeypatch.setattr(nvml_query, "pynvml", fake.module)
        return fake

    return make


StartBackend = Callable[..., NvmlBackend]


@pytest.fixture
def start_backend(tmp_path: Path) -> Iterator[StartBackend]:
    """Start NvmlBackend on the installed fake; CUDA facts from the same capture."""
    started: list[NvmlBackend] = []

    def start(fake: FakeNvml, *, cuda: bool = True, proc: Path | None = None) -> NvmlBackend:
        cuda_facts = FakeCuda(fake.capture) if cuda else None
        backend = NvmlBackend.start(
            cuda=lambda _bus_ids: cuda_facts, sysfs=tmp_path / "sys", proc=proc or tmp_path / "proc"
        )
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.close()
