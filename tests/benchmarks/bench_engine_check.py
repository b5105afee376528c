"""What the wrapper's CDI question to the engine costs per ``run``/``create`` of a labelled
image (``controller.wrapper.engine_cdi.ask_engine``), against the real engines here: a private
dockerd (Docker 20.10 engine, Docker 28 CLI) and a private Podman 4.3. For comparison, the
``info`` call each engine would otherwise need. Where the CLI's file does not say its version
(Debian's docker CLI, Podman), what the question ran at every run before ``cli_versions``
(``docker info``, ``podman version``), what it runs once per program file now (``--version``)
and the remembered answer (``cli_version``, a temporary ``XDG_CACHE_HOME``). Pass-through
commands never ask (see bench_wrapper for their cost).

    python -m tests.benchmarks.bench_engine_check [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from controller.wrapper.cli_versions import cli_version
from controller.wrapper.docker_args import scan
from controller.wrapper.engine_cdi import ask_engine
from tests.support.dockerd import start_engine, stop_engine
from tests.support.podman import private_podman

COMMAND = scan(["run", "image"])
DEBIAN_CLI = Path("/usr/bin/docker")  # Debian's docker.io, built with -trimpath


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


def _remembered(runs: int, cli: str, cache: str) -> list[tuple[str, str, float, float]]:
    """``<cli> --version`` (asked once) and its remembered answer (every run after)."""
    environment = {**os.environ, "XDG_CACHE_HOME": cache}
    name = os.path.basename(cli)
    said = cli_version(cli, environment)
    return [
        (
            name,
            f"{name} --version (once per program file)",
            *_median_ms(runs, _call([cli, "--version"])),
        ),
        (name, f"remembered: {said}", *_median_ms(runs, lambda: cli_version(cli, environment))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    cache = tempfile.mkdtemp(prefix="nvd-bench-cache-")  # the remembered versions
    try:
        rows = _rows(runs, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"{'engine':<8} {'what':<60} {'median':>9} {'p90':>9}")
    for name, what, median, p90 in rows:
        print(f"{name:<8} {what:<60} {median:>7.2f}ms {p90:>7.2f}ms")


def _rows(runs: int, cache: str) -> list[tuple[str, str, float, float]]:
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
        if DEBIAN_CLI.exists():  # -trimpath: its file does not say its version
            info = [str(DEBIAN_CLI), "-H", engine.host, "info", "--format", "{{json .CDISpecDirs}}"]
            rows.append(
                (
                    "docker",
                    "Debian's CLI: docker info (before, at every run)",
                    *_median_ms(runs, _call(info)),
                )
            )
            rows += _remembered(runs, str(DEBIAN_CLI), cache)
    finally:
        stop_engine(engine, proc)
    with private_podman() as podman:
        one_word = {**os.environ, "XDG_CACHE_HOME": cache}
        rows.append(
            (
                "podman",
                "podman version (before: the question at every run)",
                *_median_ms(runs, _call([*podman.command, "version", "--format", "{{json .}}"])),
            )
        )
        rows += _remembered(runs, shutil.which("podman") or "podman", cache)
        found = ask_engine(("podman",), COMMAND, one_word)
        rows.append(
            (
                "podman",
                f"ask_engine, one word -> {found.engine}, CDI {found.reads_cdi}",
                *_median_ms(runs, lambda: ask_engine(("podman",), COMMAND, one_word)),
            )
        )
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
    return rows


if __name__ == "__main__":
    main()
