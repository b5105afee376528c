"""The CUDA facts read in a child process (so libcuda never maps into the daemon)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from agent.gpu import cuda_probe
from agent.gpu.cuda_driver import UNKNOWN_FACTS, CudaDeviceFacts
from agent.gpu.hidden_libcuda import EMPTY_LIBCUDA_DIR, with_empty_libcuda

VERSION_LINE = '{"driver_version": 12080}\n'


def test_the_answer_maps_nvml_bus_ids_to_cuda_facts() -> None:
    answer = {
        "devices": {
            "0000:00:06.0": {
                "l2_cache_bytes": 62914560,
                "shared_memory_per_mp_bytes": 233472,
                "constant_memory_bytes": 65536,
                "multiprocessor_count": 132,
            },
            "0000:00:07.0": {
                "l2_cache_bytes": None,
                "shared_memory_per_mp_bytes": "x",
                "constant_memory_bytes": 65536,
                "multiprocessor_count": True,
            },
        },
        "peers": [["0000:00:06.0", "0000:00:07.0", True], ["0000:00:07.0", "0000:00:06.0", None]],
    }
    cuda = cuda_probe.parse_answer(VERSION_LINE + json.dumps(answer))
    assert cuda is not None
    assert cuda.driver_version == 12080
    assert cuda.device_facts("00000000:00:06.0") == CudaDeviceFacts(62914560, 233472, 65536, 132)
    assert cuda.device_facts("00000000:00:07.0") == CudaDeviceFacts(None, None, 65536, None)
    assert cuda.device_facts("00000000:00:08.0") == UNKNOWN_FACTS
    assert cuda.can_access_peer("00000000:00:06.0", "00000000:00:07.0") is True
    assert cuda.can_access_peer("00000000:00:07.0", "00000000:00:06.0") is None


def test_a_child_that_could_not_open_cuda_means_no_facts() -> None:
    assert cuda_probe.parse_answer('{"driver_version": null}\nnull\n') is None


def test_cuda_that_cannot_initialise_still_gives_the_version() -> None:
    """cuInit failed (no /dev/nvidia-uvm, say): no facts, but cuDriverGetVersion answered."""
    cuda = cuda_probe.parse_answer(VERSION_LINE + "null\n")
    assert cuda is not None
    assert cuda.driver_version == 12080
    assert cuda.device_facts("00000000:00:06.0") == UNKNOWN_FACTS
    assert cuda.can_access_peer("00000000:00:06.0", "00000000:00:07.0") is None


@pytest.mark.parametrize("line", ['{"driver_version": 0}', '{"driver_version": "13.0"}', "7"])
def test_a_version_that_is_no_positive_number_is_unknown(line: str) -> None:
    assert cuda_probe.parse_answer(line + "\nnull\n") is None


def _child(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """The probe runs ``code`` in a real Python child instead of ``agent.gpu.cuda_probe``."""
    real_run = subprocess.run

    def run(args: list[str], **kwargs: Any) -> Any:
        return real_run([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(subprocess, "run", run)


def test_a_child_that_crashes_after_the_version_line_still_gives_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """cuInit crashing the child (SIGSEGV in the driver): the version it wrote first stays."""
    _child(monkeypatch, f"import os, signal, sys; sys.stdout.write({VERSION_LINE!r}); "
                        "sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    with caplog.at_level(logging.WARNING):
        cuda = cuda_probe.probe(["00000000:00:06.0"])
    assert cuda is not None
    assert cuda.driver_version == 12080
    assert cuda.device_facts("00000000:00:06.0") == UNKNOWN_FACTS
    assert "exit code -9" in caplog.text


def test_a_child_answering_garbage_after_the_version_keeps_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _child(monkeypatch, f"print({VERSION_LINE.strip()!r}); print('{{not json')")
    cuda = cuda_probe.probe(["00000000:00:06.0"])
    assert cuda is not None
    assert cuda.driver_version == 12080


def test_a_child_cut_off_after_the_version_line_still_gives_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung cuInit: the child is killed at the timeout; what it wrote first is kept (on
    POSIX, ``subprocess.run`` puts the output so far, as bytes, into ``TimeoutExpired``)."""

    def run(args: list[str], **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args, 60.0, output=VERSION_LINE.encode())

    monkeypatch.setattr(subprocess, "run", run)
    cuda = cuda_probe.probe(["00000000:00:06.0"])
    assert cuda is not None
    assert cuda.driver_version == 12080


def test_a_child_cut_off_mid_line_gives_nothing() -> None:
    assert cuda_probe.version_only('{"driver_vers') is None
    assert cuda_probe.version_only("") is None


def test_a_hanging_child_is_cut_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert cuda_probe.probe(["00000000:00:06.0"], timeout_s=0.001) is None
    assert "reported as null" in caplog.text


def test_the_real_child_runs_and_answers() -> None:
    """Here (no GPU) the child finds no usable libcuda and says so; on a GPU node it reads."""
    result = cuda_probe.probe(["00000000:00:06.0"])
    if result is not None:
        facts = result.device_facts("00000000:00:06.0")
        assert facts == UNKNOWN_FACTS or (facts.multiprocessor_count or 0) > 0


def test_the_child_sees_every_gpu_whatever_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA_VISIBLE_DEVICES of the caller must not hide GPUs from discovery, and the caller's
    own environment stays as it was (the wrapper execs docker with it)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "0")
    seen: dict[str, str] = {}

    def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        env = kwargs["env"]
        assert isinstance(env, dict)
        seen.update(env)
        return subprocess.CompletedProcess(args, 0, '{"driver_version": null}\nnull\n', "")

    monkeypatch.setattr(subprocess, "run", run)
    assert cuda_probe.probe(["00000000:00:06.0"]) is None
    assert "CUDA_VISIBLE_DEVICES" not in seen
    assert (seen["CUDA_CACHE_DISABLE"], seen["CUDA_DISABLE_UNIFIED_MEMORY"]) == ("1", "1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["CUDA_CACHE_DISABLE"] == "0"


def test_the_child_loads_the_libcuda_the_worker_hides_from_nvml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU worker runs with the empty libcuda.so.1 first on LD_LIBRARY_PATH; the CUDA
    child it starts must search as anything else would, the user's own entries kept."""
    for key, value in with_empty_libcuda({"LD_LIBRARY_PATH": "/opt/cuda/lib64"}).items():
        monkeypatch.setenv(key, value)
    env = cuda_probe.discovery_environment(os.environ)
    assert env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64"
    monkeypatch.setenv("LD_LIBRARY_PATH", EMPTY_LIBCUDA_DIR)
    assert "LD_LIBRARY_PATH" not in cuda_probe.discovery_environment(os.environ)
