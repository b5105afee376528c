"""Per-name locks that exist only while used: the store's memory cannot grow by name."""

from __future__ import annotations

import gc
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from plugin.name_locks import NameLocks
from plugin.volumes import NO_SUCH_VOLUME, VolumeError, VolumeStore


def test_a_lock_excludes_and_is_dropped_when_its_last_user_leaves() -> None:
    locks = NameLocks()
    inside = 0
    most = 0
    guard = threading.Lock()

    def work(_: int) -> None:
        nonlocal inside, most
        with locks.hold("nvidia_driver_1.0"):
            with guard:
                inside += 1
                most = max(most, inside)
            with guard:
                inside -= 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(2000)))
    assert most == 1
    assert len(locks) == 0


def test_a_failing_block_lets_the_lock_go() -> None:
    locks = NameLocks()
    with pytest.raises(RuntimeError), locks.hold("x"):
        raise RuntimeError
    assert len(locks) == 0
    with locks.hold("x"):
        assert len(locks) == 1


def _blocks() -> int:
    gc.collect()
    return sys.getallocatedblocks()


def test_removing_made_up_names_keeps_no_memory(store: VolumeStore) -> None:
    """Once, each well-formed name passed to Remove kept a lock: 10 MB per 50,000 names."""

    def remove(names: range) -> None:
        for n in names:
            with pytest.raises(VolumeError) as refused:
                store.remove(f"nvidia_driver_{n}.{n}")
            assert refused.value.reason == NO_SUCH_VOLUME

    remove(range(10_000))  # the interpreter's own tables grow to their size for such loops
    before = _blocks()
    remove(range(10_000, 20_000))
    assert _blocks() - before < 1000  # the old lock table took 2 blocks per name
