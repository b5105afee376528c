"""The simulated MIG node of the CDI end-to-end tests, and its device nodes made with mknod.

``h200x2-mig``: GPU 0 in MIG mode with four MIG devices, GPU 1 whole. ``make_dev_root``
makes its device nodes, with the real NVIDIA numbering, in a private directory that the
agent's ``--cdi-dev-root`` names, so that nothing machine-wide is made under ``/dev``;
nothing opens them (the majors need not be the driver's).
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.gpu import nodefile
from tests.support.fake_driver import FakeDriver
from tests.support.services import free_port, port_open, stop_process, wait_until

REPO = Path(__file__).resolve().parents[2]
SPEC_NAME = "nvidia-docker.json"  # the agent's spec file in --cdi-spec-dir

NODE = "h200x2-mig"
INFO = nodefile.load(NODE).info
GPU0, GPU1 = INFO.devices
MIGS = GPU0.mig_devices
NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR = 195, 510, 509  # any free majors do for nodes never opened
CONTROL = {"/dev/nvidiactl", "/dev/nvidia-uvm"}
LIST_NODES = "find /dev -name 'nvidia*' \\( -type c -o -type d \\) | sort"
LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}


def make_dev_root(root: Path) -> None:
    """The device nodes of the node, with the real NVIDIA numbering, under ``root/dev``."""
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    nodes = {"nvidiactl": (NVIDIA_MAJOR, 255), "nvidia-uvm": (UVM_MAJOR, 0)}
    nodes |= {f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(len(INFO.devices))}
    for mig in MIGS:
        for cap in mig.capabilities:
            minor = int(cap.rsplit("nvidia-cap", 1)[1])
            nodes[cap.removeprefix("/dev/")] = (CAPS_MAJOR, minor)
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
def running_cdi_agent(base: Path, driver: FakeDriver, spec_dir: Path) -> Iterator[CdiAgent]:
    """A real agent serving ``NODE`` against the fake driver root, writing its CDI spec into
    ``spec_dir`` with the device nodes of ``make_dev_root`` (made under ``base``); stopped
    at the end."""
    make_dev_root(base / "devroot")
    node_file = base / "node.json"
    node_file.write_text(nodefile.resolve(NODE).read_text())
    port = free_port()
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
            ],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_until(
            lambda: port_open(port) and (spec_dir / SPEC_NAME).exists(),
            what=f"agent and its CDI spec (log: {log})",
            timeout_s=60,
            proc=proc,
        )
        yield CdiAgent(port, proc, log, node_file)
    finally:
        stop_process(proc)
