"""A fake NVIDIA driver root for machines without a GPU, as NVIDIA's own toolkit tests do.

Small real ELF shared libraries compiled with gcc under the real file names and sonames of a
580.159.04 driver (libcuda.so.580.159.04 with soname libcuda.so.1, ...), with the real
DT_NEEDED links between them, libnvidia-tls carrying a ``.note.ABI-tag`` 2.3.99, the soname
and ``.so`` symlinks an installer makes, static ``nvidia-smi`` and ``nvidia-debugdump``
binaries on a private PATH, and a real linker cache made by ``ldconfig -C FILE -f CONF``.

Decoys the plugin must leave out are in the same cache: another vendor's ``libGL.so.1``
(needs nothing of NVIDIA's), a ``libnvidia-tls`` built for ABI 2.2.5, and a ``libcuda`` of an
older driver (470.57.02). When ``gcc -m32`` can link (no C library is needed), 32-bit
``libcuda`` and ``libnvidia-ml`` go to a ``lib32`` directory.

The fake libnvidia-ml answers ``nvmlInit_v2`` and ``nvmlSystemGetDriverVersion`` so a test can
load it with ctypes from a built volume, as the GPU test does with the real one.

``install_host_files`` adds, under a root, the files a driver installs outside its
libraries and the files of its daemons, where a real installation has them: the EGL, Vulkan
and OpenCL vendor files (one reached through Debian's alternatives links), the GSP firmware,
nvidia-persistenced's socket and the MPS pipe directory. ``build_cuda_compat`` makes a CUDA
forward compatibility directory as CUDA images carry it (``/usr/local/cuda/compat``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "580.159.04"
OLD_VERSION = "470.57.02"
NEW_VERSION = "590.48.01"  # the driver an upgrade test installs over VERSION


@dataclass(frozen=True)
class FakeLib:
    stem: str  # "libcuda"
    soname_suffix: str | None  # ".1" -> soname libcuda.so.1; None: soname is the file name
    needs: tuple[str, ...] = ()  # stems of other fake libs it links against
    code: str = ""  # extra C code

    def file_name(self, version: str = VERSION) -> str:
        return f"{self.stem}.so.{version}"

    def soname(self, version: str = VERSION) -> str:
        if self.soname_suffix is None:
            return self.file_name(version)
        return f"{self.stem}.so{self.soname_suffix}"


NVML_CODE = """
#include <string.h>
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    const char *v = "%VERSION%";
    if (length < strlen(v) + 1) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(version, v);
    return 0;
}
"""

LIBS_64: tuple[FakeLib, ...] = (
    FakeLib("libnvidia-tls", None),
    FakeLib("libnvidia-gpucomp", None),
    FakeLib("libnvidia-glsi", None),
    FakeLib("libnvidia-glcore", None, needs=("libnvidia-tls", "libnvidia-gpucomp")),
    FakeLib("libnvidia-eglcore", None, needs=("libnvidia-glsi", "libnvidia-gpucomp")),
    FakeLib("libGLX_nvidia", ".0", needs=("libnvidia-glsi", "libnvidia-tls", "libnvidia-glcore")),
    FakeLib("libEGL_nvidia", ".0", needs=("libnvidia-glsi",)),
    FakeLib("libnvidia-ptxjitcompiler", ".1"),
    FakeLib("libnvidia-nvvm", ".4"),
    FakeLib("libcuda", ".1", code="int cuInit(unsigned int flags) { return (int)flags * 0; }"),
    FakeLib("libcudadebugger", ".1"),
    FakeLib("libnvidia-ml", ".1", code=NVML_CODE),
    FakeLib("libnvidia-cfg", ".1"),
    FakeLib("libnvidia-opencl", ".1"),
    FakeLib("libnvidia-allocator", ".1"),
    FakeLib("libnvcuvid", ".1"),
    FakeLib("libnvidia-encode", ".1", needs=("libnvcuvid",)),
)
LIBS_32: tuple[FakeLib, ...] = (
    FakeLib("libcuda", ".1"),
    FakeLib("libnvidia-ml", ".1"),
)
BINARIES = ("nvidia-smi", "nvidia-debugdump")

ABI_NOTE_ASM = """\t.section .note.ABI-tag,"a",@note
\t.balign 4
\t.long 4
\t.long 16
\t.long 1
\t.asciz "GNU"
\t.long 0
\t.long {major}
\t.long {minor}
\t.long {tiny}
"""


@dataclass
class FakeDriver:
    root: Path
    version: str
    lib64: Path  # the driver's 64-bit library directory
    lib32: Path | None  # the 32-bit one, when gcc -m32 works here
    bin: Path  # the directory of the fake binaries
    ldcache: Path  # made by ldconfig -C
    decoys: Path  # libraries the plugin must leave out
    libs_64: tuple[FakeLib, ...] = LIBS_64
    libs_32: tuple[FakeLib, ...] = ()
    binaries: tuple[str, ...] = BINARIES
    sizes_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def search_path(self) -> str:
        """A PATH with the fake binaries first, then the system's (for the agent)."""
        return f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"

    def expected_lib64(self) -> set[str]:
        """Names under lib64/ of a good volume: files, soname links, the two extra links."""
        names = {lib.file_name(self.version) for lib in self.libs_64}
        names |= {lib.soname(self.version) for lib in self.libs_64}
        return names | {"libcuda.so", "libGLX_indirect.so.0"}


def _run(*args: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


def gcc_m32_works(workdir: Path) -> bool:
    """Whether gcc can make a 32-bit shared object here (no 32-bit C library needed)."""
    source = workdir / "probe32.c"
    source.write_text("int probe(void) { return 32; }\n")
    proc = subprocess.run(
        ["gcc", "-m32", "-shared", "-nostdlib", "-fPIC", "-o", str(workdir / "probe32.so"), source],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def _compile_lib(
    lib: FakeLib,
    directory: Path,
    workdir: Path,
    *,
    version: str,
    bits: int = 64,
    abi: tuple[int, int, int] | None = None,
    needed: tuple[Path, ...] = (),
    pad_bytes: int = 0,
) -> Path:
    tag = f"{lib.stem}-{bits}-{version}-{abi}"
    source = workdir / f"{tag}.c"
    symbol = lib.stem.replace("-", "_")
    code = lib.code.replace("%VERSION%", version) if bits == 64 else ""
    source.write_text(f"{code}\nint {symbol}_fake_{bits}(void) {{ return {bits}; }}\n")
    out = directory / lib.file_name(version)
    args = ["gcc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{lib.soname(version)}"]
    if bits == 32:
        args += ["-m32", "-nostdlib"]
    args += ["-o", str(out), str(source)]
    if abi is not None:
        note = workdir / f"{tag}-abi.s"
        note.write_text(ABI_NOTE_ASM.format(major=abi[0], minor=abi[1], tiny=abi[2]))
        args.append(str(note))
    if needed:
        args += ["-Wl,--no-as-needed", *map(str, needed)]
    _run(*args)
    if pad_bytes:
        with out.open("ab") as stream:  # trailing bytes leave a valid ELF file
            stream.write(os.urandom(pad_bytes))
    _install_links(out, lib.soname(version))
    return out


def _install_links(real: Path, soname: str) -> None:
    """What the driver installer makes: soname link and the unversioned .so link."""
    stem = real.name.partition(".so")[0]
    if soname != real.name:
        (real.parent / soname).symlink_to(real.name)
        (real.parent / f"{stem}.so").symlink_to(soname)
    else:
        (real.parent / f"{stem}.so").symlink_to(real.name)


def _compile_binary(name: str, directory: Path, workdir: Path, version: str) -> Path:
    source = workdir / f"{name}.c"
    source.write_text(
        "#include <stdio.h>\n"
        f'int main(void) {{ puts("{name} (fake) driver {version}"); return 0; }}\n'
    )
    out = directory / name
    _run("gcc", "-static", "-O1", "-o", str(out), str(source))
    return out


def build_fake_driver(
    base: Path | None = None, *, version: str = VERSION, pad_bytes: int = 0
) -> FakeDriver:
    """Build the whole fake root under a new directory; ``pad_bytes`` grows every library."""
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        raise RuntimeError("the fake driver needs gcc and ldconfig: apt-get install gcc libc6-dev")
    root = Path(tempfile.mkdtemp(prefix="nvd-fake-driver-", dir=base))
    work = root / "build"
    lib64 = root / "usr/lib/x86_64-linux-gnu/nvidia"
    bin_dir = root / "usr/bin"
    decoys = root / "opt/decoys"
    for directory in (work, lib64, bin_dir, decoys / "mesa", decoys / "tls", decoys / "old"):
        directory.mkdir(parents=True)

    built: dict[str, Path] = {}
    for lib in LIBS_64:
        built[lib.stem] = _compile_lib(
            lib,
            lib64,
            work,
            version=version,
            abi=(2, 3, 99) if lib.stem == "libnvidia-tls" else None,
            needed=tuple(built[stem] for stem in lib.needs),
            pad_bytes=pad_bytes,
        )
    lib32: Path | None = None
    libs_32: tuple[FakeLib, ...] = ()
    if gcc_m32_works(work):
        lib32 = root / "usr/lib/i386-linux-gnu/nvidia"
        lib32.mkdir(parents=True)
        for lib in LIBS_32:
            _compile_lib(lib, lib32, work, version=version, bits=32)
        libs_32 = LIBS_32
    for name in BINARIES:
        _compile_binary(name, bin_dir, work, version)

    # Decoys: Mesa's libGL (needs only libc), a TLS library of the old ABI, an old libcuda.
    _compile_lib(FakeLib("libGL", ".1"), decoys / "mesa", work, version="1.7.0")
    _compile_lib(
        FakeLib("libnvidia-tls", None), decoys / "tls", work, version=version, abi=(2, 2, 5)
    )
    _compile_lib(FakeLib("libcuda", ".1"), decoys / "old", work, version=OLD_VERSION)

    dirs = [decoys / "tls", lib64, *([lib32] if lib32 else []), decoys / "mesa", decoys / "old"]
    conf = root / "etc/ld.so.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("".join(f"{d}\n" for d in dirs))
    ldcache = root / "etc/ld.so.cache"
    _run("ldconfig", "-X", "-C", str(ldcache), "-f", str(conf))
    shutil.rmtree(work)
    sizes = {p.name: p.stat().st_size for p in lib64.iterdir() if not p.is_symlink()}
    return FakeDriver(
        root=root,
        version=version,
        lib64=lib64,
        lib32=lib32,
        bin=bin_dir,
        ldcache=ldcache,
        decoys=decoys,
        libs_32=libs_32,
        sizes_bytes=sizes,
    )


def install_driver(target: FakeDriver, new: FakeDriver) -> None:
    """Upgrade ``target``'s root in place to ``new``'s driver, as a package upgrade does.

    The new binaries replace the old ones on the same PATH and the linker cache is replaced
    by one that names the new libraries, each renamed into place (``ldconfig`` writes its
    cache that way), so a reader sees the old cache or the new one, never half of one.
    """
    for name in target.binaries:
        staged = target.bin / f".{name}.new"
        shutil.copy2(new.bin / name, staged)
        os.replace(staged, target.bin / name)
    staged = target.ldcache.with_name(f".{target.ldcache.name}.new")
    shutil.copy2(new.ldcache, staged)
    os.replace(staged, target.ldcache)


def remove_fake_driver(driver: FakeDriver) -> None:
    shutil.rmtree(driver.root, ignore_errors=True)


# The vendor files a driver installs: path under the root -> content. The EGL one is reached
# through links as Debian's alternatives make them (absolute targets, inside the root).
VENDOR_FILES = {
    "usr/share/nvidia/10_nvidia.json": (
        '{"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}\n'
    ),
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": (
        '{"file_format_version": "1.0.0", "ICD": {"library_path": "libnvidia-egl-gbm.so.1"}}\n'
    ),
    "usr/share/vulkan/icd.d/nvidia_icd.json": (
        '{"file_format_version": "1.0.1", "ICD": {"library_path": "libGLX_nvidia.so.0", '
        '"api_version": "1.4.312"}}\n'
    ),
    "etc/OpenCL/vendors/nvidia.icd": "libnvidia-opencl.so.1\n",
}
VENDOR_LINKS = {  # link under the root -> its target (as the host's root sees it)
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json": "/etc/alternatives/nvidia--10_nvidia.json",
    "etc/alternatives/nvidia--10_nvidia.json": "/usr/share/nvidia/10_nvidia.json",
}
GSP_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
PERSISTENCED_SOCKET = "run/nvidia-persistenced/socket"
MPS_PIPE_DIR = "tmp/nvidia-mps"


def install_host_files(root: Path, version: str = VERSION) -> None:
    """The driver's files outside its libraries, under ``root`` (see the module docstring);
    the fabric manager's socket is left out: this fake node has no NVSwitch."""
    for name, text in VENDOR_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for name, target in VENDOR_LINKS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    firmware = root / "lib/firmware/nvidia" / version
    firmware.mkdir(parents=True)
    for name in GSP_FIRMWARE:
        (firmware / name).write_bytes(f"GSP firmware {name} of {version}\n".encode())
    (root / PERSISTENCED_SOCKET).parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(root / PERSISTENCED_SOCKET))  # the file stays after the close
    (root / MPS_PIPE_DIR).mkdir(parents=True)
    (root / MPS_PIPE_DIR / "log").write_text("MPS pipes\n")


def build_cuda_compat(directory: Path, version: str) -> Path:
    """A CUDA forward compatibility directory: ``libcuda.so.<version>`` (soname libcuda.so.1,
    a real ELF library with ``cuInit``) and its links, in ``directory`` (made)."""
    directory.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="nvd-compat-build-") as work:
        lib = FakeLib("libcuda", ".1", code="int cuInit(unsigned int flags) { return 0; }")
        _compile_lib(lib, directory, Path(work), version=version)
    return directory
