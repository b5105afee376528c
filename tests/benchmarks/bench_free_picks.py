"""What ``nvidia-docker-ctl free --gpus N`` spends on each node's answers, in its own process.

The answers of one simulated ``hgx-h200-8`` agent (``/gpu/info/json`` and ``/leases/json``,
one lease of 3 GPUs held: 5 free) are copied for ``--nodes`` nodes, twice: every node naming
the same GPUs, and every node naming GPUs of its own (its UUIDs end in its number), as a
real fleet's nodes do. Each set goes through ``FreeTally`` (what ``free`` does with a node's
answers, then the table), timed with the process's CPU clock; it prints the time a node, how
many picks were made (a pick: the best-connected set of the free GPUs, about a quarter of a
millisecond on 8 GPUs) and the ratio of the two. The nodes of one model share one pick, so
both sets should cost the same: before that, a fleet whose GPUs have their own UUIDs (every
real fleet) paid one pick a node.

    python -m tests.benchmarks.bench_free_picks [--nodes 10000] [--gpus 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import controller.fleet.free_view as free_view
from agent.leases.picking import Connectivity, LoadOf, pick_gpus
from agent.leases.units import Unit
from controller.fleet.query import FleetNode, NodeResult
from controller.transport.endpoint import parse_endpoint
from tests.benchmarks.bench_fleet import BENCH_LEASE
from tests.support.agent_farm import ask_lease, start_farm

NODE = "hgx-h200-8"


def _answers() -> tuple[Any, Any]:
    farm = start_farm(1, (NODE,), leases=True)
    try:
        base = f"http://127.0.0.1:{farm.ports[0]}"
        ask_lease(base, BENCH_LEASE)
        with urllib.request.urlopen(f"{base}/gpu/info/json", timeout=30) as answer:
            info = json.load(answer)
        with urllib.request.urlopen(f"{base}/leases/json", timeout=30) as answer:
            leases = json.load(answer)
    finally:
        farm.stop()
    return info, leases


def _results(info: Any, leases: Any, nodes: int, own: bool) -> list[NodeResult]:
    made = []
    for number in range(nodes):
        node_info, node_leases = copy.deepcopy(info), copy.deepcopy(leases)
        if own:
            for named in (*node_info["Devices"], *node_leases["Units"]):
                named["UUID"] = named["UUID"][:-6] + f"{number:06x}"
        endpoint = parse_endpoint(f"http://node{number}:3476")
        made.append(
            NodeResult(
                FleetNode(f"node{number}", endpoint), {"info": node_info, "leases": node_leases}
            )
        )
    return made


def _run(results: list[NodeResult], gpus: int) -> tuple[float, int, int]:
    """CPU seconds for the tally and its table, picks made, nodes that qualify."""
    picks = 0

    def counted(
        candidates: Sequence[Unit], count: int, conn: Connectivity, load_of: LoadOf
    ) -> tuple[Unit, ...]:
        nonlocal picks
        picks += 1
        return pick_gpus(candidates, count, conn, load_of)

    setattr(free_view, "pick_gpus", counted)  # noqa: B010 (the name free_view calls)
    try:
        started = time.process_time()
        tally = free_view.FreeTally(free_view.FreeAsk(gpus))
        for order, result in enumerate(results):
            tally.add(result, order)
        tally.lines(None)
        return time.process_time() - started, picks, len(tally.found)
    finally:
        setattr(free_view, "pick_gpus", pick_gpus)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="runs of each (the median)")
    args = parser.parse_args()
    info, leases = _answers()
    medians = {}
    for own in (False, True):
        results = _results(info, leases, args.nodes, own)
        runs = [_run(results, args.gpus) for _ in range(args.runs)]
        cpu = statistics.median(r[0] for r in runs)
        _, picks, found = runs[0]
        label = "GPUs of its own" if own else "the same GPUs"
        medians[own] = cpu
        print(
            f"{args.nodes} nodes naming {label:15s}: {cpu / args.nodes * 1e6:6.1f} us a node "
            f"(median of {args.runs}), {picks} pick{'s' if picks != 1 else ''}, "
            f"{found} qualify"
        )
    print(f"ratio, GPUs of its own / the same: {medians[True] / medians[False]:.2f}")


if __name__ == "__main__":
    main()
