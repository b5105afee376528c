"""The simulated MIG node of the CDI end-to-end tests, and its device nodes made with mknod.

``h200x2-mig``: GPU 0 in MIG mode with four MIG devices, GPU 1 whole. ``make_dev_root``
makes its device nodes, with the real NVIDIA numbering, in a private directory that the
agent's ``--cdi-dev-root`` names, so that nothing machine-wide is made under ``/dev``;
nothing opens them (the majors need not be the driver's). With ``host_files`` the root also
gets what a display-capable node has: ``/dev/nvidia-modeset``, each GPU's DRM card and render
nodes with the sysfs directory that names them (``/sys/bus/pci/devices/<bus id>/drm/``),
and the driver's host files of ``tests.support.fake_driver.install_host_files``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.gpu import nodefile
from tests.support.fake_driver import FakeDriver, install_host_files
from tests.support.podman import CDI_LOCK
from tests.support.prerequisites import unavailable
from tests.support.services import free_port, machine_lock, port_open, stop_process, wait_until

REPO = Path(__file__).resolve().parents[2]
SPEC_NAME = "nvidia-docker.json"  # the agent's spec file in --cdi-spec-dir
CDI_DIR = Path("/var/run/cdi")  # where Podman 4.3 reads specs (and /etc/cdi), machine-wide
SCANNED = (Path("/etc/cdi"), CDI_DIR)

NODE = "h200x2-mig"
INFO = nodefile.load(NODE).info
GPU0, GPU1 = INFO.devices
MIGS = GPU0.mig_devices
NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR = 195, 510, 509  # any free majors do for nodes never opened
DRM_MAJOR = 226
CONTROL = {"/dev/nvidiactl", "/dev/nvidia-uvm"}
MODESET = "/dev/nvidia-modeset"
# Each GPU's DRM nodes (card 0 is a display adapter of another vendor, as on many servers)
DRM = {0: ("card1", "renderD128"), 1: ("card2", "renderD129")}
LIST_NODES = "find /dev -name 'nvidia*' \\( -type c -o -type d \\) | sort"
LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}


def sysfs_address(bus_id: str) -> str:
    """``00000000:00:06.0`` (NVML) as sysfs names the device: ``0000:00:06.0``."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def make_dev_root(root: Path, *, host_files: bool = False) -> None:
    """The device nodes of the node, with the real NVIDIA numbering, under ``root/dev``;
    with ``host_files``, also the display nodes and the driver's host files (above)."""
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    nodes = {"nvidiactl": (NVIDIA_MAJOR, 255), "nvidia-uvm": (UVM_MAJOR, 0)}
    nodes |= {f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(len(INFO.devices))}
    for mig in MIGS:
        for cap in mig.capabilities:
            minor = int(cap.rsplit("nvidia-cap", 1)[1])
            nodes[cap.removeprefix("/dev/")] = (CAPS_MAJOR, minor)
    if host_files:
        (dev / "dri").mkdir()
        nodes["nvidia-modeset"] = (NVIDIA_MAJOR, 254)
        nodes["dri/card0"] = (DRM_MAJOR, 0)  # not an NVIDIA GPU: in no device of the spec
        for index, names in DRM.items():
            pci = root / "sys/bus/pci/devices" / sysfs_address(str(INFO.devices[index].pci.bus_id))
            for name in names:
                (pci / "drm" / name).mkdir(parents=True)
                minor = int(name.removeprefix("card").removeprefix("renderD"))
                nodes[f"dri/{name}"] = (DRM_MAJOR, minor)
        install_host_files(root, INFO.driver_version)
    for name, (major, minor) in nodes.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def caps_of(*indices: int) -> set[str]:
    """The capability nodes of these MIG devices (by MIG index on GPU 0)."""
    return {cap for i in indices for cap in MIGS[i].capabilities}


def nodes_seen(stdout: str) -> set[str]:
    """What ``LIST_NODES`` printed, the caps directory left out."""
    return {line for line in stdout.split() if line != "/dev/nvidia-caps"}


# The program a Debian image without LD_LIBRARY_PATH runs: the driver's libraries by soname.
PROGRAM = """
import ctypes, os
assert "LD_LIBRARY_PATH" not in os.environ, os.environ["LD_LIBRARY_PATH"]
cuda = ctypes.CDLL("libcuda.so.1")
nvml = ctypes.CDLL("libnvidia-ml.so.1")
version = ctypes.create_string_buffer(96)
assert nvml.nvmlInit_v2() == 0
assert nvml.nvmlSystemGetDriverVersion(version, 96) == 0
print("cuInit", cuda.cuInit(0), "driver", version.value.decode())
for line in open("/proc/self/maps"):
    if "libcuda.so" in line:
        print(line.split()[-1])
        break
"""


@dataclass
class CdiAgent:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    node_file: Path  # the simulated node, which a test may rewrite (docs/node-file.md)


@contextlib.contextmanager
def running_cdi_agent(
    base: Path,
    driver: FakeDriver,
    spec_dir: Path,
    *,
    host_files: bool = False,
    extra_args: tuple[str, ...] = (),
    expect_spec: bool = True,
    port: int | None = None,
) -> Iterator[CdiAgent]:
    """A real agent serving ``NODE`` against the fake driver root, writing its CDI spec into
    ``spec_dir`` with the device nodes of ``make_dev_root`` (made under ``base``, with the
    host files when asked), with ``extra_args``; stopped at the end. It is ready when it
    serves (on ``port``, default a free one) and, with ``expect_spec``, its spec is there
    (without: the agent may step aside for another spec at start, docs/cdi.md)."""
    make_dev_root(base / "devroot", host_files=host_files)
    node_file = base / "node.json"
    node_file.write_text(nodefile.resolve(NODE).read_text())
    port = free_port() if port is None else port
    log = base / "agent.log"
    env = {**os.environ, "PATH": driver.search_path, "PYTHONPATH": str(REPO)}
    env.pop("NV_DEBUG", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon",
                "-l", f"127.0.0.1:{port}", "-s", str(base / "plugins"), "-d", str(base / "vol"),
                "--simulate", str(node_file), "--ldcache", str(driver.ldcache),
                "--cdi-spec-dir", str(spec_dir), "--cdi-dev-root", str(base / "devroot"),
                *extra_args,
            ],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_until(
            lambda: port_open(port) and (not expect_spec or (spec_dir / SPEC_NAME).exists()),
            what=f"agent and its CDI spec (log: {log})",
            timeout_s=60,
            proc=proc,
        )
        yield CdiAgent(port, proc, log, node_file)
    finally:
        stop_process(proc)


def foreign_specs() -> list[str]:
    """Specs of kind nvidia.com/gpu on this machine that are not a test agent's: engines
    would see two devices "0" (and the agent would step aside for them)."""
    found = []
    for directory in SCANNED:
        for path in sorted(directory.glob("*")) if directory.is_dir() else ():
            if path.name == SPEC_NAME or path.suffix not in (".json", ".yaml"):
                continue
            if "nvidia.com/gpu" in path.read_text(errors="replace"):
                found.append(str(path))
    return found


@contextlib.contextmanager
def machine_cdi_agent(
    driver: FakeDriver,
    *,
    host_files: bool = False,
    extra_args: tuple[str, ...] = (),
    expect_spec: bool = True,
    beside: Callable[[Path], Mapping[str, str]] | None = None,
) -> Iterator[CdiAgent]:
    """``running_cdi_agent`` writing into ``/var/run/cdi`` (the directory Podman reads), under
    the machine's CDI lock. ``beside``, given the dev root the agent will have, returns other
    specs (file name -> text) to put into that directory before the agent starts. At the end
    the agent's spec, those files, and the directory when this made it, are removed. A machine
    with another spec of kind nvidia.com/gpu cannot run it."""
    with machine_lock(CDI_LOCK):
        if foreign_specs():
            unavailable(f"another CDI spec of kind nvidia.com/gpu is here: {foreign_specs()}")
        made_dir = not CDI_DIR.exists()
        base = Path(tempfile.mkdtemp(prefix="nvd-cdi-agent-"))
        others = beside(base / "devroot") if beside is not None else {}
        try:
            CDI_DIR.mkdir(parents=True, exist_ok=True)
            for name, text in others.items():
                place_spec(CDI_DIR / name, text)
            with running_cdi_agent(
                base,
                driver,
                CDI_DIR,
                host_files=host_files,
                extra_args=extra_args,
                expect_spec=expect_spec,
            ) as agent:
                yield agent
        finally:
            for name in (SPEC_NAME, *others):
                (CDI_DIR / name).unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()
            shutil.rmtree(base, ignore_errors=True)


def place_spec(path: Path, text: str) -> None:
    """Write a spec file as producers do: a temporary name beside it, renamed into place."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    os.replace(staged, path)
