"""Files others may have touched: bounded reads that never block, writes that never follow."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from agent import files
from agent.files import UnusableFile, read_regular, write_atomically


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_bytes(b"x" * 1000)
    assert read_regular(path, limit=1000, what="node file") == b"x" * 1000


def test_a_file_beyond_the_bound_is_refused_by_its_size_without_reading_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sparse.json"
    with path.open("wb") as out:
        out.truncate(20 * 1000**3)  # 20 GB, sparse: reading it would take 20 GB
    with pytest.raises(UnusableFile) as err:
        read_regular(path, limit=4 * 1024 * 1024, what="node file")
    assert str(err.value) == f"node file {path} is 20.0 GB, more than the 4.0 MiB it may be"


KERNEL_ATTRIBUTE = Path("/sys/devices/system/cpu/online")  # "0-1\n", declared 4096 bytes


@pytest.mark.skipif(not KERNEL_ATTRIBUTE.exists(), reason="no sysfs mounted")
def test_a_kernel_attribute_is_bounded_by_what_it_holds_not_by_its_declared_size() -> None:
    """sysfs declares a size that is not the content (4096 here; 28 KiB for a NUMA node's
    cpulist on a kernel built for 8,192 CPUs): read as a kernel attribute, only the bytes
    read count."""
    declared = KERNEL_ATTRIBUTE.stat().st_size
    content = KERNEL_ATTRIBUTE.read_bytes()
    assert len(content) < 64 < declared
    with pytest.raises(UnusableFile, match="more than the 64 bytes it may be"):
        read_regular(KERNEL_ATTRIBUTE, limit=64, what="CPU list")
    assert read_regular(KERNEL_ATTRIBUTE, limit=64, what="CPU list", kernel=True) == content
    with pytest.raises(UnusableFile, match="grew beyond the 1 bytes it may be while read"):
        read_regular(KERNEL_ATTRIBUTE, limit=1, what="CPU list", kernel=True)


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "dev-zero"])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "spec.json"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a blocking open would wait forever
        expected = "a FIFO"
    elif kind == "directory":
        path.mkdir()
        expected = "a directory"
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        expected = "a socket"
    else:
        path.symlink_to("/dev/zero")  # endless: an unbounded read never ends
        expected = "a character device"
    done = threading.Event()
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_regular(path, limit=1024, what="token file")
        except BaseException as err:
            outcome.append(err)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), "the read blocked"
    (err,) = outcome
    if kind == "socket":  # a socket cannot even be opened
        assert isinstance(err, UnusableFile)
        assert str(err).startswith(f"token file {path}: ")
        server.close()
    else:
        assert isinstance(err, UnusableFile)
        assert str(err) == f"token file {path} is {expected}, not a regular file"


def test_a_link_is_refused_when_links_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("secret")
    link = tmp_path / "spec.json"
    link.symlink_to(target)
    assert read_regular(link, limit=100, what="certificate") == b"secret"
    with pytest.raises(UnusableFile, match="is a symbolic link, not a regular file"):
        read_regular(link, limit=100, what="CDI spec", follow=False)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UnusableFile) as err:
        read_regular(tmp_path / "nope", limit=10, what="node file")
    assert str(err.value) == f"node file {tmp_path / 'nope'}: No such file or directory"


def test_a_write_replaces_the_file_with_the_mode_asked(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomically(tmp_path / "cdi", "spec.json", b"{}\n", mode=0o644)
    finally:
        os.umask(old)
    path = tmp_path / "cdi" / "spec.json"
    assert path.read_bytes() == b"{}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["spec.json"]


def test_a_link_at_the_name_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    victim.chmod(0o600)
    directory = tmp_path / "cdi"
    directory.mkdir()
    (directory / "spec.json").symlink_to(victim)
    write_atomically(directory, "spec.json", b"{}\n")
    assert victim.read_text() == "root:secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (directory / "spec.json").is_symlink()
    assert (directory / "spec.json").read_bytes() == b"{}\n"


def test_whatever_is_planted_at_temporary_names_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names taken (links, FIFOs, directories) are skipped: a new random name is tried."""
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    directory = tmp_path / "cdi"
    directory.mkdir()
    names = iter(["aaaa", "bbbb", "cccc", "dddd"])
    monkeypatch.setattr("agent.files._random_suffix", lambda: next(names))
    (directory / ".spec.json.aaaa.tmp").symlink_to(victim)
    os.mkfifo(directory / ".spec.json.bbbb.tmp")
    (directory / ".spec.json.cccc.tmp").mkdir()
    write_atomically(directory, "spec.json", b"{}\n")
    assert victim.read_text() == "secret"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [
        ".spec.json.aaaa.tmp",
        ".spec.json.bbbb.tmp",
        ".spec.json.cccc.tmp",
        "spec.json",
    ]


def test_a_directory_at_the_name_fails_the_write_and_leaves_no_temporary(tmp_path: Path) -> None:
    directory = tmp_path / "cdi"
    (directory / "spec.json").mkdir(parents=True)
    with pytest.raises(OSError):
        write_atomically(directory, "spec.json", b"{}\n")
    assert sorted(p.name for p in directory.iterdir()) == ["spec.json"]


def test_a_file_where_the_directory_should_be_is_not_a_directory(tmp_path: Path) -> None:
    """Not ``File exists``, which mkdir says: that names no problem a person can see."""
    (tmp_path / "cdi").write_text("x")
    with pytest.raises(NotADirectoryError):
        write_atomically(tmp_path / "cdi", "spec.json", b"{}\n")
    assert (tmp_path / "cdi").read_text() == "x"


@pytest.mark.parametrize(
    ("size", "text"),
    [(10, "10 bytes"), (4096, "4 KiB"), (4 * 1024 * 1024, "4.0 MiB"), (20 * 1000**3, "20.0 GB")],
)
def test_sizes_read_as_a_person_reads_them(size: int, text: str) -> None:
    assert files.describe_size(size) == text


def test_a_missing_directory_is_made_and_found_writable_leaving_nothing_in_it(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "var" / "state"
    files.writable_directory(directory, what="state directory")
    assert directory.is_dir()
    assert list(directory.iterdir()) == []


def test_a_file_in_the_way_of_a_directory_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "var").write_text("x")
    with pytest.raises(UnusableFile) as err:
        files.writable_directory(tmp_path / "var" / "state", what="state directory")
    assert str(err.value) == (
        f"state directory {tmp_path}/var/state: Not a directory ({tmp_path}/var is a regular file)"
    )
    with pytest.raises(UnusableFile) as err:
        files.writable_directory(tmp_path / "var", what="state directory")
    assert str(err.value) == (
        f"state directory {tmp_path}/var: Not a directory ({tmp_path}/var is a regular file)"
    )


def test_a_directory_no_file_can_be_created_in_is_refused(tmp_path: Path) -> None:
    """/proc: the directory exists, but nothing can be created in it."""
    with pytest.raises(UnusableFile, match=r"^state directory /proc/self: .+$"):
        files.writable_directory(Path("/proc/self"), what="state directory")
