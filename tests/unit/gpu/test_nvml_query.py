"""The NVML choke point: None for every missing value, warnings once, never an exception."""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu import nvml_query


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = pynvml.NVMLError  # type: ignore[attr-defined]
    monkeypatch.setattr(nvml_query, "pynvml", module)
    monkeypatch.setattr(nvml_query, "_warned", set())
    return module


def raising(code: int) -> Any:
    def fn(*_args: Any) -> Any:
        raise pynvml.NVMLError(code)

    return fn


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_bytes_are_decoded(fake_module: types.ModuleType) -> None:
    fake_module.nvmlDeviceGetName = lambda _h: b"NVIDIA H200"  # type: ignore[attr-defined]
    fake_module.nvmlList = lambda: [b"a", (b"b", 1)]  # type: ignore[attr-defined]
    assert nvml_query.query("nvmlDeviceGetName", object()) == "NVIDIA H200"
    assert nvml_query.query("nvmlList") == ["a", ("b", 1)]


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNKNOWN,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_NO_DATA,
        pynvml.NVML_ERROR_RESET_REQUIRED,
    ],
)
def test_errors_become_none(fake_module: types.ModuleType, code: int) -> None:
    fake_module.nvmlDeviceGetTemperature = raising(code)  # type: ignore[attr-defined]
    outcome = nvml_query.attempt("nvmlDeviceGetTemperature", object(), 0)
    assert outcome.value is None
    assert outcome.error == code
    assert outcome.lost == (code == pynvml.NVML_ERROR_GPU_IS_LOST)


def test_not_supported_is_quiet_and_others_warn_once(
    fake_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    fake_module.nvmlA = raising(pynvml.NVML_ERROR_NOT_SUPPORTED)  # type: ignore[attr-defined]
    fake_module.nvmlB = raising(pynvml.NVML_ERROR_NO_PERMISSION)  # type: ignore[attr-defined]
    fake_module.nvmlC = raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # type: ignore[attr-defined]
    for _ in range(5):
        for name in ("nvmlA", "nvmlB", "nvmlC", "nvmlMissing"):
            assert nvml_query.query(name) is None
    lines = warnings_of(caplog)
    assert len(lines) == 3
    assert [m for m in lines if "nvmlB" in m] == [
        "nvmlB: insufficient permissions: reported as null"
    ]
    (old_driver,) = [m for m in lines if "nvmlC" in m]
    assert "update the NVIDIA driver" in old_driver
    (old_pynvml,) = [m for m in lines if "nvmlMissing" in m]
    assert "nvidia-ml-py" in old_pynvml


def test_python_errors_inside_pynvml_never_escape(
    fake_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: Any) -> Any:
        raise TypeError("bad ctypes argument")

    fake_module.nvmlBroken = broken  # type: ignore[attr-defined]
    assert nvml_query.query("nvmlBroken", 1) is None
    assert nvml_query.query("nvmlBroken", 1) is None
    assert len(warnings_of(caplog)) == 1


def test_attempt_first_falls_back_only_while_missing(fake_module: types.ModuleType) -> None:
    fake_module.nvmlF_v3 = raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # type: ignore[attr-defined]
    fake_module.nvmlF = lambda: 7  # type: ignore[attr-defined]
    assert nvml_query.attempt_first(("nvmlF_v3", "nvmlF_v2", "nvmlF")).value == 7
    fake_module.nvmlF_v3 = raising(pynvml.NVML_ERROR_NOT_SUPPORTED)  # type: ignore[attr-defined]
    outcome = nvml_query.attempt_first(("nvmlF_v3", "nvmlF_v2", "nvmlF"))
    assert (outcome.value, outcome.error) == (None, pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_attempt_first_none_available_warns_once(
    fake_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):
        assert nvml_query.attempt_first(("nvmlG_v2", "nvmlG")).value is None
    assert len(warnings_of(caplog)) == 1


def test_call_raises_with_the_code(fake_module: types.ModuleType) -> None:
    fake_module.nvmlInit = raising(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)  # type: ignore[attr-defined]
    with pytest.raises(nvml_query.NvmlCallError) as caught:
        nvml_query.call("nvmlInit")
    assert caught.value.code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert "driver not loaded" in str(caught.value)


def test_only_agent_gpu_imports_pynvml() -> None:
    """README.md (Architecture): only agent/gpu/ imports pynvml."""
    root = Path(__file__).resolve().parents[3]
    offenders = []
    for package in ("agent", "plugin", "mesos", "controller"):
        for path in (root / package).rglob("*.py"):
            if path.is_relative_to(root / "agent" / "gpu"):
                continue
            text = path.read_text(encoding="utf-8")
            if "import pynvml" in text or "from pynvml" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
