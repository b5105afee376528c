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


async def test_the_sampler_rests_without_readers_and_a_read_gets_a_fresh_sample() -> None:
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info(), pcie_interval_s=0.02, rest_after_s=0.2)
    status.start_sampler()
    try:
        await status.sweep()
        await _until(lambda: backend.pcie_calls >= 3)  # sampling while read
        await _until(lambda: status.sampler_resting)  # no read for 0.2 s: it rests
        resting_calls = backend.pcie_calls
        await asyncio.sleep(0.3)
        assert backend.pcie_calls == resting_calls  # nothing sampled while resting
        sweep = await status.sweep()  # the first read after the rest
        assert backend.pcie_calls > resting_calls
        assert sweep.throughput_age_s is not None
        assert sweep.throughput_age_s < 0.2  # a fresh sample, not the one before the rest
        await _until(lambda: backend.pcie_calls >= resting_calls + 3)  # sampling again
    finally:
        await status.close()


async def test_a_quiet_sweep_takes_one_sample_when_the_rested_one_is_old() -> None:
    """The usage ledger's sweeps are quiet: they never wake the sampler, but while it rests
    they take one sample when the last is older than they allow (the energy counters)."""
    backend = CountingBackend("h200")
    status = StatusService(backend, backend.node_info(), pcie_interval_s=0.02, rest_after_s=0.2)
    status.start_sampler()
    try:
        await _until(lambda: status.sampler_resting)
        resting_calls = backend.pcie_calls
        await asyncio.sleep(0.3)
        await status.sweep(quiet=True)  # no freshness asked: nothing sampled
        assert backend.pcie_calls == resting_calls
        sweep = await status.sweep(quiet=True, sample_within_s=0.25)
        assert backend.pcie_calls == resting_calls + 1  # the rested sample was 0.3 s old
        assert sweep.throughput_age_s is not None
        assert sweep.throughput_age_s < 0.25
        await status.sweep(quiet=True, sample_within_s=10.0)  # fresh enough: none more
        await asyncio.sleep(0.1)
        assert backend.pcie_calls == resting_calls + 1
        assert status.sampler_resting  # and the sampler still rests
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
        assert not status.sampler_resting
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
