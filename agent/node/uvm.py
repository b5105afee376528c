"""The CUDA unified memory device (``/dev/nvidia-uvm``) must exist before containers start.

The kernel creates it only when the ``nvidia-uvm`` module is loaded; ``nvidia-modprobe -u
-c=0`` loads it and makes the device node. If the node is already there, nothing runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess

UVM_DEVICE = "/dev/nvidia-uvm"
CONTROL_DEVICE = "/dev/nvidiactl"  # present whenever the NVIDIA kernel module is loaded


class UvmError(RuntimeError):
    pass


def ensure_uvm_device(device: str = UVM_DEVICE, control_device: str = CONTROL_DEVICE) -> str:
    """Make sure the UVM device exists; returns what was done, for the log."""
    if os.path.exists(device):
        return f"{device} present"
    modprobe = shutil.which("nvidia-modprobe")
    if modprobe is None and not os.path.exists(control_device):
        raise UvmError(
            f"NVIDIA driver not found ({device} and {control_device} are missing, nvidia-modprobe "
            "is not installed): install the NVIDIA driver, or try the agent on a simulated node: "
            "--simulate h200 (built in: h200, h200x2, hgx-h200-8, h200x2-mig) or --simulate FILE"
        )
    if modprobe is None:
        raise UvmError(
            f"{device} is missing and nvidia-modprobe is not installed: install it "
            "(it comes with the NVIDIA driver) or run `nvidia-modprobe -u -c=0` as root"
        )
    try:
        result = subprocess.run(
            [modprobe, "-u", "-c=0"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UvmError(f"{device} is missing and `nvidia-modprobe -u -c=0` failed: {err}") from None
    if result.returncode != 0 or not os.path.exists(device):
        detail = result.stderr.strip() or f"exit code {result.returncode}"
        raise UvmError(
            f"{device} is missing and `nvidia-modprobe -u -c=0` could not create it ({detail}): "
            "run it as root, or load the nvidia-uvm kernel module"
        )
    return f"{device} created by nvidia-modprobe"
