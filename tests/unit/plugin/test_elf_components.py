"""ELF facts read with pyelftools, and the component list against a real 580 driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.components import BINARIES, LIBRARIES, Check, library_of
from plugin.elf import ElfReadError, read_elf
from tests.support.fake_driver import FakeDriver
from tests.support.prerequisites import unavailable
from tests.unit.plugin.conftest import FIXTURES


def test_soname_needed_and_abi_tag(fake_driver: FakeDriver) -> None:
    glx = read_elf(fake_driver.lib64 / "libGLX_nvidia.so.580.159.04")
    assert (glx.word_size, glx.machine, glx.soname) == (64, "EM_X86_64", "libGLX_nvidia.so.0")
    assert glx.needed[:3] == (
        "libnvidia-glsi.so.580.159.04",
        "libnvidia-tls.so.580.159.04",
        "libnvidia-glcore.so.580.159.04",
    )
    assert glx.abi_tag is None
    assert read_elf(fake_driver.lib64 / "libnvidia-tls.so.580.159.04").abi_tag == (2, 3, 99)
    assert read_elf(fake_driver.decoys / "tls/libnvidia-tls.so.580.159.04").abi_tag == (2, 2, 5)


def test_a_32_bit_library(fake_driver: FakeDriver) -> None:
    if fake_driver.lib32 is None:
        unavailable("gcc -m32 cannot link here (gcc, binutils with 32-bit x86 support)")
    info = read_elf(fake_driver.lib32 / "libcuda.so.580.159.04")
    assert (info.word_size, info.machine, info.soname) == (32, "EM_386", "libcuda.so.1")


def test_not_an_elf_file(tmp_path: Path) -> None:
    text = tmp_path / "libcuda.so.1"
    text.write_text("INPUT(libcuda.so.580)\n")  # a linker script, as some distros ship
    with pytest.raises(ElfReadError, match="not a valid ELF file"):
        read_elf(text)
    with pytest.raises(ElfReadError, match="cannot read"):
        read_elf(tmp_path / "missing.so")


def _driver_files() -> list[tuple[str, str, dict[str, str]]]:
    rows = []
    for line in (FIXTURES / "driver-files.txt").read_text().splitlines():
        kind, path, *rest = line.split()
        fields = dict(item.split("=", 1) for item in rest if "=" in item)
        rows.append((kind, path, fields))
    return rows


def test_the_list_covers_every_file_of_a_real_580_driver() -> None:
    rows = _driver_files()
    binaries = {p.removeprefix("bin/") for _, p, _ in rows if p.startswith("bin/")}
    assert binaries == {b.name for b in BINARIES}
    for kind, path, _fields in rows:
        if path.startswith("lib64/") and kind == "FILE":
            name = path.removeprefix("lib64/")
            library = library_of(name)
            assert library is not None, f"{name} is not in the component list"
            assert name.endswith(".so.580.159.04") == library.driver_versioned


def test_the_list_is_current_for_5xx() -> None:
    names = {library.name for library in LIBRARIES}
    assert {"libnvidia-nvvm", "libnvidia-gpucomp", "libnvidia-allocator", "libcudadebugger"} <= (
        names
    )
    assert "libnvidia-fatbinaryloader" not in names
    assert all(library.what for library in LIBRARIES)  # every entry says what it is for
    assert library_of("libGLX_mesa.so.0") is None
    assert library_of("libcudart.so.13") is None
    checked = {library.name: library.check for library in LIBRARIES}
    assert checked["libnvidia-tls"] is Check.TLS_ABI_2_3_99
    assert {n for n, c in checked.items() if c is Check.NVIDIA_GL_VENDOR} == {
        "libGL",
        "libEGL",
        "libGLESv1_CM",
        "libGLESv2",
    }
