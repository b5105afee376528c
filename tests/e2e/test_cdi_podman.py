"""The agent's CDI spec with a real Podman (Debian 12's 4.3.1), end to end.

A real agent process serves the simulated ``h200x2-mig`` node (GPU 0 in MIG mode with four
MIG devices, GPU 1 whole) against the fake driver root (real ELF libraries built with gcc)
and writes its spec into ``/var/run/cdi`` (Podman 4.3 reads nowhere else), under a
machine-wide lock, and the test removes it afterwards. The device nodes are made with mknod
in a private dev root (``--cdi-dev-root``), so the spec names them by ``hostPath`` and
nothing machine-wide is made under ``/dev``; nothing opens them.

Checked: the container sees exactly the selected ``/dev/nvidia*`` nodes (with the real
numbers) and the control nodes; the CDI hook puts the driver volume's libraries in the
container's linker cache, so a Python program in a Debian image without LD_LIBRARY_PATH
loads ``libcuda.so.1`` and ``libnvidia-ml.so.1`` by soname; ``NV_DOCKER=podman nvidia-docker
run`` gives a labelled image its GPUs through CDI and runs an unlabelled one unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cdi_node import (
    CAPS_MAJOR,
    CONTROL,
    GPU1,
    LABELS,
    LIST_NODES,
    MIGS,
    NVIDIA_MAJOR,
    PROGRAM,
    CdiAgent,
    caps_of,
    running_cdi_agent,
)
from tests.support.cdi_node import nodes_seen as seen_in
from tests.support.cdi_schema import schema_errors
from tests.support.fake_driver import (
    NEW_VERSION,
    FakeDriver,
    build_fake_driver,
    install_driver,
    remove_fake_driver,
)
from tests.support.podman import CDI_LOCK, Podman, private_podman
from tests.support.services import machine_lock, wait_until
from tests.support.systemd_hosts import ensure_rootfs_tarball

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CDI_DIR = Path("/var/run/cdi")
SPEC = CDI_DIR / "nvidia-docker.json"


def _foreign_specs() -> list[str]:
    """Specs of kind nvidia.com/gpu that are not ours: Podman would see two devices "0"."""
    found = []
    for directory in (Path("/etc/cdi"), CDI_DIR):
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            if path.name != SPEC.name and '"nvidia.com/gpu"' in path.read_text(errors="replace"):
                found.append(str(path))
    return found


@contextlib.contextmanager
def _cdi_agent(driver: FakeDriver) -> Iterator[CdiAgent]:
    with machine_lock(CDI_LOCK):
        if _foreign_specs():
            pytest.skip(f"another CDI spec of kind nvidia.com/gpu is here: {_foreign_specs()}")
        made_dir = not CDI_DIR.exists()
        base = Path(tempfile.mkdtemp(prefix="nvd-cdi-agent-"))
        try:
            with running_cdi_agent(base, driver, CDI_DIR) as agent:
                yield agent
        finally:
            SPEC.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def cdi_driver() -> Iterator[FakeDriver]:
    """The module's own fake driver root: its last test upgrades it in place."""
    driver = build_fake_driver()
    try:
        yield driver
    finally:
        remove_fake_driver(driver)


@pytest.fixture(scope="module")
def cdi_agent(cdi_driver: FakeDriver) -> Iterator[CdiAgent]:
    with _cdi_agent(cdi_driver) as agent:
        yield agent


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    with private_podman() as engine:
        yield engine


@pytest.fixture(scope="module")
def busybox(podman: Podman) -> str:
    return podman.import_busybox("nvd-cdi/busybox-cuda:12.4", LABELS)


@pytest.fixture(scope="module")
def plain(podman: Podman) -> str:
    return podman.import_busybox("nvd-cdi/plain", {"maintainer": "tests"})


@pytest.fixture(scope="module")
def debian(podman: Podman) -> str:
    """The Ansible tests' Debian 12 root (python3, glibc's ldconfig), without LD_LIBRARY_PATH."""
    return podman.import_tarball(ensure_rootfs_tarball(), "nvd-cdi/debian", LABELS)


def nodes_seen(done: subprocess.CompletedProcess[str]) -> set[str]:
    assert done.returncode == 0, done.stderr
    return seen_in(done.stdout)


def test_the_spec_is_valid_and_podman_reads_its_version(cdi_agent: CdiAgent) -> None:
    document = json.loads(SPEC.read_text())
    assert schema_errors(document) == []
    assert document["cdiVersion"] == "0.5.0"
    assert stat.S_IMODE(SPEC.stat().st_mode) == 0o644
    url = f"http://127.0.0.1:{cdi_agent.port}/cdi/spec"
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == SPEC.read_bytes()


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("nvidia.com/gpu=1", {"/dev/nvidia1"}),
        (f"nvidia.com/gpu={GPU1.uuid}", {"/dev/nvidia1"}),
        ("nvidia.com/gpu=0", {"/dev/nvidia0", *caps_of(0, 1, 2, 3)}),
        ("nvidia.com/gpu=0:1", {"/dev/nvidia0", *caps_of(1)}),
        (f"nvidia.com/gpu={MIGS[3].uuid}", {"/dev/nvidia0", *caps_of(3)}),
        ("nvidia.com/gpu=all", {"/dev/nvidia0", "/dev/nvidia1", *caps_of(0, 1, 2, 3)}),
    ],
)
def test_the_container_sees_exactly_the_selected_nodes(
    cdi_agent: CdiAgent, podman: Podman, busybox: str, device: str, expected: set[str]
) -> None:
    done = podman.run(busybox, "sh", "-c", LIST_NODES, devices=[device])
    assert nodes_seen(done) == CONTROL | expected


def test_the_nodes_keep_their_numbers(cdi_agent: CdiAgent, podman: Podman, busybox: str) -> None:
    cap = MIGS[1].capabilities[0]
    done = podman.run(
        busybox,
        "stat", "-c", "%n %t:%T", "/dev/nvidia1", "/dev/nvidiactl", cap,
        devices=["nvidia.com/gpu=1", "nvidia.com/gpu=0:1"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    minor = int(cap.rsplit("nvidia-cap", 1)[1])
    assert done.stdout.split("\n")[:3] == [
        f"/dev/nvidia1 {NVIDIA_MAJOR:x}:1",
        f"/dev/nvidiactl {NVIDIA_MAJOR:x}:ff",
        f"{cap} {CAPS_MAJOR:x}:{minor:x}",
    ]


def test_an_unknown_device_is_podmans_error(
    cdi_agent: CdiAgent, podman: Podman, busybox: str
) -> None:
    done = podman.run(busybox, "true", devices=["nvidia.com/gpu=7"])
    assert done.returncode != 0
    assert "nvidia.com/gpu=7" in done.stderr


def test_python_loads_libcuda_by_soname_without_ld_library_path(
    cdi_agent: CdiAgent, podman: Podman, debian: str, fake_driver: FakeDriver
) -> None:
    done = podman.run(debian, "python3", "-c", PROGRAM, devices=["nvidia.com/gpu=1"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"cuInit 0 driver {fake_driver.version}",
        f"/usr/local/nvidia/lib64/libcuda.so.{fake_driver.version}",
    ]
    conf = podman.run(
        debian, "cat", "/etc/ld.so.conf.d/00-nvidia-docker.conf", devices=["nvidia.com/gpu=1"]
    )
    assert conf.stdout.splitlines()[1:] == ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"]


def test_without_a_gpu_the_image_is_untouched(
    cdi_agent: CdiAgent, podman: Podman, debian: str
) -> None:
    done = podman.run(debian, "python3", "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')")
    assert done.returncode != 0
    assert "libcuda.so.1: cannot open shared object file" in done.stderr


def nvidia_docker(
    podman: Podman, agent: CdiAgent, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("nvidia-docker")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "controller.wrapper.cli"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
    environ.update(
        NV_DOCKER=" ".join(podman.command),
        NV_HOST=f"http://127.0.0.1:{agent.port}",
        PYTHONPATH=str(REPO),
        XDG_CACHE_HOME=str(podman.base / "wrapper-cache"),  # what it remembers: gone with it
        **env,
    )
    return subprocess.run(
        [*command, *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        check=False,
    )


RUN = (
    "run",
    "--rm",
    "--network",
    "none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
)


def test_nvidia_docker_with_podman_gives_a_labelled_image_its_gpus(
    cdi_agent: CdiAgent, podman: Podman, busybox: str
) -> None:
    done = nvidia_docker(podman, cdi_agent, *RUN, busybox, "sh", "-c", LIST_NODES)
    assert nodes_seen(done) == CONTROL | {"/dev/nvidia0", "/dev/nvidia1", *caps_of(0, 1, 2, 3)}
    mig = nvidia_docker(podman, cdi_agent, *RUN, busybox, "sh", "-c", LIST_NODES, NV_GPU="0:2,1")
    assert nodes_seen(mig) == CONTROL | {"/dev/nvidia0", "/dev/nvidia1", *caps_of(2)}


def test_nvidia_docker_with_podman_runs_an_unlabelled_image_unchanged(
    cdi_agent: CdiAgent, podman: Podman, plain: str
) -> None:
    done = nvidia_docker(podman, cdi_agent, *RUN, plain, "sh", "-c", LIST_NODES, NV_DEBUG="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
    assert "engine:" not in done.stderr  # the engine was not even asked


def test_nvidia_docker_with_podman_and_debian_loads_libcuda(
    cdi_agent: CdiAgent, podman: Podman, debian: str, fake_driver: FakeDriver
) -> None:
    done = nvidia_docker(podman, cdi_agent, *RUN, debian, "python3", "-c", PROGRAM, NV_GPU="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"cuInit 0 driver {fake_driver.version}"


def _rewrite(path: Path, raw: dict[str, object]) -> None:
    """The node file renamed into place, as the simulation contract says (docs/node-file.md)."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(json.dumps(raw))
    os.replace(staged, path)


def test_the_spec_follows_the_node(
    cdi_agent: CdiAgent, cdi_driver: FakeDriver, podman: Podman, busybox: str
) -> None:
    """A driver upgrade (new files installed, then the new module loaded), then GPU 1
    turning unhealthy (an XID 79 event): each time the spec is rewritten, renamed into
    place, and Podman follows it. The module's last test: it upgrades the module's driver."""
    new = build_fake_driver(version=NEW_VERSION)
    try:
        before = SPEC.stat().st_ino
        install_driver(cdi_driver, new)  # the package manager's part
        raw = json.loads(cdi_agent.node_file.read_text())
        raw["driver_version"] = NEW_VERSION  # the new kernel module is loaded
        _rewrite(cdi_agent.node_file, raw)
        wait_until(
            lambda: f"/nvidia_driver/{NEW_VERSION}" in SPEC.read_text(),
            what="the spec of the new driver",
            timeout_s=60,
        )
        assert SPEC.stat().st_ino != before
        assert schema_errors(json.loads(SPEC.read_text())) == []
        done = podman.run(busybox, "/usr/local/nvidia/bin/nvidia-smi", devices=["nvidia.com/gpu=1"])
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"nvidia-smi (fake) driver {NEW_VERSION}"  # the new volume

        raw["events"] = [{"id": "xid-on-1", "gpu": 1, "kind": "xid", "xid": 79}]
        _rewrite(cdi_agent.node_file, raw)

        def all_without_gpu1() -> bool:
            doc = json.loads(SPEC.read_text())
            (everything,) = [d for d in doc["devices"] if d["name"] == "all"]
            paths = [n["path"] for n in everything["containerEdits"]["deviceNodes"]]
            return "/dev/nvidia1" not in paths

        wait_until(all_without_gpu1, what="GPU 1 out of 'all'", timeout_s=60)
        done = podman.run(busybox, "sh", "-c", LIST_NODES, devices=["nvidia.com/gpu=all"])
        assert "/dev/nvidia1" not in nodes_seen(done)
        assert "/dev/nvidia0" in nodes_seen(done)
    finally:
        remove_fake_driver(new)
