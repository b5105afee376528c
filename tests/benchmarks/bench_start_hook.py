"""What Podman's start gate adds to a container's start (docs/performance.md, "Podman's start
hook").

    python -m tests.benchmarks.bench_start_hook [--rounds 15]

As root, with Debian's Podman (and runc where cgroups are hybrid, as the tests choose it): a
private Podman with the busybox image, its API service, and a real agent (simulated
``hgx-h200-8``, following that service) whose plugin socket the hook asks. Interleaved in
one process, the order shuffled every round, median and 90th percentile of:

- ``hook, no GPU``: ``nvidia-docker-start-hook`` alone on a runtime config without NVIDIA
  devices (it reads the config and does not ask);
- ``hook, GPU``: the same with ``/dev/nvidia3`` (it asks the agent, which allows);
- ``podman run, no hooks``: ``podman run --rm IMAGE echo`` without the hook;
- ``podman run, hook``: the same with the hook installed (``--hooks-dir``): its cost for a
  container without GPUs, what every container of the node pays;
- ``podman run --device, hook``: ``--device /dev/nvidia3`` with the hook, which asks.

It makes /dev/nvidia3 with mknod where missing (removed afterwards), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.test_start_hook_podman import podman_agent
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.podman import (
    RUN_LIMITS,
    Podman,
    api_service,
    private_podman,
    write_start_hook,
)
from tests.support.services import stop_process, wait_until

IMAGE = "nvd-bench-hook/busybox:1"
HOOK = Path(sys.executable).parent / "nvidia-docker-start-hook"
GPU3 = {"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}


def bundle(directory: Path, devices: list[dict[str, object]]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"linux": {"devices": devices}, "annotations": {"io.container.manager": "libpod"}}
    (directory / "config.json").write_text(json.dumps(config))
    return json.dumps({"id": "ab" * 32, "bundle": str(directory)})


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1000


def hook_run(state: str, socket_path: Path) -> Callable[[], None]:
    def run() -> None:
        done = subprocess.run(
            [str(HOOK), "--socket", str(socket_path)],
            input=state,
            capture_output=True,
            text=True,
            check=False,
            env={},  # as a runtime runs hooks
        )
        assert done.returncode == 0, done.stderr
        assert not done.stderr, done.stderr

    return run


def podman_run(podman: Podman, *args: str) -> Callable[[], None]:
    def run() -> None:
        done = podman("run", "--rm", *RUN_LIMITS, *args, IMAGE, "echo", check=False)
        assert done.returncode == 0, done.stderr

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory(prefix="nvd-bench-hook-") as tmp:
        base = Path(tmp)
        socket_path = base / "plugins" / "nvidia-docker.sock"
        write_start_hook(base / "hooks.d", socket_path)
        with (
            nvidia_nodes(wanted_nodes([3], uvm=False)),
            private_podman(hooks_dir=base / "hooks.d") as hooked,
        ):
            plain = Podman(hooked.base)  # the same store, the machine's hooks (none here)
            hooked.import_busybox(IMAGE, {})
            with api_service(hooked) as service:
                agent = podman_agent(base, service, socket_path.parent)
                try:
                    wait_until(socket_path.exists, what="the plugin socket", timeout_s=30)
                    variants = {
                        "hook, no GPU": hook_run(bundle(base / "b0", []), socket_path),
                        "hook, GPU": hook_run(bundle(base / "b1", [GPU3]), socket_path),
                        "podman run, no hooks": podman_run(plain),
                        "podman run, hook": podman_run(hooked),
                        "podman run --device, hook": podman_run(hooked, "--device", "/dev/nvidia3"),
                    }
                    for run in variants.values():  # warm: image layers, page cache
                        run()
                    times: dict[str, list[float]] = {name: [] for name in variants}
                    for _ in range(rounds):
                        order = list(variants)
                        random.shuffle(order)
                        for name in order:
                            times[name].append(timed(variants[name]))
                finally:
                    stop_process(agent.proc)
    base_run = statistics.median(times["podman run, no hooks"])
    print(f"{'variant':28} {'median':>9} {'p90':>9}  vs podman run, no hooks")
    for name, samples in times.items():
        samples.sort()
        median = statistics.median(samples)
        p90 = samples[int(0.9 * (len(samples) - 1))]
        ratio = f"x{median / base_run:.2f}" if name.startswith("podman") else ""
        print(f"{name:28} {median:7.1f} ms {p90:7.1f} ms  {ratio}")


if __name__ == "__main__":
    main()
