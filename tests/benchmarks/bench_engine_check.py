"""What the wrapper's CDI question to the engine costs per ``run``/``create`` of a labelled
image (``controller.wrapper.engine_cdi.ask_engine``), against the real engines here: a private
dockerd (Docker 20.10 engine, Docker 28 CLI) and a private Podman 4.3. For comparison, the
``info`` call each engine would otherwise need. Pass-through commands never ask (see
bench_wrapper for their cost).

    python -m tests.benchmarks.bench_engine_check [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

from controller.wrapper.docker_args import scan
from controller.wrapper.engine_cdi import ask_engine
from tests.support.dockerd import start_engine, stop_engine
from tests.support.podman import private_podman

COMMAND = scan(["run", "image"])


def _median_ms(runs: int, work: Callable[[], object]) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9) - 1]


def _call(argv: Sequence[str]) -> Callable[[], object]:
    return lambda: subprocess.run(argv, capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    rows: list[tuple[str, str, float, float]] = []
    engine, proc = start_engine()
    try:
        docker = ["docker", "-H", engine.host]
        found = ask_engine(docker, COMMAND, os.environ)
        rows.append(
            (
                "docker",
                f"ask_engine -> {found.engine}, CDI {found.reads_cdi}",
                *_median_ms(runs, lambda: ask_engine(docker, COMMAND, os.environ)),
            )
        )
        rows.append(
            (
                "docker",
                "docker info (all of it)",
                *_median_ms(runs, _call([*docker, "info", "--format", "{{json .}}"])),
            )
        )
    finally:
        stop_engine(engine, proc)
    with private_podman() as podman:
        found = ask_engine(podman.command, COMMAND, os.environ)
        rows.append(
            (
                "podman",
                f"ask_engine -> {found.engine}, CDI {found.reads_cdi}",
                *_median_ms(runs, lambda: ask_engine(podman.command, COMMAND, os.environ)),
            )
        )
        rows.append(
            (
                "podman",
                "podman info",
                *_median_ms(runs, _call([*podman.command, "info", "--format", "{{json .}}"])),
            )
        )
    print(f"{'engine':<8} {'what':<52} {'median':>9} {'p90':>9}")
    for name, what, median, p90 in rows:
        print(f"{name:<8} {what:<52} {median:>7.1f}ms {p90:>7.1f}ms")


if __name__ == "__main__":
    main()
