"""What a GPU container gets from the host besides the driver volume: the table.

The same files NVIDIA's container toolkit puts in its spec (``nvidia-ctk cdi generate``),
looked up where it looks for them; only what is found on the host goes into the spec
(``agent.cdi_spec.host_files`` looks, ``cdi.spec`` writes the mounts). docs/cdi.md, "What a
container gets", explains each entry:

- the driver's programs (``PROGRAMS``): from the driver volume's ``bin/``, at
  ``/usr/bin/<name>``, on every image's PATH;
- vendor files (``VENDOR_FILES``): the first of ``CONFIG_DIRS`` that has one, at
  ``<container_dir>/<name>``;
- IPC sockets (``IPC_SOCKETS``) under ``/run`` or ``/var/run``, and the MPS pipe directory,
  where found;
- GSP firmware: ``nvidia/<driver version>/gsp*.bin`` in the kernel's firmware directories
  (``firmware_dirs``), where found.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PROGRAM_DIR = "/usr/bin"  # on the PATH of every image, as the toolkit mounts the programs
PROGRAMS = (
    "nvidia-smi",  # the System Management Interface
    "nvidia-debugdump",  # GPU state dump for bug reports
    "nvidia-persistenced",  # keeps the driver loaded
    "nvidia-cuda-mps-control",  # the MPS control daemon and its command line
    "nvidia-cuda-mps-server",  # the MPS server that mps-control starts
)


@dataclass(frozen=True, slots=True)
class VendorFile:
    name: str  # relative to a configuration directory: "glvnd/egl_vendor.d/10_nvidia.json"
    container_dir: str  # where the container has it: "/usr/share" or "/etc"


CONFIG_DIRS = ("/etc", "/usr/local/share", "/usr/share")  # searched in this order
VENDOR_FILES = (
    # EGL and its external platforms (GBM, Wayland, X11): GLVND finds NVIDIA's EGL here
    VendorFile("glvnd/egl_vendor.d/10_nvidia.json", "/usr/share"),
    VendorFile("egl/egl_external_platform.d/15_nvidia_gbm.json", "/usr/share"),
    VendorFile("egl/egl_external_platform.d/10_nvidia_wayland.json", "/usr/share"),
    VendorFile("egl/egl_external_platform.d/09_nvidia_wayland2.json", "/usr/share"),
    VendorFile("egl/egl_external_platform.d/20_nvidia_xcb.json", "/usr/share"),
    VendorFile("egl/egl_external_platform.d/20_nvidia_xlib.json", "/usr/share"),
    VendorFile("nvidia/nvoptix.bin", "/usr/share"),  # OptiX's shader library
    VendorFile("X11/xorg.conf.d/10-nvidia.conf", "/usr/share"),
    VendorFile("X11/xorg.conf.d/nvidia-drm-outputclass.conf", "/usr/share"),
    # OpenCL's ICD loader reads /etc/OpenCL/vendors, Vulkan's loader /etc/vulkan too
    VendorFile("OpenCL/vendors/nvidia.icd", "/etc"),
    VendorFile("vulkan/icd.d/nvidia_icd.json", "/etc"),
    VendorFile("vulkan/icd.d/nvidia_icd.x86_64.json", "/etc"),
    VendorFile("vulkan/icd.d/nvidia_icd.aarch64.json", "/etc"),
    VendorFile("vulkan/icd.d/nvidia_layers.json", "/etc"),
    VendorFile("vulkan/implicit_layer.d/nvidia_layers.json", "/etc"),
)

RUN_DIRS = ("/run", "/var/run")
IPC_SOCKETS = (
    "nvidia-persistenced/socket",  # nvidia-persistenced: the driver stays loaded
    "nvidia-fabricmanager/socket",  # the fabric manager of NVSwitch systems
)
MPS_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA_MPS_PIPE_DIRECTORY's default


def firmware_dirs(kernel_release: str, custom: str | None = None) -> tuple[str, ...]:
    """The directories the kernel loads firmware from, in its order: the
    ``firmware_class.path`` parameter when set, then the standard four."""
    standard = (
        f"/lib/firmware/updates/{kernel_release}",
        "/lib/firmware/updates",
        f"/lib/firmware/{kernel_release}",
        "/lib/firmware",
    )
    return ((custom,) if custom else ()) + standard


def gsp_firmware_dir(firmware_dir: str, driver_version: str) -> str:
    """Where a firmware directory holds the GSP firmware (``gsp*.bin``) of a driver."""
    return f"{firmware_dir.rstrip('/')}/nvidia/{driver_version}"


def is_gsp_firmware(name: str) -> bool:
    return name.startswith("gsp") and name.endswith(".bin")


class Access(enum.Enum):
    """How the container may use a host file: read it (files, programs) or talk through it
    (IPC sockets and the MPS pipe directory, which need writing)."""

    READ = ("ro", "nosuid", "nodev", "bind")
    TALK = ("nosuid", "nodev", "noexec", "bind")


@dataclass(frozen=True, slots=True)
class HostMount:
    host_path: str
    container_path: str
    access: Access = Access.READ
