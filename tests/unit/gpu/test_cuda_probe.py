"""The CUDA facts read in a child process (so libcuda never maps into the daemon)."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import pytest

from agent.gpu import cuda_probe
from agent.gpu.cuda_driver import UNKNOWN_FACTS, CudaDeviceFacts


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
    cuda = cuda_probe.parse_answer(json.dumps(answer))
    assert cuda is not None
    assert cuda.device_facts("00000000:00:06.0") == CudaDeviceFacts(62914560, 233472, 65536, 132)
    assert cuda.device_facts("00000000:00:07.0") == CudaDeviceFacts(None, None, 65536, None)
    assert cuda.device_facts("00000000:00:08.0") == UNKNOWN_FACTS
    assert cuda.can_access_peer("00000000:00:06.0", "00000000:00:07.0") is True
    assert cuda.can_access_peer("00000000:00:07.0", "00000000:00:06.0") is None


def test_a_child_that_could_not_open_cuda_means_no_facts() -> None:
    assert cuda_probe.parse_answer("null") is None


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
        return subprocess.CompletedProcess(args, 0, "null", "")

    monkeypatch.setattr(subprocess, "run", run)
    assert cuda_probe.probe(["00000000:00:06.0"]) is None
    assert "CUDA_VISIBLE_DEVICES" not in seen
    assert (seen["CUDA_CACHE_DISABLE"], seen["CUDA_DISABLE_UNIFIED_MEMORY"]) == ("1", "1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["CUDA_CACHE_DISABLE"] == "0"
