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

``--lease`` times ``nvidia-docker run`` of a GPU image instead, the same way, against the
node's agent as ``tests.support.lease_agent`` plays it (on loopback, in this process: the
leases REST API of docs/leases.md, ``/gpu/info/json``, ``/docker/cli``), with a docker that
is a shell script (it answers ``image inspect`` with the image's labels and does nothing
for ``run``), so that what is left is the wrapper's own time: ``docker`` (the script's
``run`` alone), ``python exec``, ``NV_GPU=0`` (today's run path: no lease), and the lease
forms ``NV_GPU=auto``, ``--gpus 1``, ``--gpus all``. What the lease costs is a lease form
minus ``NV_GPU=0``. ``NV_CDI=no``: the engine is not asked (its ``docker version`` is the
engine's cost, the same with or without a lease).

``--compare DIR`` (with ``--lease``) adds the same variants run from another checkout of the
repository (``git worktree add /tmp/before HEAD``), interleaved with this one's: a before
and after in one run, under the same load.

    python -m tests.benchmarks.bench_wrapper [--runs 40] [--warmup 5] [--lease] [--compare DIR]
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
COMPARED = "compared: "  # --compare: the other checkout's variants


def _plain_venv(tmp: Path, repo: Path = REPO) -> Path:
    """A fresh venv that sees the repository (``repo``) through a static ``.pth`` path entry:
    the start-up of a regular (non-editable) install, without setuptools' editable-install
    finder, which imports pathlib and re at every start (about 10 ms)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "nvidia_docker_repo.pth").write_text(f"{repo}\n")
    return python


def _launcher(
    python: Path, where: Path, *, pip_template: bool = False, launcher: Path = LAUNCHER
) -> list[str]:
    """Our launcher ``bin/nvidia-docker`` (``launcher``) as pip installs it (shebang set to
    the venv's Python); ``pip_template``: the console script pip would have written instead,
    whose ``import re`` is why we ship a plain script."""
    if pip_template:
        text = PIP_SCRIPT.format(python=python)
    else:
        text = launcher.read_text().replace("#!python", f"#!{python}", 1)
    script = where / ("nvidia-docker-pip-template" if pip_template else "nvidia-docker")
    script.write_text(text)
    script.chmod(0o755)
    return [str(script)]


FAKE_DOCKER = """#!/bin/sh
# docker for the run path's benchmark: the image's labels, and nothing else to do
labels='{"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}'
case "$1 $2" in
  "image inspect") echo "$labels" ;;
  *) echo "$@" ;;
esac
exit 0
"""
LEASE_VARIANTS: tuple[tuple[str, dict[str, str], list[str]], ...] = (
    ("NV_GPU=0", {"NV_GPU": "0"}, []),
    ("NV_GPU=auto", {"NV_GPU": "auto"}, []),
    ("--gpus 1", {}, ["--gpus", "1"]),
    ("--gpus all", {}, ["--gpus", "all"]),
)


def _site_packages() -> str:
    import sysconfig  # noqa: PLC0415

    return sysconfig.get_paths()["purelib"]


def lease_path(opts: argparse.Namespace) -> int:
    """``--lease``: the run path, with and without a lease (see the module docstring)."""
    from tests.support.lease_agent import LeaseAgent, served_in_thread  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPATH", None)
    with (
        tempfile.TemporaryDirectory(prefix="nvd-bench-") as tmp,
        served_in_thread(LeaseAgent(forgetful=True)) as port,
    ):
        python = _plain_venv(Path(tmp))
        _see_libraries(python)
        docker = Path(tmp) / "docker"
        docker.write_text(FAKE_DOCKER)
        docker.chmod(0o755)
        env.update(
            NV_DOCKER=str(docker),
            NV_CDI="no",
            NV_HOST=f"http://127.0.0.1:{port}",
            DOCKER_HOST="tcp://127.0.0.1:2375",
        )
        run = ["run", "--rm", "nvidia/cuda:12.4", "nvidia-smi"]
        launcher = _launcher(python, Path(tmp))
        exec_only = f"import os, sys; os.execvp({str(docker)!r}, ['docker', *sys.argv[1:]])"
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "docker": ([str(docker), *run], env),
            "python exec": ([str(python), "-c", exec_only, *run], env),
        }
        for name, extra_env, flags in LEASE_VARIANTS:
            variants[name] = ([*launcher, run[0], *flags, *run[1:]], {**env, **extra_env})
        leasing = {name for name, _, _ in LEASE_VARIANTS[1:]}
        if opts.compare is not None:  # the same variants, run from the other checkout
            other = Path(opts.compare).resolve()
            where = Path(tmp, "compare")
            where.mkdir()
            other_python = _plain_venv(where, other)
            _see_libraries(other_python)
            other_launcher = _launcher(other_python, where, launcher=other / "bin/nvidia-docker")
            for name, extra_env, flags in LEASE_VARIANTS:
                argv = [*other_launcher, run[0], *flags, *run[1:]]
                variants[f"{COMPARED}{name}"] = (argv, {**env, **extra_env})
                if name in leasing:
                    leasing.add(f"{COMPARED}{name}")
        for name, (argv, variant_env) in variants.items():  # each works, leases or not
            done = subprocess.run(
                argv, env=variant_env, capture_output=True, text=True, check=False
            )
            leased = "--label=nvidia-docker.lease=" in done.stdout
            if done.returncode != 0 or leased is not (name in leasing):
                print(
                    f"bench_wrapper | {name}: {done.stderr.strip() or done.stdout}", file=sys.stderr
                )
                return 1
        print(f"bench_wrapper | run path: a plain venv ({python}), the fake agent on "
              f"127.0.0.1:{port}, a shell-script docker, NV_CDI=no")  # fmt: skip
        if opts.compare is not None:
            print(f"bench_wrapper | {COMPARED}...: the same, from {opts.compare}")
        print(f"bench_wrapper | python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
              f"{opts.runs} runs each, interleaved, load average "
              f"{' '.join(f'{load:.2f}' for load in os.getloadavg())} before")  # fmt: skip
        print()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(opts.warmup):
            for argv, variant_env in variants.values():
                _time(argv, variant_env)
        for _ in range(opts.runs):
            order = list(variants.items())
            random.shuffle(order)
            for name, (argv, variant_env) in order:
                samples[name].append(_time(argv, variant_env))
        base = statistics.median(samples["docker"])
        plain = statistics.median(samples["NV_GPU=0"])
        print(f"{'variant':<22} {'median ms':>10} {'p90 ms':>8} {'+ms vs docker':>14} "
              f"{'+ms vs NV_GPU=0':>16}")  # fmt: skip
        for name, values in samples.items():
            med = statistics.median(values)
            p90 = statistics.quantiles(values, n=10)[-1]
            print(f"{name:<22} {med * 1e3:>10.1f} {p90 * 1e3:>8.1f} {(med - base) * 1e3:>+14.1f} "
                  f"{(med - plain) * 1e3:>+16.1f}")  # fmt: skip
        worst = max(statistics.median(samples[name]) for name, _, _ in LEASE_VARIANTS[1:])
        print(f"load average after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        print()
        print(f"what a lease adds to the run path (worst form, median): "
              f"{(worst - plain) * 1e3:+.1f} ms; the run path with a lease over docker: "
              f"{(worst - base) * 1e3:+.1f} ms")  # fmt: skip
    return 0


def _see_libraries(python: Path) -> None:
    """Let the plain venv of ``python`` import this environment's libraries (aiohttp), without
    this environment's editable-install finder."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "nvidia_docker_libs.pth").write_text(f"{_site_packages()}\n")


def _time(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per variant and command")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (pyc, caches)")
    parser.add_argument(
        "--lease", action="store_true", help="time run with and without a lease instead"
    )
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="with --lease: also time the checkout in DIR, interleaved (before and after)",
    )
    opts = parser.parse_args()
    if opts.lease:
        return lease_path(opts)
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
