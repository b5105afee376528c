"""GPU leases end to end with rootless Podman: ``NV_DOCKER=podman NV_GPU=auto nvidia-docker
run`` by a user of its own (a throwaway system user, ``USER``) with Debian 12's Podman 4.3
rootless (a user namespace through ``newuidmap``, the vfs store in the user's home), and a
real agent process (root) serving the simulated ``hgx-h200-8`` node.

Rootless Podman's containers are the user's own: the agent sees them only where it follows
that user's Podman API service. Checked:

- an agent that does not (its ``--podman-socket`` a path where nothing listens): the run
  exits 1 with the one line that says why, naming the user's uid, before anything is
  leased: no container, no lease, every GPU free. So do the runs with ``NV_DOCKER="podman
  --url unix://<the user's socket>"`` (by the user, and by root), with ``NV_DOCKER`` unset
  where the user's ``docker`` is podman-docker's script, with ``NV_DOCKER="env LANG=C
  podman"``, and with a connection the user added (``podman system connection add
  --default``, in Podman 4's containers.conf): ``podman --connection NAME``,
  ``CONTAINER_CONNECTION=NAME`` and ``podman --remote`` (the default connection);
- an agent that follows the user's service (``--podman-socket <the user's socket>``): the
  run gets a GPU, as its CDI name; the lease is bound to the container and stays bound once
  the wrapper's watcher has asked for it back (``DELETE /leases/{id}/pending``, which an
  engine's container refuses) and ended; a second run, through podman-docker's ``docker``,
  gets another GPU; ``podman rm -f`` by the user frees the first one's GPU within a
  second.

The user gets subordinate ids far above useradd's ranges (``SUBIDS``), a runtime directory
(``XDG_RUNTIME_DIR``) in a directory of the test, where its API service listens
(``<runtime>/podman/podman.sock``, as ``podman.socket`` has it in ``/run/user/<uid>``), and a
containers.conf that keeps Podman's events in a file (the service streams what the CLI
writes; there is no journal here) and, on hybrid cgroups, runs runc (tests/support/podman.py).
All it runs goes through ``setpriv`` with a clean environment; the wrapper runs on the
system's ``/usr/bin/python3`` from a copy of the ``controller`` package the user can read
(the checkout and the tests' virtual environment may be root's alone: CI's clones are 0700).
The user, its processes, files and subordinate ids are removed afterwards.

Rootless runc needs two things of the node that root's does not, set up here as a packaged
node has them: the device nodes at their own paths (rootless runc cannot mknod: it
bind-mounts the host's ``/dev/nvidiaN``, whatever the spec's ``hostPath`` says), made in /dev
under the device lock (``tests.support.device_nodes``); and the CDI spec's hook program where
the user can run it: the agent runs from a view of the tests' virtual environment in a
directory of the test, beside a ``nvidia-docker-cdi-hook`` that runs a copy of the ``cdi``
package on ``/usr/bin/python3``. The spec itself is written to /var/run/cdi under the CDI
lock, its ``--cdi-dev-root`` nodes made with mknod, as in tests/e2e/test_leases_podman.py;
the module holds the Podman lock too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.cdi_spec.writer import HOOK_PROGRAM
from tests.support.agent_process import launch_agent, wait_ready
from tests.support.cdi_node import SPEC_NAME, foreign_specs
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import BUSYBOX
from tests.support.lease_node import LeaseNode, one_line
from tests.support.podman import (
    CDI_LOCK,
    LOCK,
    RUN_LIMITS,
    answers_ping,
    busybox_tarball,
    cgroup_layout,
    runtime_for,
)
from tests.support.prerequisites import require_root, unavailable
from tests.support.services import machine_lock, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
USER = "nvd-rootless"
COMMENT = "nvidia-docker tests, rootless Podman (tests/e2e/test_leases_rootless_podman.py)"
SUBIDS = (1_100_000_000, 65_536)  # first subordinate uid and gid, and how many
IMAGE = "nvd-rootless/busybox:1"
CONNECTION = "nvd-own.service"  # the user's connection to its own service (a quoted TOML key)
GPUS = 8
CDI_DIR = Path("/var/run/cdi")
SPEC = CDI_DIR / SPEC_NAME
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the user's
SYSTEM_PYTHON = Path("/usr/bin/python3")
WRAPPER = "controller.wrapper.cli"
FREED_WITHIN_S = 1.0  # podman rm -f returned -> its lease gone from GET /leases/json
LEASE_LABEL = "nvidia-docker.lease"
LEASE_DEVICES = "nvidia-docker.lease.devices"
TOOLS = {  # command: the Debian package that has it
    "podman": "podman",
    "newuidmap": "uidmap",
    "newgidmap": "uidmap",
    "setpriv": "util-linux",
    "useradd": "passwd",
    "usermod": "passwd",
    "userdel": "passwd",
}
# podman-docker's /usr/bin/docker (Debian's and Fedora's; Podman 4.3's docker file)
PODMAN_DOCKER = """#!/bin/sh
[ -e /etc/containers/nodocker ] || \\
echo "Emulate Docker CLI using podman. Create /etc/containers/nodocker to quiet msg." >&2
exec /usr/bin/podman "$@"
"""
HOOK_SCRIPT = """#!{python}
import sys
sys.path.insert(0, {code!r})
from cdi.hook import main
sys.exit(main())
"""


@dataclass(frozen=True)
class Rootless:
    """The user and what it runs: the directory of the test ``base`` (0755) holds its
    runtime directory and the code it runs."""

    uid: int
    gid: int
    home: Path
    base: Path

    @property
    def runtime_dir(self) -> Path:
        return self.base / "run"

    @property
    def socket_path(self) -> Path:
        """Where its Podman API service listens."""
        return self.runtime_dir / "podman" / "podman.sock"

    @property
    def code(self) -> Path:
        """The copies of the ``controller`` and ``cdi`` packages the user runs."""
        return self.base / "code"

    def command(self, *args: str, env: Mapping[str, str] | None = None) -> list[str]:
        """``args`` run as the user, in a clean environment with ``env`` added."""
        environment = {
            "HOME": str(self.home),
            "USER": USER,
            "LOGNAME": USER,
            "PATH": PATH,
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            **(env or {}),
        }
        setpriv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]
        return [*setpriv, "env", "-i", *(f"{k}={v}" for k, v in environment.items()), *args]

    def run(
        self, *args: str, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args, env=env),
            cwd=self.home,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )

    def podman(self, *args: str) -> str:
        done = self.run("podman", *args)
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
        return done.stdout.strip()

    @property
    def podman_docker(self) -> Path:
        """A directory with podman-docker's ``docker`` (a script that runs ``podman``)."""
        return self.base / "podman-docker"

    def nvidia_docker_run(self, agent_url: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``NV_DOCKER=podman NV_GPU=auto nvidia-docker run -d IMAGE sleep 600``, as the
        user (``env``: other variables, ``NV_DOCKER`` among them)."""
        given = {"NV_DOCKER": "podman", "NV_HOST": agent_url, "NV_GPU": "auto", **env}
        return self.run(
            str(SYSTEM_PYTHON), "-m", WRAPPER, "run", "-d", *RUN_LIMITS, IMAGE, "sleep", "600",
            env={**given, "PYTHONPATH": str(self.code)},
        )  # fmt: skip

    def through_podman_docker(self, agent_url: str) -> subprocess.CompletedProcess[str]:
        """``nvidia-docker run`` as the user with ``NV_DOCKER`` unset (``docker``), whose
        ``docker`` is podman-docker's script."""
        path = f"{self.podman_docker}:{PATH}"
        return self.nvidia_docker_run(agent_url, NV_DOCKER="docker", PATH=path)

    def labels(self, container_id: str) -> tuple[str, str, list[str]]:
        """(its lease label, its lease's device UUID, the --device values it was created
        with)."""
        config = self.podman("inspect", "--format", "{{json .Config}}", container_id)
        found = json.loads(config)
        given = [arg for arg in found["CreateCommand"] if arg.startswith("--device")]
        return found["Labels"][LEASE_LABEL], found["Labels"][LEASE_DEVICES], given

    def watchers(self) -> list[int]:
        """The wrapper's lease watchers still there (forked from the wrapper: its command
        line)."""
        return [pid for pid, cmdline in _processes(self.uid).items() if WRAPPER in cmdline]

    def wait_watchers_ended(self) -> None:
        """The watcher asks ``DELETE /leases/{id}/pending`` once podman has ended, then
        exits."""
        wait_until(
            lambda: not self.watchers(),
            what="the wrapper's lease watchers ended",
            timeout_s=30,
        )


def _require_tools() -> None:
    for command, package in TOOLS.items():
        if shutil.which(command, path=PATH) is None:
            unavailable(f"needs {command} (apt-get install {package}; scripts/test-all does)")
    if not SYSTEM_PYTHON.exists():
        unavailable(f"the wrapper runs as the user on {SYSTEM_PYTHON}, which is missing")
    if not BUSYBOX.exists():
        unavailable("needs busybox-static for the test image")
    runtime = runtime_for(cgroup_layout())
    if runtime is not None and shutil.which(runtime, path=PATH) is None:
        unavailable(
            f"the cgroups here are hybrid: Podman needs {runtime} (apt-get install {runtime})"
        )
    userns = Path("/proc/sys/kernel/unprivileged_userns_clone")
    if userns.exists() and userns.read_text().strip() == "0":
        unavailable("users get no user namespaces here (kernel.unprivileged_userns_clone=0)")


def _subid_clash() -> str | None:
    """A line of /etc/subuid or /etc/subgid whose range meets ``SUBIDS``, if any."""
    first, count = SUBIDS
    for path in (Path("/etc/subuid"), Path("/etc/subgid")):
        for line in path.read_text().splitlines() if path.exists() else ():
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                start, length = int(fields[1]), int(fields[2])
                if start < first + count and first < start + length:
                    return f"{path}: {line}"
    return None


def _owned(pid: int, uid: int) -> bool:
    """Whether process ``pid`` is alive (not a zombie) and runs as ``uid`` or one of its
    subordinate ids."""
    first, count = SUBIDS
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    real = int(status["Uid"].split()[0])
    return status["State"].split()[0] != "Z" and (real == uid or first <= real < first + count)


def _processes(uid: int) -> dict[int, str]:
    """The live processes of ``uid`` and its subordinate ids: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _owned(int(entry.name), uid):
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _end_processes(uid: int) -> None:
    """SIGKILL every process of the user (its Podman's pause process, conmon, containers),
    each on a pidfd opened before its owner is checked again (a pid reused meanwhile is
    never signalled), until none is left."""

    def none_left() -> bool:
        pids = _processes(uid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(pid)
                try:
                    if _owned(pid, uid):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                finally:
                    os.close(pidfd)
        return not pids

    wait_until(none_left, what=f"the processes of {USER} ended", timeout_s=30)


def _subid_args() -> list[str]:
    first, count = SUBIDS
    ids = f"{first}-{first + count - 1}"
    return ["--add-subuids", ids, "--add-subgids", ids]


@contextlib.contextmanager
def _throwaway_user() -> Iterator[pwd.struct_passwd]:
    """``USER``, made here with its subordinate ids; afterwards its processes ended and the
    user removed with its home and subordinate ids. A user of that name left by a run that
    stopped before its cleanup (its comment is ``COMMENT``) is removed first; one of that
    name that is not the tests' is never touched: the module cannot run there."""
    with contextlib.suppress(KeyError):
        left = pwd.getpwnam(USER)
        if left.pw_gecos != COMMENT:
            unavailable(f"a user {USER} that is not this test's is here: the test cannot run")
        _remove_user(left.pw_uid)
    clash = _subid_clash()
    if clash is not None:
        unavailable(f"the subordinate ids {SUBIDS} of the test are taken: {clash}")
    subprocess.run(
        ["useradd", "--system", "--create-home", "--shell", "/usr/sbin/nologin",
         "--comment", COMMENT, USER],
        check=True,
        capture_output=True,
    )  # fmt: skip
    user = pwd.getpwnam(USER)
    try:
        subprocess.run(["usermod", *_subid_args(), USER], check=True, capture_output=True)
        yield user
    finally:
        _remove_user(user.pw_uid)


def _remove_user(uid: int) -> None:
    """End ``USER``'s processes, then remove it with its home and subordinate ids."""
    _end_processes(uid)
    removed = subprocess.run(
        ["userdel", "--remove", USER], capture_output=True, text=True, check=False
    )
    assert removed.returncode == 0, removed.stderr
    assert _subid_clash() is None  # userdel removes its lines of /etc/subuid and subgid


def _chown_tree(path: Path, user: Rootless) -> None:
    os.chown(path, user.uid, user.gid)
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(Path(root) / name, user.uid, user.gid)


def _readable_copy(package: str, into: Path) -> None:
    """The checkout's ``package`` under ``into``, readable by every user."""
    target = into / package
    shutil.copytree(REPO / package, target, ignore=shutil.ignore_patterns("__pycache__"))
    for root, _dirs, files in os.walk(target):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(Path(root) / name, 0o644)
    into.chmod(0o755)


def _prepare(user: Rootless) -> None:
    """The user's runtime directory, containers.conf, code and image."""
    user.runtime_dir.mkdir(mode=0o700)
    (user.runtime_dir / "podman").mkdir()
    _chown_tree(user.runtime_dir, user)
    engine = ['events_logger = "file"', 'cgroup_manager = "cgroupfs"']
    runtime = runtime_for(cgroup_layout())
    if runtime is not None:
        engine.append(f'runtime = "{runtime}"')
    config = user.home / ".config"
    (config / "containers").mkdir(parents=True)
    (config / "containers" / "containers.conf").write_text("\n".join(["[engine]", *engine, ""]))
    _chown_tree(config, user)
    for package in ("controller", "cdi"):
        _readable_copy(package, user.code)
    user.podman_docker.mkdir(mode=0o755)
    (user.podman_docker / "docker").write_text(PODMAN_DOCKER)
    (user.podman_docker / "docker").chmod(0o755)
    image = user.base / "image"
    image.mkdir(mode=0o755)
    tarball = busybox_tarball(image)
    tarball.chmod(0o644)
    user.podman("import", "--quiet", str(tarball), IMAGE)


@contextlib.contextmanager
def _api_service(user: Rootless) -> Iterator[None]:
    """The user's Podman API service on ``user.socket_path``, answering; stopped
    afterwards."""
    with (user.base / "podman-service.log").open("wb") as log:
        proc = subprocess.Popen(
            user.command("podman", "system", "service", "--time=0", f"unix://{user.socket_path}"),
            cwd=user.home,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: answers_ping(user.socket_path),
            what=f"the user's podman system service on {user.socket_path}",
            timeout_s=60,
            proc=proc,
        )
        yield
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def rootless() -> Iterator[Rootless]:
    """The user, with the busybox image in its store and its API service answering."""
    require_root()
    _require_tools()
    with nvidia_nodes(wanted_nodes(range(GPUS))), machine_lock(LOCK), _throwaway_user() as pw:
        base = Path(tempfile.mkdtemp(prefix="nvd-rootless-"))
        base.chmod(0o755)
        user = Rootless(pw.pw_uid, pw.pw_gid, Path(pw.pw_dir), base)
        try:
            _prepare(user)
            with _api_service(user):
                yield user
        finally:
            user.run("podman", "rm", "--all", "--force", "--time", "0")
            _end_processes(user.uid)
            shutil.rmtree(base, ignore_errors=True)


@dataclass
class Node(LeaseNode):
    """The agent of the simulated node."""

    engine_name = "the user's Podman API service"

    def follows(self) -> int:
        log = self.log()
        return log.count("Following the container events of Podman") + log.count(
            "answers again: following its container events"
        )

    def gpu_names(self) -> dict[str, str]:
        """Unit UUID -> its name (``0`` .. ``7``)."""
        return {unit["UUID"]: unit["Name"] for unit in self.table()["Units"]}

    def states(self) -> list[str]:
        return [unit["State"] for unit in self.table()["Units"]]

    def following(self) -> dict[str, bool]:
        """Its engine sockets (``GET /engines/json``): socket -> whether it follows it."""
        status, answer = self.agent.call("GET", "/engines/json")
        assert status == 200, answer
        return {row["Socket"]: row["Following"] for row in answer["Engines"]}


def _make_dev_root(root: Path) -> None:
    """The node's device nodes under ``root``, numbered as those made in /dev."""
    for path, (major, minor) in wanted_nodes(range(GPUS)).items():
        node = root / path.lstrip("/")
        node.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def _agent_python(view: Path, code: Path) -> Path:
    """This interpreter, run from ``view`` (a view of its virtual environment, if it is in
    one), with a ``nvidia-docker-cdi-hook`` beside it that the user can run: the agent names
    that one in its spec."""
    bin_dir = view / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.symlink_to(sys.executable)
    if sys.prefix != sys.base_prefix:
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", view / "pyvenv.cfg")
        (view / "lib").symlink_to(Path(sys.prefix) / "lib")
    hook = bin_dir / HOOK_PROGRAM
    hook.write_text(HOOK_SCRIPT.format(python=SYSTEM_PYTHON, code=str(code)))
    hook.chmod(0o755)
    return python


@contextlib.contextmanager
def _node(user: Rootless, *, following_the_user: bool) -> Iterator[Node]:
    """An agent whose ``--podman-socket`` is the user's service (``following_the_user``)
    or a path where nothing listens, its CDI spec in /var/run/cdi; afterwards the user's
    containers removed, the agent stopped, the spec removed."""
    with machine_lock(CDI_LOCK):
        if foreign_specs():
            unavailable(f"another CDI spec of kind nvidia.com/gpu is here: {foreign_specs()}")
        made_dir = not CDI_DIR.exists()
        base = Path(tempfile.mkdtemp(prefix="nvd-rootless-agent-"))
        base.chmod(0o755)  # the user's runc mounts the driver volume from under it
        _make_dev_root(base / "devroot")
        podman_socket = user.socket_path if following_the_user else base / "no-podman.sock"
        agent = launch_agent(
            base,
            "--podman-socket", str(podman_socket),
            "--docker-socket", str(base / "no-docker.sock"),
            "--state-dir", str(base / "state"),
            "--cdi-spec-dir", str(CDI_DIR),
            "--cdi-dev-root", str(base / "devroot"),
            simulate="hgx-h200-8",
            python=_agent_python(base / "python", user.code),
        )  # fmt: skip
        node = Node(base, agent)
        try:
            wait_ready(agent)
            wait_until(
                lambda: SPEC.exists() and (node.follows() > 0 or not following_the_user),
                what=f"the agent's CDI spec, and its following Podman (log: {agent.log_path})",
                timeout_s=60,
                proc=agent.proc,
            )
            yield node
        finally:
            user.run("podman", "rm", "--all", "--force", "--time", "0")
            stop_process(agent.proc)
            SPEC.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()
            shutil.rmtree(base, ignore_errors=True)


def _refused(run: subprocess.CompletedProcess[str], uid: int) -> None:
    """The run exited 1 with the one line that says why, naming ``uid``."""
    assert run.returncode == 1, (run.stdout, run.stderr)
    line = one_line(run.stderr)
    assert line.startswith("nvidia-docker | "), line
    message = line.split(" Error: ", 1)[1]
    assert message.startswith(  # NV_GPU=auto is auto:1
        f"NV_GPU=auto:1 asks for a GPU lease, but Podman runs rootless here (uid {uid}) and "
        "the node's agent does not follow this user's containers"
    ), line
    assert run.stdout == ""


def _as_root(agent_url: str, nv_docker: str) -> subprocess.CompletedProcess[str]:
    """``nvidia-docker run`` as root (this process's user), with ``NV_DOCKER``."""
    env = {
        "PATH": PATH, "HOME": "/root", "NV_HOST": agent_url, "NV_GPU": "auto",
        "NV_DOCKER": nv_docker, "PYTHONPATH": str(REPO),
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", WRAPPER, "run", "-d", *RUN_LIMITS, IMAGE, "sleep", "600"],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )


def test_a_lease_is_refused_where_the_agent_does_not_follow_the_users_podman(
    rootless: Rootless,
) -> None:
    """``podman``; a client of the user's service (``--url``), run by the user and by root;
    ``docker`` that is podman-docker's script; ``env ... podman``; a client of a connection
    to the user's service, by name and as the default: each refused, naming the user's
    uid."""
    url = f"unix://{rootless.socket_path}"
    with _node(rootless, following_the_user=False) as node:
        assert not any(node.following().values())
        _refused(rootless.nvidia_docker_run(node.url), rootless.uid)
        _refused(
            rootless.nvidia_docker_run(node.url, NV_DOCKER=f"podman --url {url}"), rootless.uid
        )
        _refused(rootless.through_podman_docker(node.url), rootless.uid)
        _refused(rootless.nvidia_docker_run(node.url, NV_DOCKER="env LANG=C podman"), rootless.uid)
        _refused(_as_root(node.url, f"podman --url {url}"), rootless.uid)
        rootless.podman("system", "connection", "add", "--default", CONNECTION, url)
        try:
            for nv_docker, env in (
                (f"podman --connection {CONNECTION}", {}),
                ("podman --remote", {"CONTAINER_CONNECTION": CONNECTION}),
                ("podman --remote", {}),  # the default connection
            ):
                run = rootless.nvidia_docker_run(node.url, NV_DOCKER=nv_docker, **env)
                _refused(run, rootless.uid)
        finally:
            rootless.podman("system", "connection", "remove", CONNECTION)

        assert rootless.podman("ps", "--all", "--quiet") == ""
        table = node.table()
        assert (table["Leases"], table["Waiting"]) == ([], [])
        assert set(node.states()) == {"free"}


def test_a_lease_holds_where_the_agent_follows_the_users_podman(rootless: Rootless) -> None:
    with _node(rootless, following_the_user=True) as node:
        assert node.following()[str(rootless.socket_path)]
        run = rootless.nvidia_docker_run(node.url)
        assert run.returncode == 0, run.stderr
        first = run.stdout.strip()
        lease, uuid, given = rootless.labels(first)
        assert given == [f"--device=nvidia.com/gpu={uuid}"]  # the leased GPU, and only it

        # The watcher asked for the lease back once podman had returned, and ended: the
        # agent, which lists the user's containers, kept it bound.
        rootless.wait_watchers_ended()
        node.wait_bound([first], "the lease bound to the user's container")
        wait_until(
            lambda: node.leases()[first]["State"] == "running",
            what="the lease's container seen running",
            proc=node.agent.proc,
        )
        held = node.leases()[first]
        assert (held["Lease"], held["Units"]) == (lease, [node.gpu_names()[uuid]])
        assert node.states().count("leased") == 1

        again = rootless.through_podman_docker(node.url)  # NV_DOCKER unset: podman-docker
        assert again.returncode == 0, again.stderr
        second = again.stdout.strip()
        second_lease, second_uuid, _ = rootless.labels(second)
        assert second_uuid != uuid
        # Podman's container through podman-docker's docker has the lease's annotations too
        annotations = json.loads(
            rootless.podman("inspect", "--format", "{{json .Config.Annotations}}", second)
        )
        assert annotations[LEASE_LABEL] == second_lease, annotations
        rootless.wait_watchers_ended()
        node.wait_bound([first, second], "both leases bound")
        assert node.bound() == {first: lease, second: second_lease}

        rootless.podman("rm", "--force", "--time", "0", first)
        returned = time.monotonic()
        wait_until(
            lambda: first not in node.bound(),
            what="the removed container's lease gone",
            timeout_s=10,
            proc=node.agent.proc,
        )
        freed = time.monotonic()
        print(f"its lease was gone {freed - returned:.3f} s after podman rm -f returned")
        assert freed - returned < FREED_WITHIN_S
        assert node.bound() == {second: second_lease}
        states = node.states()
        assert (states.count("leased"), states.count("free")) == (1, GPUS - 1)
