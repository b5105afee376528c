"""The createContainer hook on a container root made here: the host's real ldconfig, the
fake driver's real ELF libraries in a driver volume the plugin built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cdi import hook
from plugin.discovery import find_driver_files
from plugin.ldcache import WordSize, read_ldcache
from plugin.volume_build import build_tree
from tests.support.fake_driver import FakeDriver

FOLDERS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib")
LDCONFIG = shutil.which("ldconfig", path="/usr/sbin:/sbin:/usr/bin:/bin") or "/sbin/ldconfig"
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ldconfig -r chroots: needs root")


def container(tmp_path: Path, driver: FakeDriver, *, etc: bool = True) -> tuple[Path, Path]:
    """A bundle whose rootfs has the driver volume at /usr/local/nvidia (as the runtime has
    mounted it when the hook runs) and, with ``etc``, a Debian-like /etc."""
    bundle = tmp_path / "bundle"
    root = bundle / "rootfs"
    volume = root / "usr" / "local" / "nvidia"
    volume.mkdir(parents=True)
    build_tree(
        find_driver_files(driver.version, ldcache=driver.ldcache, search_path=str(driver.bin)),
        volume,
        what="test volume",
    )
    if etc:
        (root / "etc" / "ld.so.conf.d").mkdir(parents=True)
        (root / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    return bundle, root


def run_hook(
    bundle: Path, *command: str, state: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The hook as a runtime runs it: an empty environment, the state on standard input."""
    args = command or ("update-ldcache", "--ldconfig", LDCONFIG)
    if not command:
        for folder in FOLDERS:
            args += ("--folder", folder)
    script = Path(sys.executable).with_name("nvidia-docker-cdi-hook")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "cdi.hook"]
    env = {} if script.exists() else {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*argv, *args],
        input=json.dumps({"ociVersion": "1.0.2", "bundle": str(bundle)})
        if state is None
        else state,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_libcuda_by_its_soname_in_the_containers_cache(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    bundle, root = container(tmp_path, fake_driver)
    done = run_hook(bundle)
    assert (done.returncode, done.stderr) == (0, "")
    entries = read_ldcache(root / "etc" / "ld.so.cache")
    cache = {e.name: e.path for e in entries if e.word_size is WordSize.BITS_64}
    assert cache["libcuda.so.1"] == "/usr/local/nvidia/lib64/libcuda.so.1"
    assert cache["libnvidia-ml.so.1"] == "/usr/local/nvidia/lib64/libnvidia-ml.so.1"
    if fake_driver.lib32 is not None:
        cache32 = {e.name: e.path for e in entries if e.word_size is WordSize.BITS_32}
        assert cache32["libcuda.so.1"] == "/usr/local/nvidia/lib/libcuda.so.1"
    conf = (root / "etc" / "ld.so.conf.d" / hook.CONF_NAME).read_text()
    assert conf.splitlines()[1:] == list(FOLDERS)
    assert (root / "etc" / "ld.so.conf.d" / hook.CONF_NAME).stat().st_mode & 0o777 == 0o644


def test_a_later_ldconfig_in_the_container_keeps_the_driver(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    bundle, root = container(tmp_path, fake_driver)
    assert run_hook(bundle).returncode == 0
    (root / "etc" / "ld.so.cache").unlink()
    # What a package install inside the container runs: ldconfig from ld.so.conf alone.
    subprocess.run([LDCONFIG, "-r", str(root)], check=True, capture_output=True)
    names = {entry.name for entry in read_ldcache(root / "etc" / "ld.so.cache")}
    assert "libcuda.so.1" in names


def test_a_symlink_out_of_the_root_is_never_followed(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    bundle, root = container(tmp_path, fake_driver)
    outside = tmp_path / "host-etc"
    outside.mkdir()
    shutil.rmtree(root / "etc" / "ld.so.conf.d")
    (root / "etc" / "ld.so.conf.d").symlink_to(outside)
    done = run_hook(bundle)
    assert done.returncode == 0
    assert list(outside.iterdir()) == []  # nothing written through the image's symlink
    names = {entry.name for entry in read_ldcache(root / "etc" / "ld.so.cache")}
    assert "libcuda.so.1" in names  # the folders on ldconfig's command line still count


def test_an_image_without_etc_starts_anyway(tmp_path: Path, fake_driver: FakeDriver) -> None:
    bundle, root = container(tmp_path, fake_driver, etc=False)
    (root / "etc").write_text("not a directory\n")  # ldconfig cannot write its cache
    done = run_hook(bundle)
    assert done.returncode == 0
    assert done.stderr.startswith("nvidia-docker-cdi-hook: ")
    assert "libraries load only through LD_LIBRARY_PATH" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_a_missing_ldconfig_is_one_line_and_exit_zero(
    tmp_path: Path, fake_driver: FakeDriver
) -> None:
    bundle, _root = container(tmp_path, fake_driver)
    done = run_hook(
        bundle, "update-ldcache", "--ldconfig", "/nonexistent/ldconfig", "--folder", FOLDERS[0]
    )
    assert done.returncode == 0
    assert done.stderr.startswith("nvidia-docker-cdi-hook: /nonexistent/ldconfig failed: ")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("", "no OCI container state with a 'bundle' on standard input"),
        ('{"id": "x"}', "no OCI container state with a 'bundle' on standard input"),
        ('{"bundle": "/nonexistent"}', "cannot read root.path of /nonexistent/config.json"),
    ],
)
def test_a_call_that_is_not_a_runtimes_fails(tmp_path: Path, state: str, message: str) -> None:
    done = run_hook(tmp_path, state=state)
    assert done.returncode == 1
    assert done.stderr.startswith(f"nvidia-docker-cdi-hook: {message}")


def test_an_absolute_root_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"root": {"path": "/merged"}}))
    assert hook.container_root(json.dumps({"bundle": str(tmp_path)})) == Path("/merged")
