"""The simulated MIG node of the CDI end-to-end tests, and its device nodes made with mknod.

``h200x2-mig``: GPU 0 in MIG mode with four MIG devices, GPU 1 whole. ``make_dev_root``
makes its device nodes, with the real NVIDIA numbering, in a private directory that the
agent's ``--cdi-dev-root`` names, so that nothing machine-wide is made under ``/dev``;
nothing opens them (the majors need not be the driver's).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.gpu import nodefile

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
