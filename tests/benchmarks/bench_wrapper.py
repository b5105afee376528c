"""What ``nvidia-docker`` adds to a pass-through docker call (``ps``, ``inspect``, ``--version``).

Mesos runs ``docker inspect``/``ps``/``logs``/``stop``/``rm``/``version`` through the wrapper
many times per task, so the pass-through path must cost little over docker itself. This
benchmark runs, interleaved in one process (shuffled order every round, so drift and other
load hit all variants alike), hyperfine style:

- ``docker``: the docker client alone;
- ``python exec``: a Python that does nothing but ``os.execvp("docker", ...)``: the floor of
  any Python wrapper (interpreter start-up);
- ``nvidia-docker``: the console script (the installed one next to this Python, else an
  identical script generated the way setuptools/pip write them);
- ``old way``: ``docker version`` before every call, then docker (what nvidia-docker 1.0
  did), for comparison.

It prints medians, the 90th percentile and the overheads/ratios against docker alone.
By default docker talks to a daemon that is not there (``unix:///nonexistent.sock``): the
pass-through must work with the daemon down, and a failing daemon connection keeps the
docker side short and steady. ``NVD_BENCH_DOCKER_HOST`` points it at a live daemon instead.

    python -m tests.benchmarks.bench_wrapper [--runs 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "bin" / "nvidia-docker"  # installed with its shebang set to the venv's Python
PIP_SCRIPT = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from controller.wrapper.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""
COMMANDS = (["--version"], ["ps", "-a"], ["inspect", "mesos-abc"], ["version"])


def _plain_venv(tmp: Path) -> Path:
    """A fresh venv that sees the repository through a static ``.pth`` path entry: the start-up
    of a regular (non-editable) install, without setuptools' editable-install finder, which
    imports pathlib and re at every start (about 10 ms)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "nvidia_docker_repo.pth").write_text(f"{REPO}\n")
    return python


def _launcher(python: Path, where: Path, *, pip_template: bool = False) -> list[str]:
    """Our launcher ``bin/nvidia-docker`` as pip installs it (shebang set to the venv's
    Python); ``pip_template``: the console script pip would have written instead, whose
    ``import re`` is why we ship a plain script."""
    if pip_template:
        text = PIP_SCRIPT.format(python=python)
    else:
        text = LAUNCHER.read_text().replace("#!python", f"#!{python}", 1)
    script = where / ("nvidia-docker-pip-template" if pip_template else "nvidia-docker")
    script.write_text(text)
    script.chmod(0o755)
    return [str(script)]


def _time(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per variant and command")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (pyc, caches)")
    opts = parser.parse_args()
    docker = shutil.which("docker")
    if docker is None:
        print("bench_wrapper | the docker client is not installed", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("NV_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: byte code cached
    env.pop("PYTHONPATH", None)
    env["DOCKER_HOST"] = os.environ.get("NVD_BENCH_DOCKER_HOST", "unix:///nonexistent.sock")
    with tempfile.TemporaryDirectory(prefix="nvd-bench-") as tmp:
        python = _plain_venv(Path(tmp))
        exec_only = "import os, sys; os.execvp('docker', ['docker', *sys.argv[1:]])"
        variants = {
            "docker": [docker],
            "python exec": [str(python), "-c", exec_only],
            "nvidia-docker": _launcher(python, Path(tmp)),
            "  pip launcher": _launcher(python, Path(tmp), pip_template=True),
            "old way": ["sh", "-c", 'docker version >/dev/null 2>&1; exec docker "$@"', "old"],
        }
        installed = Path(sys.executable).with_name("nvidia-docker")
        if installed.exists():
            variants["this venv's"] = [str(installed)]
            variants["its py exec"] = [sys.executable, "-c", exec_only]
        print(f"bench_wrapper | python exec, nvidia-docker: a plain venv ({python})")
        if "this venv's" in variants:
            print(f"bench_wrapper | this venv's: {installed}, its Python (editable install)")
        print(f"bench_wrapper | python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
              f"DOCKER_HOST={env['DOCKER_HOST']}, {opts.runs} runs each, interleaved")  # fmt: skip
        print()
        print(f"{'command':<18} {'variant':<14} {'median ms':>10} {'p90 ms':>8} "
              f"{'+ms vs docker':>14} {'x docker':>9}")  # fmt: skip
        summary: list[tuple[str, float, float]] = []
        for command in COMMANDS:
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(opts.warmup):
                for argv in variants.values():
                    _time([*argv, *command], env)
            for _ in range(opts.runs):
                order = list(variants.items())
                random.shuffle(order)
                for name, argv in order:
                    samples[name].append(_time([*argv, *command], env))
            base = statistics.median(samples["docker"])
            label = " ".join(command)
            for name, values in samples.items():
                med = statistics.median(values)
                p90 = statistics.quantiles(values, n=10)[-1]
                print(f"{label:<18} {name:<14} {med * 1e3:>10.1f} {p90 * 1e3:>8.1f} "
                      f"{(med - base) * 1e3:>+14.1f} {med / base:>9.2f}")  # fmt: skip
            ours = statistics.median(samples["nvidia-docker"]) - base
            floor = statistics.median(samples["python exec"]) - base
            summary.append((label, ours, floor))
            print()
        print(
            "overhead of nvidia-docker over docker alone (median), and over the bare Python exec:"
        )
        for label, ours, floor in summary:
            print(f"  {label:<18} +{ours * 1e3:.1f} ms   (bare Python exec +{floor * 1e3:.1f} ms; "
                  f"ours - floor = {(ours - floor) * 1e3:+.1f} ms)")  # fmt: skip
        worst = max(ours for _, ours, _ in summary)
        print(f"worst pass-through overhead: {worst * 1e3:.1f} ms (target: under 15 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
