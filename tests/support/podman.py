"""A real Podman (Debian's ``podman`` package) with its storage and state in a private
directory, for the CDI tests.

Every call passes ``--root``, ``--runroot``, ``--tmpdir`` and ``--network-config-dir`` under
that directory, so containers and images never touch the machine's own Podman store. Podman
still creates two small machine paths of its own on first use (``/var/lib/containers/cache``,
its blob-info cache, and ``/run/containers``); ``private_podman`` removes them afterwards
when they were not there before. Containers run as this sandbox allows them: ``--network
none`` and ``--ulimit nofile=1024:1024 --ulimit nproc=1024:1024`` (it refuses Podman's
default limits). Images come from ``podman import`` of a root filesystem tarball.

Podman 4.3 reads CDI specs from ``/etc/cdi`` and ``/var/run/cdi`` only (no option moves
them), so a test that runs CDI devices writes its spec there, under ``CDI_LOCK``.

The OCI runtime is chosen for the machine's cgroup layout (``cgroup_layout``): crun, Debian's
default where it is installed, refuses a hybrid layout (v1 controllers plus a cgroup2
``/sys/fs/cgroup/unified``: "cgroups in hybrid mode not supported"), so there every call
passes ``--runtime runc``; on v1 and v2 machines Podman's own choice stays. ``describe``
says which layout and runtime a run used (the test session's header prints it).

``api_service`` runs Podman's API service (``podman system service``, what the
``podman.socket`` unit gives a node) on a socket of the test, ready once it answers
``/_ping``; a test can stop and start it again (``ApiService.restart``), as a node's
service restarts: the socket goes away while it is down.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.dockerd import BUSYBOX
from tests.support.prerequisites import unavailable
from tests.support.services import machine_lock, stop_process, wait_until

REPO = Path(__file__).resolve().parents[2]
SHIPPED_START_HOOK = REPO / "packaging" / "podman" / "nvidia-docker-start-hook.json"
LOCK = "podman"  # machine_lock names: one podman test run at a time on the machine
CDI_LOCK = "cdi"  # and one writer of the machine-wide CDI directories
MACHINE_PATHS = (Path("/var/lib/containers"), Path("/run/containers"))
RUN_LIMITS = ("--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _is_cgroup2(path: Path) -> bool:
    """Whether ``path`` is a cgroup2 mount (cgroup.controllers exists only there)."""
    return (path / "cgroup.controllers").is_file()


def cgroup_layout(root: Path = CGROUP_ROOT) -> str:
    """``v2`` (unified), ``hybrid`` (v1 controllers and a cgroup2 ``unified``) or ``v1``."""
    if _is_cgroup2(root):
        return "v2"
    if _is_cgroup2(root / "unified"):
        return "hybrid"
    return "v1"


def runtime_for(layout: str) -> str | None:
    """The OCI runtime to ask for on ``layout``; None: Podman's default."""
    return "runc" if layout == "hybrid" else None


def describe() -> str:
    """``cgroup layout hybrid: podman --runtime runc``: for the test session's header."""
    layout = cgroup_layout()
    runtime = runtime_for(layout)
    chosen = f"--runtime {runtime}" if runtime else "its default runtime"
    return f"cgroup layout {layout}: podman with {chosen}"


APPLETS = ("sh", "ls", "cat", "echo", "find", "stat", "test", "sort", "grep", "sleep")


@dataclass(frozen=True)
class Podman:
    base: Path
    hooks_dir: Path | None = None  # --hooks-dir: the OCI hooks of this Podman's containers

    @property
    def command(self) -> list[str]:
        """``podman`` and its global options: what NV_DOCKER names for the wrapper."""
        hooks = ["--hooks-dir", str(self.hooks_dir)] if self.hooks_dir is not None else []
        return [
            "podman",
            "--root", str(self.base / "root"),
            "--runroot", str(self.base / "run"),
            "--tmpdir", str(self.base / "tmp"),
            "--network-config-dir", str(self.base / "networks"),
            "--events-backend", "file",
            "--cgroup-manager", "cgroupfs",
            *_runtime_args(),
            *hooks,
        ]  # fmt: skip

    def __call__(
        self, *args: str, check: bool = True, timeout_s: float = 180
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.command, *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} failed: {done.stderr.strip()}")
        return done

    def run(
        self, image: str, *command: str, devices: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        """``podman run --rm`` with the sandbox's limits and the given ``--device`` values."""
        device_args = [f"--device={device}" for device in devices]
        return self("run", "--rm", *RUN_LIMITS, *device_args, image, *command, check=False)

    def import_tarball(self, tarball: Path, tag: str, labels: Mapping[str, str]) -> str:
        self("import", "--quiet", *label_changes(labels), str(tarball), tag, timeout_s=600)
        return tag

    def import_busybox(self, tag: str, labels: Mapping[str, str]) -> str:
        with tempfile.TemporaryDirectory(prefix="nvd-podman-rootfs-") as tmp:
            return self.import_tarball(busybox_tarball(Path(tmp)), tag, labels)


def busybox_tarball(directory: Path) -> Path:
    """A busybox root filesystem (``APPLETS`` linked) as ``directory/rootfs.tar``."""
    rootfs = directory / "rootfs"
    for name in ("bin", "tmp", "etc", "proc", "sys", "dev", "usr/local"):
        (rootfs / name).mkdir(parents=True)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    tarball = directory / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    return tarball


def label_changes(labels: Mapping[str, str]) -> list[str]:
    """``podman import``'s ``--change`` arguments that give the image ``labels``."""
    return [arg for k, v in labels.items() for arg in ("--change", f"LABEL {k}={v}")]


def _runtime_args() -> list[str]:
    runtime = runtime_for(cgroup_layout())
    if runtime is None:
        return []
    if shutil.which(runtime) is None:
        unavailable(
            f"this machine's cgroups are hybrid, where crun refuses to run: Podman needs "
            f"{runtime} (apt-get install {runtime}; scripts/test-all does)"
        )
    return ["--runtime", runtime]


@contextlib.contextmanager
def private_podman(hooks_dir: Path | None = None) -> Iterator[Podman]:
    """A Podman whose store lives in a temporary directory, removed afterwards; its
    containers run the OCI hooks of ``hooks_dir`` (None: the machine's)."""
    if shutil.which("podman") is None:
        unavailable("podman is not installed (apt-get install podman; scripts/test-all does)")
    if not BUSYBOX.exists():
        unavailable("needs busybox-static for the test image")
    with machine_lock(LOCK):
        there_before = {path for path in MACHINE_PATHS if path.exists()}
        podman = Podman(Path(tempfile.mkdtemp(prefix="nvd-podman-")), hooks_dir)
        try:
            yield podman
        finally:
            podman("rm", "--all", "--force", check=False)
            podman("rmi", "--all", "--force", check=False)
            shutil.rmtree(podman.base, ignore_errors=True)
            for path in MACHINE_PATHS:
                if path not in there_before:
                    shutil.rmtree(path, ignore_errors=True)


def answers_ping(socket_path: Path, timeout_s: float = 5.0) -> bool:
    """Whether an API service answers ``GET /_ping`` with 200 on ``socket_path``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(socket_path))
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")
            head = sock.recv(64)
    except OSError:
        return False
    return head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))


@dataclass
class ApiService:
    """Podman's API service on ``socket_path``, for ``podman``'s store (``start``,
    ``stop``, ``restart``: each returns once the service answers, or has ended)."""

    podman: Podman
    socket_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [*self.podman.command, "system", "service", "--time=0", f"unix://{self.socket_path}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(
            lambda: answers_ping(self.socket_path),
            what=f"podman system service on {self.socket_path}",
            timeout_s=timeout_s,
            proc=self.proc,
        )

    def stop(self) -> None:
        """SIGTERM (then SIGKILL): the service ends, its socket is removed, the containers
        run on (conmon is their parent, not the service)."""
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        self.socket_path.unlink(missing_ok=True)  # a killed service leaves it behind

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def api_service(podman: Podman, socket_path: Path | None = None) -> Iterator[ApiService]:
    """Podman's API service for ``podman`` (on ``<its base>/podman.sock`` by default),
    answering; stopped afterwards."""
    service = ApiService(podman, socket_path or podman.base / "podman.sock")
    try:
        service.start()
        yield service
    finally:
        service.stop()


def write_start_hook(hooks_dir: Path, socket_path: Path) -> None:
    """Podman's start gate in ``hooks_dir`` (a Podman's ``--hooks-dir``): the hook file the
    package ships, naming this checkout's ``nvidia-docker-start-hook`` (beside the tests'
    Python) and the agent's plugin socket ``socket_path``."""
    program = Path(sys.executable).parent / "nvidia-docker-start-hook"
    if not program.exists():
        unavailable(f"{program} is missing: pip install -e . (scripts/test-all does)")
    hook = json.loads(SHIPPED_START_HOOK.read_text())
    hook["hook"]["path"] = str(program)
    hook["hook"]["args"] = ["nvidia-docker-start-hook", "--socket", str(socket_path)]
    hooks_dir.mkdir(parents=True, exist_ok=True)
    (hooks_dir / SHIPPED_START_HOOK.name).write_text(json.dumps(hook))


def podman_plugin_dir(podman_base: Path) -> Path:
    """Where the agent whose start gate ``gated_api_service`` installs serves its plugin
    socket (one agent at a time)."""
    return podman_base / "plugins"


@contextlib.contextmanager
def gated_api_service(image: str) -> Iterator[ApiService]:
    """A private Podman with the busybox image as ``image``, and its API service; its
    containers run Podman's start gate (the packaged hook file), which asks the agent
    serving its plugin socket in ``podman_plugin_dir`` (a container with no NVIDIA device
    starts without asking)."""
    hooks_dir = Path(tempfile.mkdtemp(prefix="nvd-podman-hooks-"))
    try:
        with private_podman(hooks_dir=hooks_dir) as podman:
            write_start_hook(hooks_dir, podman_plugin_dir(podman.base) / "nvidia-docker.sock")
            podman.import_busybox(image, {})
            with api_service(podman) as service:
                yield service
    finally:
        shutil.rmtree(hooks_dir, ignore_errors=True)
