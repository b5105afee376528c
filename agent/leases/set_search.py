"""The best set of GPUs on a node too large to compare every set: a branch-and-bound search.

``best_set`` returns the set ``agent.leases.picking`` would get by comparing every set of
``count`` candidates (the best-connected, then the least loaded, then the lowest indices),
without building most of them. A set's connection is read as, for each pair score from the
worst up, how many of its pairs score that or worse: fewer at the first score where two sets
differ is better (the same order as comparing their pair scores sorted worst first). Sets are
built in index order; a partial set is dropped once no set that completes it can beat the
best found so far:

- the pairs it already has, plus the fewest pairs at or below each score that its remaining
  members must add (to the members chosen, and among themselves: a GPU with few better
  partners left must bring worse pairs), already outnumber the best set's at the first score
  where they differ; or
- they match the best set's everywhere, so it can at most tie, and its lowest possible load
  is no lower (a set found later in index order loses a tie).

Every set found is kept only if it beats those found before it, which come first in index
order, so a tie keeps the lower indices. The search stops after ``STEPS`` partial sets and
keeps the best found so far: on 16 GPUs, asks with pair scores drawn at random needed at
most about 2,200, and a case built to be slow (scores and loads tuned by hill climbing)
13,467, about 0.1 s (docs/leases.md, "Picking").
"""

from __future__ import annotations

from collections.abc import Sequence

STEPS = 50_000  # partial sets looked at before the search keeps the best it has

Load = tuple[int, int]  # (leases on it, busy level 0-10): smaller is better
Counts = tuple[int, ...]  # pairs at or below each score, worst score first


def best_set(ranks: Sequence[Sequence[int]], loads: Sequence[Load], count: int) -> tuple[int, ...]:
    """The positions (into ``ranks``/``loads``, ascending) of the best ``count`` candidates.

    ``ranks[i][j]`` is the pair score of candidates ``i`` and ``j`` as a rank (0 the worst;
    candidates are in index order); ``count`` is at least 1 and at most their number."""
    search = _Search(ranks, loads, count)
    search.extend([], [0] * search.levels, [[0] * search.levels for _ in ranks], 0)
    return search.best


class _Search:
    def __init__(self, ranks: Sequence[Sequence[int]], loads: Sequence[Load], count: int):
        self.n = len(ranks)
        self.ranks = ranks
        self.loads = loads
        self.count = count
        self.levels = max((max(row, default=0) for row in ranks), default=0)
        self.above = [self._above(v) for v in range(self.n)]
        self.best: tuple[int, ...] = ()  # the first set found: the first ``count`` candidates
        self.best_counts: Counts = ()
        self.best_load: Load = (0, 0)
        self.steps = 0

    def _above(self, v: int) -> list[list[int]]:
        """``[j][s]``: how many candidates from ``j`` on (not ``v``) score above ``s`` with it."""
        out = [[0] * self.levels]
        for w in range(self.n - 1, -1, -1):
            row = list(out[-1])
            if w != v:
                for s in range(min(self.ranks[v][w], self.levels)):
                    row[s] += 1
            out.append(row)
        out.reverse()
        return out

    def load(self, chosen: Sequence[int]) -> Load:
        return (sum(self.loads[c][0] for c in chosen), sum(self.loads[c][1] for c in chosen))

    def extend(self, chosen: list[int], own: list[int], cross: list[list[int]], nxt: int) -> None:
        """Try every completion of ``chosen`` from candidates ``nxt`` on; ``own[s]``: its pairs
        scoring exactly ``s``; ``cross[v][s]``: pairs of ``v`` with it scoring exactly ``s``."""
        self.steps += 1
        left = self.count - len(chosen)
        if left == 0:
            self.offer(tuple(chosen), _cumulative(own))
            return
        if self.n - nxt < left or self.cut(chosen, own, cross, nxt, left):
            return
        for v in range(nxt, self.n - left + 1):
            row = self.ranks[v]
            added = list(own)
            for s in range(self.levels):
                added[s] += cross[v][s]
            for w in range(v + 1, self.n):
                if row[w] < self.levels:
                    cross[w][row[w]] += 1
            chosen.append(v)
            self.extend(chosen, added, cross, v + 1)
            chosen.pop()
            for w in range(v + 1, self.n):
                if row[w] < self.levels:
                    cross[w][row[w]] -= 1

    def offer(self, chosen: tuple[int, ...], counts: Counts) -> None:
        """Keep ``chosen`` if it beats the best so far (found before it: lower in index order,
        so a tie keeps the best)."""
        load = self.load(chosen)
        if not self.best or (counts, load) < (self.best_counts, self.best_load):
            self.best, self.best_counts, self.best_load = chosen, counts, load

    def cut(
        self, chosen: list[int], own: list[int], cross: list[list[int]], nxt: int, left: int
    ) -> bool:
        """Whether no completion of ``chosen`` can beat the best set (see the module's text)."""
        if not self.best:
            return False
        if self.steps > STEPS:
            return True  # out of steps: keep the best found so far
        rest = range(nxt, self.n)
        total = 0
        for s in range(self.levels):
            total += own[s]
            to_chosen = sorted(sum(cross[v][: s + 1]) for v in rest)
            among = sorted(max(0, left - 1 - self.above[v][nxt][s]) for v in rest)
            bound = total + sum(to_chosen[:left]) + (sum(among[:left]) + 1) // 2
            if bound != self.best_counts[s]:
                return bound > self.best_counts[s]
        fewest = sorted(self.loads[v][0] for v in rest)[:left]
        idlest = sorted(self.loads[v][1] for v in rest)[:left]
        have = self.load(chosen)
        return (have[0] + sum(fewest), have[1] + sum(idlest)) >= self.best_load


def _cumulative(histogram: Sequence[int]) -> Counts:
    out = []
    total = 0
    for value in histogram:
        total += value
        out.append(total)
    return tuple(out)
