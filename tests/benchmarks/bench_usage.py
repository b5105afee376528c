"""What the usage ledger costs per sweep on the simulated 8-GPU node, apart from the sweep.

    python -m tests.benchmarks.bench_usage [--sweeps 2000]

In this process: the ``hgx-h200-8`` node (its statuses read once from the simulated
backend: the sweep itself is the status service's, shared with scrapes, and not counted
here), the lease table (the pure model) with eight leases (each GPU leased, owner labels
``team`` and a Compose project) and a real ``LedgerStore`` in a temporary directory. Per
sweep the ledger does what its tick does after the sweep: ``build_samples`` (holders from
the table's view), the accounting, the idle tracker, ``take_batch`` and ``submit``; the
store's thread writes each batch as one transaction. Rows: the event loop's part
(microseconds per sweep), the store's write (per batch, measured by flushing after each),
and both as a share of one core at the default interval of 10 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from agent.gpu.simulated import SimulatedBackend
from agent.health.rule import DeviceHealth
from agent.leases.asks import Ask
from agent.leases.settings import LeaseSettings
from agent.leases.table import LeaseTable
from agent.node.status import Sweep
from agent.usage.accounting import Accounting
from agent.usage.idle import IdlePolicy, IdleTracker
from agent.usage.ledger import DEFAULT_LABELS, build_samples
from agent.usage.store import LedgerStore

INTERVAL_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=2000)
    args = parser.parse_args()
    backend = SimulatedBackend.from_file("hgx-h200-8")
    node = backend.node_info()
    statuses = tuple(backend.device_status(i) for i in range(len(node.devices)))
    health = [DeviceHealth() for _ in node.devices]
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
        leases = LeaseTable(node, health, LeaseSettings(), time.time())
        for i in range(len(node.devices)):
            owner = (("team", f"team-{i % 3}"), ("com.docker.compose.project", f"p{i % 2}"))
            leases.ask(Ask(count=1, owner=owner), time.time())
        store = LedgerStore.open(Path(tmp) / "usage.db", retention_s=90 * 86400.0,
                                 max_bytes=1 << 30)  # fmt: skip
        accounting = Accounting(DEFAULT_LABELS, max_gap_s=3 * INTERVAL_S)
        idle = IdleTracker(3600.0, IdlePolicy.NOTIFY)
        loop_us: list[float] = []
        write_us: list[float] = []
        t_s = time.time()
        for _ in range(args.sweeps):
            t_s += INTERVAL_S
            sweep = Sweep(node, statuses, (), None, time.monotonic())
            started = time.perf_counter()
            samples = build_samples(sweep, leases.view(), {}, {}, t_s)
            accounting.observe(t_s, samples)
            idle.observe(t_s, samples)
            batch = accounting.take_batch()
            if batch is not None:
                store.submit(batch)
            middle = time.perf_counter()
            store.flush(5.0)
            ended = time.perf_counter()
            loop_us.append((middle - started) * 1e6)
            write_us.append((ended - middle) * 1e6)
        store.close()
    on_loop = statistics.median(loop_us)
    write = statistics.median(write_us)
    print(f"ledger per sweep, 8 leased GPUs: event loop {on_loop:.0f} us (p99 "
          f"{sorted(loop_us)[int(len(loop_us) * 0.99)]:.0f} us), store write {write:.0f} us "
          f"(p99 {sorted(write_us)[int(len(write_us) * 0.99)]:.0f} us), over {args.sweeps} "
          "sweeps")  # fmt: skip
    share = (on_loop + write) / (INTERVAL_S * 1e6)
    print(f"at one sweep every {INTERVAL_S:g} s: {share * 100:.4f}% of one core")


if __name__ == "__main__":
    main()
