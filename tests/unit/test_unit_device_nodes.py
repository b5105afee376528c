"""The packaged unit's device-node step, run as systemd would run it, on a fake driver's /proc.

The ``ExecStartPre`` line of ``packaging/systemd/nvidia-docker.service`` that calls
``nvidia-modprobe`` is taken from the file, unescaped as systemd does (``$$`` is ``$``), and
run with ``/bin/sh`` in a mount namespace of its own (``unshare --mount``) where a directory of
this test is bind-mounted on ``/proc/driver``: an 8-GPU node's ``nvidia/gpus/*/information``
files and MIG capability files, as the NVIDIA kernel module lays them out. A fake
``nvidia-modprobe`` first on PATH records how it is called.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.prerequisites import require_command, require_root

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "systemd" / "nvidia-docker.service"
# Bus addresses and minors of an HGX board: minors follow the bus order, not 0..7 by chance.
GPUS = {"0000:18:00.0": 0, "0000:2a:00.0": 1, "0000:3a:00.0": 2, "0000:5d:00.0": 3,
        "0000:9a:00.0": 4, "0000:ab:00.0": 5, "0000:ba:00.0": 6, "0000:db:00.0": 7}  # fmt: skip
FAKE_MODPROBE = """#!/bin/sh
echo "$*" >> "{log}"
exit {status}
"""


def device_step() -> list[str]:
    """The ExecStartPre command that makes the device nodes, as argv."""
    lines = [
        line for line in UNIT.read_text().splitlines()
        if line.startswith("ExecStartPre=") and "nvidia-modprobe" in line
    ]  # fmt: skip
    assert len(lines) == 1, lines
    command = lines[0].removeprefix("ExecStartPre=").lstrip("-+@:!")
    return [word.replace("$$", "$") for word in shlex.split(command)]


def fake_driver(root: Path, *, mig: bool) -> Path:
    """What /proc/driver holds with the NVIDIA module loaded."""
    for bus, minor in GPUS.items():
        info = root / "nvidia" / "gpus" / bus / "information"
        info.parent.mkdir(parents=True)
        info.write_text(
            "Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\nGPU UUID: \t GPU-0000\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
    if mig:
        caps = root / "nvidia" / "capabilities"
        for name in (
            "mig/config",
            "mig/monitor",
            "gpu0/mig/gi1/access",
            "gpu0/mig/gi1/ci0/access",
            "gpu0/mig/gi2/access",
            "gpu0/mig/gi2/ci0/access",
        ):
            (caps / name).parent.mkdir(parents=True, exist_ok=True)
            (caps / name).write_text("DeviceFileMinor: 1\nDeviceFileMode: 292\n")  # fmt: skip
    return root


def run_step(tmp_path: Path, driver: Path | None, modprobe_status: int | None) -> list[str]:
    """Run the unit's step; returns the nvidia-modprobe calls (their arguments)."""
    require_root()
    unshare = require_command("unshare", "apt-get install util-linux")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    log.touch()
    if modprobe_status is not None:
        fake = bin_dir / "nvidia-modprobe"
        fake.write_text(FAKE_MODPROBE.format(log=log, status=modprobe_status))
        fake.chmod(0o755)
    empty = tmp_path / "no-driver"
    empty.mkdir()
    mount_on = driver or empty
    argv = device_step()
    done = subprocess.run(
        [unshare, "--mount", "/bin/sh", "-c",
         'mount --make-rprivate / && mount --bind "$0" /proc/driver && exec "$@"',
         str(mount_on), *argv],
        env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # "-" in the unit, but it should not even fail
    return log.read_text().splitlines()


def test_every_gpu_and_mig_capability_gets_its_node(tmp_path: Path) -> None:
    calls = run_step(tmp_path, fake_driver(tmp_path / "driver", mig=True), 0)
    caps = "/proc/driver/nvidia/capabilities"
    assert calls == [
        "-u -c=0",
        *(f"-c={minor}" for minor in GPUS.values()),
        f"-f {caps}/mig/config",
        f"-f {caps}/mig/monitor",
        f"-f {caps}/gpu0/mig/gi1/access",
        f"-f {caps}/gpu0/mig/gi2/access",
        f"-f {caps}/gpu0/mig/gi1/ci0/access",
        f"-f {caps}/gpu0/mig/gi2/ci0/access",
    ]


def test_a_node_without_mig_gets_the_gpu_nodes_only(tmp_path: Path) -> None:
    calls = run_step(tmp_path, fake_driver(tmp_path / "driver", mig=False), 0)
    assert calls == ["-u -c=0", *(f"-c={minor}" for minor in GPUS.values())]


@pytest.mark.parametrize(
    ("modprobe_status", "expected"),
    [(None, []), (1, ["-u -c=0"])],
    ids=["no nvidia-modprobe (a simulated node)", "nvidia-modprobe fails (no driver)"],
)
def test_without_a_driver_the_step_does_nothing_more(
    tmp_path: Path, modprobe_status: int | None, expected: list[str]
) -> None:
    assert run_step(tmp_path, None, modprobe_status) == expected
