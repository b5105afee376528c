"""The set search on pair ranks alone: the best set on 16 GPUs within a small step budget,
and a search cut short still answering with a set of the size asked."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from agent.leases import set_search
from agent.leases.set_search import Load, best_set


def _key(
    chosen: Sequence[int], ranks: Sequence[Sequence[int]], loads: Sequence[Load]
) -> tuple[list[int], tuple[int, int], tuple[int, ...]]:
    worst_first = sorted(ranks[a][b] for a, b in itertools.combinations(chosen, 2))
    leases, busy = (sum(loads[c][i] for c in chosen) for i in (0, 1))
    return [-r for r in worst_first], (leases, busy), tuple(chosen)


def _random_node(seed: int, size: int) -> tuple[list[list[int]], list[Load]]:
    rng = random.Random(seed)
    levels = rng.randint(1, 6)
    ranks = [[0] * size for _ in range(size)]
    for a, b in itertools.combinations(range(size), 2):
        ranks[a][b] = ranks[b][a] = rng.randint(0, levels)
    loads = [(rng.choice([0, 0, 1]), rng.randint(0, 10)) for _ in range(size)]
    return ranks, loads


@pytest.mark.parametrize(("seed", "count"), [(1, 5), (2, 8), (3, 8), (4, 10), (5, 11), (6, 7)])
def test_16_gpus_with_any_pair_ranks_get_the_best_set_within_2500_steps(
    seed: int, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pair ranks with no structure at all (real nodes have more) are the hard case: the
    search still ends with the best of all C(16, count) sets well within its budget."""
    monkeypatch.setattr(set_search, "STEPS", 2500)
    ranks, loads = _random_node(seed, 16)
    best = min(itertools.combinations(range(16), count), key=lambda c: _key(c, ranks, loads))
    assert best_set(ranks, loads, count) == best


def test_a_search_cut_short_answers_with_a_set_of_the_size_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(set_search, "STEPS", 3)
    ranks, loads = _random_node(7, 24)
    chosen = best_set(ranks, loads, 12)
    assert len(chosen) == 12
    assert list(chosen) == sorted(set(chosen))
    assert all(0 <= c < 24 for c in chosen)


def test_one_of_equals_goes_to_the_fewest_leases_then_the_idlest_then_the_lowest() -> None:
    ranks = [[0] * 4 for _ in range(4)]
    assert best_set(ranks, [(1, 0), (0, 9), (0, 9), (0, 2)], 1) == (3,)
    assert best_set(ranks, [(0, 0), (0, 0), (0, 0), (0, 0)], 2) == (0, 1)
    assert best_set(ranks, [(1, 0), (0, 5), (0, 5), (0, 2)], 2) == (1, 3)
