"""How long the lease table takes to pick N GPUs, against comparing every set of N.

For each count on two idle nodes, the built-in ``hgx-h200-8`` and a 16-GPU NVSwitch node of
two sockets with one GPU taken (``tests.unit.leases.nodes.nvswitch_16``), it times
``pick_gpus`` (the branch-and-bound search of ``agent.leases.set_search``) and the same
choice made by comparing every set (the definition the search must match), checks that both
give the same GPUs, and prints the median of ``--rounds`` picks of each, their ratio, and the
slowest count of each node. Pure CPU in one process: the time a grant spends picking.

    python -m tests.benchmarks.bench_pick_search [--rounds 15] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence

from agent.gpu import nodefile
from agent.gpu.model import NodeInfo
from agent.leases.picking import Connectivity, LoadOf, pick_gpus
from agent.leases.units import NodeUnits, Unit
from tests.unit.leases.nodes import nvswitch_16

NODES: tuple[tuple[str, Callable[[], NodeInfo], tuple[int, ...]], ...] = (
    ("hgx-h200-8", lambda: nodefile.load("hgx-h200-8").info, ()),
    ("nvswitch-16, GPU 8 taken", nvswitch_16, (8,)),
)


def _every_set(
    units: Sequence[Unit], count: int, conn: Connectivity, load_of: LoadOf
) -> tuple[Unit, ...]:
    def key(chosen: Sequence[Unit]) -> tuple[list[tuple[int, ...]], tuple[int, int], list[int]]:
        worst_first = sorted(conn.score(a.gpu, b.gpu) for a, b in itertools.combinations(chosen, 2))
        loads = [load_of(u) for u in chosen]
        load = (sum(x for x, _ in loads), sum(y for _, y in loads))
        return [tuple(-v for v in s) for s in worst_first], load, [u.gpu for u in chosen]

    return min(itertools.combinations(sorted(units, key=lambda u: u.gpu), count), key=key)


Picker = Callable[[Sequence[Unit], int, Connectivity, LoadOf], tuple[Unit, ...]]


def _median_ms(
    pick: Picker, units: Sequence[Unit], count: int, conn: Connectivity, rounds: int
) -> tuple[float, tuple[Unit, ...]]:
    times = []
    got: tuple[Unit, ...] = ()
    for _ in range(rounds):
        start = time.perf_counter()
        got = pick(units, count, conn, lambda u: (0, 0))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = []
    for name, build, taken in NODES:
        node = build()
        conn = Connectivity(node)
        units = [u for u in NodeUnits(node).whole_gpus() if u.gpu not in taken]
        for count in range(2, len(units)):
            search_ms, got = _median_ms(pick_gpus, units, count, conn, args.rounds)
            every_ms, want = _median_ms(_every_set, units, count, conn, max(3, args.rounds // 5))
            if got != want:
                raise SystemExit(f"{name}, {count} GPUs: the search picked {got}, every set {want}")
            ratio = round(every_ms / search_ms, 1)
            rows.append({"node": name, "count": count, "search_ms": round(search_ms, 3),
                         "every_set_ms": round(every_ms, 2), "ratio": ratio,
                         "gpus": [u.gpu for u in got]})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'node':<26} {'N':>3} {'search':>10} {'every set':>11} {'ratio':>7}  GPUs")
    for row in rows:
        print(f"{row['node']:<26} {row['count']:>3} {row['search_ms']:>8.3f}ms "
              f"{row['every_set_ms']:>9.2f}ms {row['ratio']:>6.1f}x  {row['gpus']}")  # fmt: skip
    for name, _, _ in NODES:
        mine = [r for r in rows if r["node"] == name]
        slowest = max(mine, key=lambda r: float(str(r["search_ms"])))
        print(f"{name}: slowest pick {slowest['search_ms']} ms ({slowest['count']} GPUs)")


if __name__ == "__main__":
    main()
