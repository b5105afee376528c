"""Driver upgrade benchmark: how long status answers 503, and how fast a new driver is served.

A real ``nvidia-docker-plugin`` serves a simulated node (``--simulate FILE``) over a fake
driver root with two drivers (tests.support.fake_driver; needs gcc and ldconfig). Each
round is an upgrade as a package manager and an operator do it: the new driver's files are
installed (linker cache and binaries renamed into place), then, after ``--module-delay``
seconds, the new kernel module is loaded (the node file renamed with the new version); the
next round goes back the same way (a downgrade). Meanwhile ``--clients`` threads ask
``/gpu/status/json``, each request on a new connection. Per round it prints:

- release: from the install to the first 503 (the agent noticed and let go of the GPUs);
- 503 window: first to last 503 seen, and how many;
- pick-up: from the module load to ``/gpu/info`` naming the new driver;
- requests: how many, failures (refused connections, other statuses), the longest.

    python -m tests.benchmarks.bench_upgrade [--rounds 3] [--clients 16] [--node h200]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fake_driver import (
    NEW_VERSION,
    VERSION,
    FakeDriver,
    build_fake_driver,
    install_driver,
    remove_fake_driver,
)
from tests.support.node_life import Agent, NodeFile, StatusLoad, start_agent
from tests.support.services import wait_until

UPGRADE_ANSWER = b"driver upgrade in progress\n"


def _round(
    agent: Agent, node: NodeFile, root: FakeDriver, to: FakeDriver, args: argparse.Namespace
) -> str:
    load = StatusLoad(agent.port, clients=args.clients).start()
    try:
        wait_until(lambda: load.count() > args.clients * 5, what="load before the upgrade")
        installed = time.monotonic()
        install_driver(root, to)
        wait_until(lambda: agent.get("/gpu/status/json")[0] == 503, what="release", timeout_s=30)
        time.sleep(args.module_delay)  # the operator's pause between install and module load
        loaded = time.monotonic()
        node.load_driver(to.version)
        wait_until(lambda: agent.driver_version() == to.version, what="pick-up", timeout_s=30)
        picked_up = time.monotonic()
        before = load.count()
        wait_until(lambda: load.count() > before + args.clients * 5, what="load after")
    finally:
        outcomes = load.stop()
    window = [o for o in outcomes if o.status == 503 and o.body == UPGRADE_ANSWER]
    failed = [o for o in outcomes if o.status != 200 and o not in window]
    first, last = min(o.started_s for o in window), max(o.started_s for o in window)
    longest = max(o.latency_s for o in outcomes)
    return (
        f"release {1e3 * (first - installed):7.0f} ms | 503 window {1e3 * (last - first):7.0f} ms "
        f"({len(window)} answers; module loaded {args.module_delay:.1f} s after the install) | "
        f"pick-up {1e3 * (picked_up - loaded):6.0f} ms | {len(outcomes)} requests, "
        f"{len(failed)} failed, longest {1e3 * longest:.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="upgrades, then downgrades, ...")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--node", default="h200", help="built-in node the file starts from")
    parser.add_argument("--module-delay", type=float, default=0.5, help="seconds")
    args = parser.parse_args()
    if shutil.which("gcc") is None:
        print("bench_upgrade needs gcc and ldconfig for the fake driver root", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="nvd-bench-upgrade-"))
    drivers = [build_fake_driver(base), build_fake_driver(base, version=NEW_VERSION)]
    pristine = build_fake_driver(base)  # the first driver again, for the downgrades
    print(
        f"driver upgrade benchmark: simulated {args.node}, {args.clients} status clients on new "
        f"connections; {platform.node()}, {os.cpu_count()} CPUs"
    )
    try:
        root = drivers[0]
        node = NodeFile(base / "node.json", args.node)
        (base / "agent").mkdir()
        with start_agent(
            base / "agent", node, ldcache=root.ldcache, search_path=root.search_path
        ) as agent:
            for number in range(args.rounds):
                to = drivers[1] if number % 2 == 0 else pristine
                line = _round(agent, node, root, to, args)
                label = (
                    f"{VERSION} -> {NEW_VERSION}"
                    if to is drivers[1]
                    else f"{NEW_VERSION} -> {VERSION}"
                )
                print(f"round {number + 1} ({label}): {line}")
            if "Traceback" in agent.log():
                print(agent.log(), file=sys.stderr)
                return 1
    finally:
        for driver in (*drivers, pristine):
            remove_fake_driver(driver)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
