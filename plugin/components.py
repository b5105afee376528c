"""The files of an NVIDIA driver that go into the ``nvidia_driver`` volume, as data.

Current for the 5xx drivers (checked against a 580.159.04 data-center driver, whose files are
listed in ``tests/fixtures/h200/driver-files.txt``). Libraries are named without ``.so``: an entry
matches every cache name ``<name>.so[.<anything>]``.

Changes since the 2017 list of nvidia-docker 1.0:
- added: libcudadebugger (R525), libnvidia-nvvm (R525), libnvidia-allocator (R470),
  libnvidia-gpucomp (R545), libnvidia-pkcs11 / -pkcs11-openssl3 (R535), libnvidia-api (R525),
  libnvidia-ngx (R470), libnvidia-glvkspirv, libnvidia-rtcore + libnvoptix (R4xx), the
  EGL platform libraries (egl-wayland, egl-gbm, egl-xcb, egl-xlib), libnvidia-sandboxutils;
- dropped: libnvidia-fatbinaryloader (gone since R450), libnvidia-compiler (OpenCL compiler,
  folded into libnvidia-opencl), libnvidia-ifr (gone since R495), libnvidia-wfb (X server
  module, never a client library).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    COMPUTE = "compute"
    VIDEO = "video"
    GRAPHICS = "graphics"
    UTILITY = "utility"


class Check(enum.Enum):
    """An extra test, read from the ELF file, before a library goes into the volume."""

    NONE = "none"
    NVIDIA_GL_VENDOR = "nvidia-gl-vendor"  # needs libnvidia-glcore/-eglcore or libGLdispatch
    TLS_ABI_2_3_99 = "tls-abi-2.3.99"  # .note.ABI-tag must be 2.3.99


@dataclass(frozen=True, slots=True)
class Binary:
    name: str
    role: Role
    what: str  # one line: what it is for


@dataclass(frozen=True, slots=True)
class Library:
    name: str  # file name up to ".so"
    role: Role
    what: str  # one line: what it is for
    check: Check = Check.NONE
    # True: the real file is "<name>.so.<driver version>" and must match the running driver.
    # False: the library has its own version (GLVND, EGL platform libraries).
    driver_versioned: bool = True


BINARIES: tuple[Binary, ...] = (
    Binary("nvidia-cuda-mps-control", Role.COMPUTE, "MPS control daemon and its CLI"),
    Binary("nvidia-cuda-mps-server", Role.COMPUTE, "MPS server, started by mps-control"),
    Binary("nvidia-debugdump", Role.UTILITY, "GPU state dump for bug reports"),
    Binary("nvidia-persistenced", Role.COMPUTE, "keeps the driver loaded between jobs"),
    Binary("nvidia-smi", Role.UTILITY, "System Management Interface (NVML command line)"),
)

LIBRARIES: tuple[Library, ...] = (
    # --- compute ---
    Library("libcuda", Role.COMPUTE, "CUDA driver API (libcuda.so.1)"),
    Library("libcudadebugger", Role.COMPUTE, "CUDA debugger back end used by cuda-gdb (R525+)"),
    Library("libnvidia-ptxjitcompiler", Role.COMPUTE, "PTX JIT compiler used by libcuda"),
    Library("libnvidia-nvvm", Role.COMPUTE, "NVVM compiler for JIT link-time optimisation"),
    Library("libnvidia-gpucomp", Role.COMPUTE, "GPU code generator shared by CUDA and GL (R545+)"),
    Library("libnvidia-ml", Role.UTILITY, "NVML, the management library (nvidia-smi, DCGM)"),
    Library("libnvidia-cfg", Role.UTILITY, "GPU configuration queries (nvidia-xconfig, NVML)"),
    Library("libnvidia-opencl", Role.COMPUTE, "OpenCL ICD of the driver (with its compiler)"),
    Library("libnvidia-allocator", Role.COMPUTE, "buffer allocator behind GBM and EGLStreams"),
    Library("libnvidia-pkcs11", Role.COMPUTE, "PKCS#11 for confidential computing (R535+)"),
    Library("libnvidia-pkcs11-openssl3", Role.COMPUTE, "the same, built against OpenSSL 3"),
    Library("libnvidia-api", Role.UTILITY, "NVAPI for Linux (R525+)"),
    Library("libnvidia-sandboxutils", Role.UTILITY, "helpers for sandboxed GPU use (R550+)"),
    # --- video ---
    Library("libnvcuvid", Role.VIDEO, "NVDEC video decoding (CUVID)"),
    Library("libnvidia-encode", Role.VIDEO, "NVENC video encoding"),
    Library("libnvidia-opticalflow", Role.VIDEO, "optical flow engine (NVOFA)"),
    Library("libvdpau_nvidia", Role.VIDEO, "VDPAU driver"),
    # --- graphics ---
    Library("libnvidia-eglcore", Role.GRAPHICS, "EGL core of the driver"),
    Library("libnvidia-glcore", Role.GRAPHICS, "OpenGL core of the driver"),
    Library(
        "libnvidia-tls",
        Role.GRAPHICS,
        "thread-local storage for GL; only the 2.3.99 ABI build",
        check=Check.TLS_ABI_2_3_99,
    ),
    Library("libnvidia-glsi", Role.GRAPHICS, "window-system interface of GL and EGL"),
    Library("libnvidia-fbc", Role.GRAPHICS, "NvFBC frame buffer capture"),
    Library("libnvidia-rtcore", Role.GRAPHICS, "ray tracing core (OptiX, Vulkan RT)"),
    Library("libnvoptix", Role.GRAPHICS, "OptiX ray tracing"),
    Library("libnvidia-glvkspirv", Role.GRAPHICS, "SPIR-V compiler for GL and Vulkan"),
    Library("libnvidia-ngx", Role.GRAPHICS, "NGX (DLSS) runtime (R470+)"),
    Library("libGLX_nvidia", Role.GRAPHICS, "GLX vendor library loaded by GLVND"),
    Library("libEGL_nvidia", Role.GRAPHICS, "EGL vendor library loaded by GLVND"),
    Library("libGLESv2_nvidia", Role.GRAPHICS, "OpenGL ES 2/3 vendor library"),
    Library("libGLESv1_CM_nvidia", Role.GRAPHICS, "OpenGL ES 1 vendor library"),
    Library(
        "libnvidia-egl-wayland",
        Role.GRAPHICS,
        "EGL external platform for Wayland (own version)",
        driver_versioned=False,
    ),
    Library(
        "libnvidia-egl-gbm",
        Role.GRAPHICS,
        "EGL external platform for GBM (own version)",
        driver_versioned=False,
    ),
    Library(
        "libnvidia-egl-xcb",
        Role.GRAPHICS,
        "EGL external platform for XCB (R560+, own version)",
        driver_versioned=False,
    ),
    Library(
        "libnvidia-egl-xlib",
        Role.GRAPHICS,
        "EGL external platform for Xlib (R560+, own version)",
        driver_versioned=False,
    ),
    # GL entry points: NVIDIA's own only on old non-GLVND installs; otherwise GLVND's, which
    # dispatch to NVIDIA through libGLdispatch. Mesa's builds (another vendor) are skipped.
    Library(
        "libGL",
        Role.GRAPHICS,
        "OpenGL + GLX entry point (GLVND or legacy)",
        check=Check.NVIDIA_GL_VENDOR,
        driver_versioned=False,
    ),
    Library(
        "libEGL",
        Role.GRAPHICS,
        "EGL entry point (GLVND or legacy)",
        check=Check.NVIDIA_GL_VENDOR,
        driver_versioned=False,
    ),
    Library(
        "libGLESv1_CM",
        Role.GRAPHICS,
        "OpenGL ES 1 entry point (GLVND or legacy)",
        check=Check.NVIDIA_GL_VENDOR,
        driver_versioned=False,
    ),
    Library(
        "libGLESv2",
        Role.GRAPHICS,
        "OpenGL ES 2/3 entry point (GLVND or legacy)",
        check=Check.NVIDIA_GL_VENDOR,
        driver_versioned=False,
    ),
    Library("libOpenGL", Role.GRAPHICS, "GLVND OpenGL entry point", driver_versioned=False),
    Library("libGLX", Role.GRAPHICS, "GLVND GLX dispatcher", driver_versioned=False),
    Library("libGLdispatch", Role.GRAPHICS, "GLVND dispatch core", driver_versioned=False),
)

_BY_NAME = {library.name: library for library in LIBRARIES}

GL_VENDOR_MARKERS = ("libnvidia-glcore.so", "libnvidia-eglcore.so", "libGLdispatch.so")
TLS_ABI = (2, 3, 99)


def library_of(cache_name: str) -> Library | None:
    """The component a cache name (``libcuda.so.1``) belongs to, or ``None``."""
    stem, sep, _ = cache_name.partition(".so")
    if not sep:
        return None
    return _BY_NAME.get(stem)
