"""The PCIe sampler runs while status is read and rests on an idle node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from agent.node.status import StatusService, StatusUnavailable
from tests.unit.agent.conftest import CountingBackend


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within 10 s"
        await asyncio.sleep(0.01)


async def _quiet(backend: CountingBackend, for_s: float = 0.15, timeout_s: float = 10.0) -> int:
    """Wait until the sampler reads no PCIe counter for ``for_s`` (it rests); the count then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    calls, since = backend.pcie_calls, loop.time()
    while loop.time() - since < for_s:
        assert loop.time() < deadline, "the sampler did not rest within 10 s"
        await asyncio.sleep(0.01)
        if backend.pcie_calls != calls:
            calls, since = backend.pcie_calls, loop.time()
    return calls


async def test_the_sampler_rests_without_readers_and_a_read_gets_a_fresh_sample() -> None:
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info(), pcie_interval_s=0.02, rest_after_s=0.2)
    status.start_sampler()
    try:
        await status.sweep()
        await _until(lambda: backend.pcie_calls >= 3)  # sampling while read
        resting_calls = await _quiet(backend)  # no read for 0.2 s: it rests
        await asyncio.sleep(0.3)
        assert backend.pcie_calls == resting_calls  # nothing sampled while resting
        sweep = await status.sweep()  # the first read after the rest
        assert backend.pcie_calls > resting_calls
        assert sweep.throughput_age_s is not None
        assert sweep.throughput_age_s < 0.2  # a fresh sample, not the one before the rest
        await _until(lambda: backend.pcie_calls >= resting_calls + 3)  # sampling again
    finally:
        await status.close()


async def test_reads_keep_the_sampler_going() -> None:
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info(), pcie_interval_s=0.02, rest_after_s=0.2)
    status.start_sampler()
    try:
        for _ in range(10):
            await status.sweep()
            await asyncio.sleep(0.05)
        calls = backend.pcie_calls
        await asyncio.sleep(0.1)  # within 0.2 s of the last read: still sampling
        assert backend.pcie_calls > calls
    finally:
        await status.close()


async def test_a_sweep_answers_the_requests_right_after_it_and_no_later() -> None:
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info(), shared_s=0.5)  # wide: a loaded machine
    try:
        first = await status.sweep()
        assert await status.sweep() is first  # within the window: the same sweep
        calls = backend.status_calls
        await asyncio.sleep(0.55)
        later = await status.sweep()
        assert later is not first
        assert backend.status_calls == calls + 1
        status.suspend("driver upgrade in progress")  # a suspension is never hidden by it
        with pytest.raises(StatusUnavailable):
            await status.sweep()
    finally:
        await status.close()


async def test_by_default_the_window_is_two_milliseconds() -> None:
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info())
    try:
        first = await status.sweep()
        await asyncio.sleep(0.01)
        assert await status.sweep() is not first
    finally:
        await status.close()
