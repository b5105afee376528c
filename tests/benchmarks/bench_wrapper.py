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

``--real-docker`` (with ``--lease``, as root with Debian's dockerd) adds the run as most
users have it: ``NV_DOCKER`` unset, the docker CLI on ``PATH`` and a private dockerd
(``tests.support.dockerd``) holding the GPU image, so that the wrapper asks the engine's
socket for the labels (``controller.wrapper.engine_api``). docker itself must cost little
and the same every time, so the daemon refuses the run (an unknown ``--runtime``: the CLI's
start, its API version check and the create request, no container): ``real: docker`` is
that refusal alone, ``real: python exec`` the floor, and ``NV_GPU=auto`` with ``NV_CDI=no``
and unset (then whether the engine reads CDI is the agent's word: the stand-in agent says
what the engine answered to ``GET /version`` and ``GET /info`` read once at the start, as
the real agent reads them when its event stream opens; ``GET /engines/json``,
``controller.wrapper.engine_cdi``).

``--cdi-docker`` (with ``--lease``, as root) adds the same run against a private dockerd 25 or
later with CDI on (Debian 13's dockerd 26, which ``scripts/test-all`` unpacks into
``.cache/docker-cdi``; ``NVD_DOCKERD_CDI`` names another), refused the same way: ``cdi:
docker``, ``cdi: python exec``, ``NV_GPU=auto`` with ``NV_CDI=no`` (the volume form), ``yes``
(the CDI form, ``--device=nvidia.com/gpu=...``, without asking) and unset (the agent says
the engine reads CDI: the CDI form; what the question costs is this minus ``NV_CDI=yes``;
with ``--compare`` of a checkout before ``/engines/json``, the engine itself is asked).

``--debian-cli`` (with ``--cdi-docker``) adds the CDI engine's variants again through
Debian's docker CLI (``/usr/bin/docker``, first on ``PATH``): built with ``-trimpath``, its
file does not record its version, so the CDI question needs the CLI to say it (``docker
info`` at every run before ``cli_versions``; ``docker --version`` once since, remembered
under a temporary ``XDG_CACHE_HOME``): ``debian cli: docker`` is its refusal alone, and
``NV_GPU=auto`` with ``NV_CDI=no`` and unset (not ``yes``: Debian 12's CLI, 20.10, cannot
pass a CDI device on, which the question finds).

``--tcp`` (with ``--real-docker``) adds the ``real:`` dockerd again over TCP on loopback
(``tcp: ...``, ``DOCKER_HOST=tcp://127.0.0.1:PORT``): the wrapper asks the docker CLI for
the image's labels, and for the engine's ``ID`` (``docker info``), which the agent's row
must say for the lease to be asked (``controller.wrapper.followed_engine``).

``--podman`` (with ``--lease``, as root) adds the run as Podman's users have it:
``NV_DOCKER=podman`` (one word: its version is remembered, ``cli_versions``), a store of its
own (overlay, Podman's default driver: the image's labels are remembered, ``podman_labels``)
under the temporary directory through Podman's own settings files
(``CONTAINERS_STORAGE_CONF``, ``CONTAINERS_CONF``) holding the GPU image, the run refused by
Podman for the same unknown runtime: ``podman: podman`` is that refusal alone, then
``NV_GPU=auto`` with ``NV_CDI`` unset (Podman reads CDI: asked, or remembered) and ``yes``.
Podman has no volume driver, so there is no ``NV_CDI=no`` line.

``--compare DIR`` (with ``--lease``) adds the same variants run from another checkout of the
repository (``git worktree add /tmp/before HEAD``), interleaved with this one's: a before
and after in one run, under the same load (``x before``: the median over the other's).
Each line also has the CPU time (user and system) of the command and its children, which
other load on a shared machine moves less than the wall time.

    python -m tests.benchmarks.bench_wrapper [--runs 40] [--warmup 5]
        [--lease [--real-docker [--tcp]] [--cdi-docker [--debian-cli]] [--podman]
         [--compare DIR]]
"""

from __future__ import annotations

import argparse
import contextlib
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


REAL_IMAGE = "nvd-bench/cuda:12.4"
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
# --real-docker: docker itself refuses the run in the daemon, before any container exists
REFUSED_RUNTIME = "nvd-bench-no-such-runtime"
# NV_CPUSET=no: the fake node's cpuset (0-7) is not this machine's, and dockerd would refuse
# that before the runtime
REAL_VARIANTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("NV_GPU=auto", {"NV_GPU": "auto", "NV_CDI": "no", "NV_CPUSET": "no"}),
    ("NV_GPU=auto, NV_CDI unset", {"NV_GPU": "auto", "NV_CPUSET": "no"}),
)
REAL, CDI = "real: ", "cdi: "  # the private engines: dockerd 20.10, dockerd 25+ with CDI on
TCP = "tcp: "  # --tcp: the real: engine over TCP on loopback (DOCKER_HOST=tcp://127.0.0.1:PORT)
DEBIAN = "debian cli: "  # --debian-cli: the CDI engine through Debian's docker CLI
DEBIAN_CLI = Path("/usr/bin/docker")  # Debian's docker.io: built with -trimpath
PODMAN = "podman: "  # --podman: NV_DOCKER=podman, a private store through its own settings
PODMAN_VARIANTS: tuple[tuple[str, dict[str, str]], ...] = (  # Podman has no volume driver
    ("NV_GPU=auto, NV_CDI unset", {"NV_GPU": "auto", "NV_CPUSET": "no"}),
    ("NV_GPU=auto, NV_CDI=yes", {"NV_GPU": "auto", "NV_CDI": "yes", "NV_CPUSET": "no"}),
)
# --cdi-docker: the CDI form without asking too, so that what the question costs is apart
CDI_VARIANTS = (
    *REAL_VARIANTS,
    ("NV_GPU=auto, NV_CDI=yes", {"NV_GPU": "auto", "NV_CDI": "yes", "NV_CPUSET": "no"}),
)


class Variant:
    """One command to time: its argv and environment, and whether it must lease."""

    __slots__ = ("argv", "env", "leases", "real")

    def __init__(
        self, argv: list[str], env: dict[str, str], *, leases: bool = False, real: bool = False
    ) -> None:
        self.argv = argv
        self.env = env
        self.leases = leases
        self.real = real  # the real docker CLI: refused by the daemon (exit 125)


def lease_path(opts: argparse.Namespace) -> int:
    """``--lease``: the run path, with and without a lease (see the module docstring)."""
    from tests.support.lease_agent import LeaseAgent, served_in_thread  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPATH", None)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="nvd-bench-"))
        lease_agent = LeaseAgent(forgetful=True)
        port = stack.enter_context(served_in_thread(lease_agent))
        engine_hosts: dict[str, str] = {}
        tcp_host = None
        if opts.real_docker:
            if opts.tcp:
                from tests.support.services import free_port  # noqa: PLC0415

                tcp_host = f"tcp://127.0.0.1:{free_port()}"
            engine_hosts[REAL] = _private_engine(stack, tcp=tcp_host)
        if opts.cdi_docker:
            engine_hosts[CDI] = _private_engine(stack, cdi=Path(tmp))
        # The agent follows the node's engine and says what it answered (GET /engines/json)
        lease_agent.engines = [_followed(host) for host in engine_hosts.values()]
        if tcp_host is not None:  # the same dockerd over TCP: only its ID tells it is followed
            engine_hosts[TCP] = tcp_host
        python = _plain_venv(Path(tmp))
        _see_libraries(python)
        docker = Path(tmp) / "docker"
        docker.write_text(FAKE_DOCKER)
        docker.chmod(0o755)
        agent = {"NV_HOST": f"http://127.0.0.1:{port}"}
        scripted = {**env, **agent, "NV_DOCKER": str(docker), "NV_CDI": "no"}
        scripted["DOCKER_HOST"] = "tcp://127.0.0.1:2375"
        run = ["run", "--rm", "nvidia/cuda:12.4", "nvidia-smi"]
        exec_only = "import os, sys; os.execvp(sys.argv[1], sys.argv[1:])"
        variants: dict[str, Variant] = {
            "docker": Variant([str(docker), *run], scripted),
            "python exec": Variant([str(python), "-c", exec_only, str(docker), *run], scripted),
        }
        launchers = {"": _launcher(python, Path(tmp))}
        if opts.compare is not None:  # the same variants, run from the other checkout
            other = Path(opts.compare).resolve()
            where = Path(tmp, "compare")
            where.mkdir()
            other_python = _plain_venv(where, other)
            _see_libraries(other_python)
            launchers[COMPARED] = _launcher(
                other_python, where, launcher=other / "bin/nvidia-docker"
            )
        for prefix, launcher in launchers.items():
            for name, extra_env, flags in LEASE_VARIANTS:
                variants[f"{prefix}{name}"] = Variant(
                    [*launcher, run[0], *flags, *run[1:]],
                    {**scripted, **extra_env},
                    leases=name != "NV_GPU=0",
                )
        if opts.debian_cli:
            if CDI not in engine_hosts or not DEBIAN_CLI.exists():
                raise SystemExit(f"bench_wrapper | --debian-cli needs --cdi-docker, {DEBIAN_CLI}")
            engine_hosts[DEBIAN] = engine_hosts[CDI]
            debian_bin = Path(tmp, "debian-bin")
            debian_bin.mkdir()
            (debian_bin / "docker").symlink_to(DEBIAN_CLI)
        for engine, engine_host in engine_hosts.items():
            real_env = {**env, **agent, "DOCKER_HOST": engine_host}
            if engine == DEBIAN:  # its CLI first on PATH, its version remembered under tmp
                real_env["PATH"] = f"{debian_bin}:{env.get('PATH', os.defpath)}"
                real_env["XDG_CACHE_HOME"] = str(Path(tmp, "cache"))
            real_run = ["run", "--rm", f"--runtime={REFUSED_RUNTIME}", REAL_IMAGE, "true"]
            cli = str(DEBIAN_CLI) if engine == DEBIAN else "docker"  # spawnp: our own PATH
            variants[f"{engine}docker"] = Variant([cli, *real_run], real_env, real=True)
            variants[f"{engine}python exec"] = Variant(
                [str(python), "-c", exec_only, cli, *real_run], real_env, real=True
            )
            for prefix, launcher in launchers.items():
                for name, extra_env in CDI_VARIANTS if engine == CDI else REAL_VARIANTS:
                    variants[f"{prefix}{engine}{name}"] = Variant(
                        [*launcher, *real_run], {**real_env, **extra_env}, leases=True, real=True
                    )
        if opts.podman:
            podman_env = {
                **env, **agent, **_private_podman(stack, Path(tmp)), "NV_DOCKER": "podman",
                "XDG_CACHE_HOME": str(Path(tmp, "podman-cache")),
            }  # fmt: skip
            podman_run = ["run", "--rm", "--network", "none", f"--runtime={REFUSED_RUNTIME}"]
            podman_run += [REAL_IMAGE, "true"]
            variants[f"{PODMAN}podman"] = Variant(["podman", *podman_run], podman_env, real=True)
            variants[f"{PODMAN}python exec"] = Variant(
                [str(python), "-c", exec_only, "podman", *podman_run], podman_env, real=True
            )
            for prefix, launcher in launchers.items():
                for name, extra_env in PODMAN_VARIANTS:
                    variants[f"{prefix}{PODMAN}{name}"] = Variant(
                        [*launcher, *podman_run], {**podman_env, **extra_env}, leases=True,
                        real=True,
                    )  # fmt: skip
        engine_lines: dict[str, str] = {}  # the CDI question's NV_DEBUG line, where asked
        for name, variant in variants.items():  # each works, leases or not
            problem, engine_lines[name] = _check(variant)
            if problem:
                print(f"bench_wrapper | {name}: {problem}", file=sys.stderr)
                return 1
        print(f"bench_wrapper | run path: a plain venv ({python}), the fake agent on "
              f"127.0.0.1:{port}, a shell-script docker, NV_CDI=no")  # fmt: skip
        for engine, engine_host in engine_hosts.items():
            shown = DEBIAN_CLI if engine == DEBIAN else shutil.which("docker")
            print(f"bench_wrapper | {engine}...: the docker CLI ({shown}) and a "
                  f"private dockerd ({_server_version(engine_host)}, {engine_host}), which "
                  f"refuses the run (--runtime={REFUSED_RUNTIME}); NV_DOCKER unset")  # fmt: skip
        if opts.podman:
            print(f"bench_wrapper | {PODMAN}...: NV_DOCKER=podman ({shutil.which('podman')}), "
                  "a private store through CONTAINERS_STORAGE_CONF and CONTAINERS_CONF, "
                  f"which refuses the run (--runtime={REFUSED_RUNTIME})")  # fmt: skip
        if opts.compare is not None:
            print(f"bench_wrapper | {COMPARED}...: the same, from {opts.compare}")
        for name, line in engine_lines.items():
            if line:
                print(f"bench_wrapper | {name}: {line}")
        print(f"bench_wrapper | python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
              f"{opts.runs} runs each, interleaved, load average "
              f"{' '.join(f'{load:.2f}' for load in os.getloadavg())} before")  # fmt: skip
        print()
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(opts.warmup):
            for variant in variants.values():
                _time_cpu(variant.argv, variant.env)
        for _ in range(opts.runs):
            order = list(variants.items())
            random.shuffle(order)
            for name, variant in order:
                samples[name].append(_time_cpu(variant.argv, variant.env))
        _lease_table(samples)
        print(f"load average after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    return 0


def _lease_table(samples: dict[str, list[tuple[float, float]]]) -> None:
    """Medians of wall and CPU time (user + system, the command and its children), each
    private engine's variant against its ``real: docker`` or ``cdi: docker``, the others
    against ``docker``, and each variant against its twin from ``--compare`` (``x before``)."""

    def median(name: str, which: int = 0) -> float:
        return statistics.median(sample[which] for sample in samples[name])

    print(f"{'variant':<42} {'median ms':>9} {'p90 ms':>7} {'+ms vs docker':>13} "
          f"{'cpu ms':>7} {'+cpu vs docker':>14} {'x before':>8}")  # fmt: skip
    for name, values in samples.items():
        base = next(
            (f"{engine}docker" for engine in (DEBIAN, REAL, CDI) if engine in name), "docker"
        )
        if PODMAN in name:
            base = f"{PODMAN}podman"
        wall, cpu = median(name), median(name, 1)
        p90 = statistics.quantiles([v[0] for v in values], n=10)[-1]
        before = f"{COMPARED}{name}"
        ratio = f"{wall / median(before):>8.2f}" if before in samples else f"{'':>8}"
        print(f"{name:<42} {wall * 1e3:>9.1f} {p90 * 1e3:>7.1f} "
              f"{(wall - median(base)) * 1e3:>+13.1f} {cpu * 1e3:>7.1f} "
              f"{(cpu - median(base, 1)) * 1e3:>+14.1f} {ratio}")  # fmt: skip


def _check(variant: Variant) -> tuple[str | None, str]:
    """What is wrong with one run of ``variant`` (None: it works, and leases if it must),
    and what its engine's CDI question found and asked (``NV_DEBUG``; "": not asked)."""
    env = {**variant.env, "NV_DEBUG": "1"} if variant.real else variant.env
    done = subprocess.run(variant.argv, env=env, capture_output=True, text=True, check=False)
    said = [
        line for line in done.stderr.splitlines() if "| engine: " in line and "NV_CDI=" not in line
    ]
    engine_line = said[0].split("| engine: ", 1)[1] if said else ""
    if variant.real:
        if done.returncode != 125 or "runtime" not in done.stderr:
            return done.stderr.strip() or f"exit {done.returncode}", engine_line
        leased = "lease: granted" in done.stderr
    else:
        if done.returncode != 0:
            return done.stderr.strip() or f"exit {done.returncode}", engine_line
        leased = "--label=nvidia-docker.lease=" in done.stdout
    if leased is not variant.leases:
        return f"leased: {leased}, expected {variant.leases}: {done.stderr.strip()}", engine_line
    return None, engine_line


def _private_engine(
    stack: contextlib.ExitStack, cdi: Path | None = None, tcp: str | None = None
) -> str:
    """A private dockerd (tests.support.dockerd) with the GPU image; its DOCKER_HOST.
    ``cdi``: Debian 13's dockerd with CDI on instead, reading specs from a directory there.
    ``tcp``: a loopback ``tcp://`` address it listens on too."""
    from tests.support.dockerd import (  # noqa: PLC0415
        FETCHED_DOCKERD,
        start_engine,
        stop_engine,
    )

    if cdi is None:
        engine, proc = start_engine(extra_args=["--host", tcp] if tcp else ())
    else:
        dockerd = os.environ.get("NVD_DOCKERD_CDI") or str(FETCHED_DOCKERD)
        if not os.access(dockerd, os.X_OK):
            raise SystemExit(
                f"bench_wrapper | --cdi-docker needs a dockerd 25 or newer at {dockerd} "
                "(scripts/test-all unpacks Debian 13's there; NVD_DOCKERD_CDI names another)"
            )
        spec_dir = cdi / "cdi"
        spec_dir.mkdir()
        engine, proc = start_engine(
            dockerd=dockerd,
            extra_args=["--cdi-spec-dir", str(spec_dir)],
            daemon_json={"features": {"cdi": True}},
        )
    stack.callback(stop_engine, engine, proc)
    engine.import_busybox(REAL_IMAGE, GPU_LABELS)
    return engine.host


def _private_podman(stack: contextlib.ExitStack, tmp: Path) -> dict[str, str]:
    """``--podman``: a Podman store under ``tmp`` that a one-word ``podman`` uses through its
    own settings files (``CONTAINERS_STORAGE_CONF``, ``CONTAINERS_CONF``), holding the GPU
    image; the environment that points there. The store uses Podman's default driver,
    overlay, which keeps its directory mounted: emptied and unmounted when ``stack`` ends."""
    from tests.support.podman import (  # noqa: PLC0415
        busybox_tarball,
        cgroup_layout,
        label_changes,
        runtime_for,
    )

    root = tmp / "podman"
    root.mkdir()
    (root / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/root"\nrunroot = "{root}/run"\n'
    )
    runtime = runtime_for(cgroup_layout())
    (root / "containers.conf").write_text(
        '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
        f'tmp_dir = "{root}/tmp"\n' + (f'runtime = "{runtime}"\n' if runtime else "")
        + f'[network]\nnetwork_config_dir = "{root}/networks"\n'
    )  # fmt: skip
    environment = {
        "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
        "CONTAINERS_CONF": str(root / "containers.conf"),
    }
    tarball = busybox_tarball(root)
    stack.callback(_remove_podman_store, root / "root", {**os.environ, **environment})
    subprocess.run(
        ["podman", "import", "--quiet", *label_changes(GPU_LABELS), str(tarball), REAL_IMAGE],
        env={**os.environ, **environment}, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return environment


def _remove_podman_store(graphroot: Path, environment: dict[str, str]) -> None:
    subprocess.run(
        ["podman", "rmi", "--all", "--force"], env=environment, capture_output=True, timeout=120,
        check=False,
    )  # fmt: skip
    overlay = f" {graphroot / 'overlay'} "
    with open("/proc/mounts", encoding="utf-8") as mounts:
        if any(overlay in line for line in mounts):
            subprocess.run(["umount", str(graphroot / "overlay")], check=False)


def _followed(host: str) -> dict[str, object]:
    """The agent's ``/engines/json`` row of the engine at ``host`` (``unix://...``), as the
    agent reads it when its event stream opens (``agent.engines.facts``)."""
    import asyncio  # noqa: PLC0415

    from agent.engines.facts import EngineFacts, dockerd_version, read_facts  # noqa: PLC0415
    from agent.engines.http import EngineClient  # noqa: PLC0415

    async def read(engine: EngineClient) -> EngineFacts:
        version = await dockerd_version(engine)
        assert version is not None
        return await read_facts(engine, version)

    path = host.removeprefix("unix://")
    facts = asyncio.run(read(EngineClient(Path(path))))
    return {
        "Socket": path,
        "Following": True,
        "Version": facts.version,
        "CDISpecDirs": list(facts.cdi_spec_dirs),
        "ReadAt": facts.read_s,
        "ID": facts.engine_id,
    }


def _server_version(host: str) -> str:
    done = subprocess.run(
        ["docker", "-H", host, "version", "--format", "dockerd {{.Server.Version}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "dockerd"


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


def _time_cpu(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time, and CPU time (user + system) of the command and what it waited for."""
    started = time.perf_counter()
    pid = os.posix_spawnp(
        argv[0],
        argv,
        env,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ],
    )
    _, _, usage = os.wait4(pid, 0)
    return time.perf_counter() - started, usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per variant and command")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (pyc, caches)")
    parser.add_argument(
        "--lease", action="store_true", help="time run with and without a lease instead"
    )
    parser.add_argument(
        "--real-docker",
        action="store_true",
        help="with --lease: also time the docker CLI against a private dockerd (root, dockerd)",
    )
    parser.add_argument(
        "--cdi-docker",
        action="store_true",
        help="with --lease: also time it against a private dockerd 25+ with CDI on (root)",
    )
    parser.add_argument(
        "--debian-cli",
        action="store_true",
        help="with --cdi-docker: also through Debian's docker CLI (-trimpath: no version in it)",
    )
    parser.add_argument(
        "--tcp",
        action="store_true",
        help="with --real-docker: also its dockerd over TCP on loopback (its ID checked)",
    )
    parser.add_argument(
        "--podman",
        action="store_true",
        help="with --lease: also NV_DOCKER=podman, a private store (root, podman)",
    )
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="also time nvidia-docker of the checkout in DIR, interleaved (before and after)",
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
        if opts.compare is not None:  # nvidia-docker of the other checkout, in its own venv
            other = Path(opts.compare).resolve()
            where = Path(tmp, "compare")
            where.mkdir()
            other_python = _plain_venv(where, other)
            other_launcher = other / "bin" / "nvidia-docker"
            variants[f"{COMPARED}nv-docker"] = _launcher(
                other_python, where, launcher=other_launcher
            )
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
        if opts.compare is not None:
            print(f"bench_wrapper | {COMPARED}nv-docker: nvidia-docker from {opts.compare}")
        print(f"{'command':<18} {'variant':<20} {'median ms':>10} {'p90 ms':>8} "
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
                print(f"{label:<18} {name:<20} {med * 1e3:>10.1f} {p90 * 1e3:>8.1f} "
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
