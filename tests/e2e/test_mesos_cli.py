"""``/mesos/cli`` of a real agent process, and ``nvidia-docker-ctl mesos`` against it.

The agent serves the simulated 8-GPU HGX node. ``mesos exec`` runs a stand-in for
``mesos-agent`` (a script that prints its argv and pid), so the test sees the exact command
line the real agent would get, and that it replaced the helper's process.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mesos.blob import decode
from tests.support.services import free_port, listens_on, stop_process, wait_until
from tests.support.sshd import SshServer
from tests.unit.controller.ctl_lines import error_of
from tests.unit.mesos import mesos_rules

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-m", "controller.ctl.main", "mesos"]  # nvidia-docker-ctl mesos
FAKE_AGENT = """#!{python}
import json, os, sys
print(json.dumps({{"pid": os.getpid(), "argv": sys.argv}}))
"""


def ctl(
    *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run ``nvidia-docker-ctl mesos ARGS`` to completion."""
    command = [*CTL, *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, timeout=60, check=False, cwd=ROOT, env=env
    )


@dataclass(frozen=True)
class Agent:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as answer:
                return answer.status, answer.read(), answer.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            return error.code, error.read(), error.headers.get("Content-Type", "")


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    with _agent("hgx-h200-8") as running:
        yield running


@pytest.fixture(scope="module")
def mig_agent() -> Iterator[Agent]:
    """Two H200s, GPU 0 in MIG mode with MIG devices (the h200x2-mig node file)."""
    with _agent("h200x2-mig") as running:
        yield running


@contextlib.contextmanager
def _agent(node: str) -> Iterator[Agent]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nvd-mesos-") as workdir:
        command = [sys.executable, "-m", "agent.daemon", "--simulate", node]
        command += ["-l", f"127.0.0.1:{port}", "-s", f"{workdir}/sock", "-d", f"{workdir}/vol"]
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
        )
        try:
            wait_until(lambda: listens_on(proc.pid, port), what="agent", timeout_s=60, proc=proc)
            yield Agent(port)
        finally:
            stop_process(proc)
            proc.communicate()


@pytest.fixture(scope="module")
def info(agent: Agent) -> tuple[bytes, list[str]]:
    """The agent's /gpu/info/json body and its GPU UUIDs in index order."""
    status, body, _ = agent.get("/gpu/info/json")
    assert status == 200
    return body, [device["UUID"] for device in json.loads(body)["Devices"]]


@pytest.fixture
def fake_agent(tmp_path: Path) -> Path:
    script = tmp_path / "mesos-agent"
    script.write_text(FAKE_AGENT.format(python=sys.executable))
    script.chmod(0o755)
    return script


def test_legacy_line_is_the_info_json_and_every_gpu(
    agent: Agent, info: tuple[bytes, list[str]]
) -> None:
    info_json, uuids = info
    status, body, content_type = agent.get("/mesos/cli")
    assert status == 200
    assert content_type.startswith("text/plain")
    line = body.decode()
    assert not line.endswith("\n")
    attribute, resources = line.split(" ")
    assert decode(attribute) == info_json  # exactly the /gpu/info/json body
    assert resources == "--resources=gpus:{" + ",".join(uuids) + "}"
    flags = mesos_rules.load_flags(["mesos-agent", attribute, resources])
    assert mesos_rules.parse_attributes(flags["attributes"] or "")["gpus"].type == "TEXT"
    assert mesos_rules.parse_resources(flags["resources"] or "")[0][1].items == tuple(uuids)
    assert agent.get("/v1.0/mesos/cli")[1] == body


def test_native_line_offers_the_gpus_to_mesos(agent: Agent, info: tuple[bytes, list[str]]) -> None:
    status, body, _ = agent.get("/mesos/cli?format=native")
    assert status == 200
    words = body.decode().split(" ")
    assert decode(words[0]) == info[0]
    assert words[1:] == ["--resources=gpus:8", "--nvidia_gpu_devices=0,1,2,3,4,5,6,7"]


@pytest.mark.parametrize(
    ("query", "indices"),
    [("dev=0+3", [0, 3]), ("dev=5,1", [1, 5]), ("dev=*", list(range(8))), ("dev=", list(range(8)))],
)
def test_dev_selects_gpus_in_both_formats(
    agent: Agent, info: tuple[bytes, list[str]], query: str, indices: list[int]
) -> None:
    uuids = info[1]
    legacy = agent.get(f"/mesos/cli?{query}")[1].decode().split(" ")[1]
    assert legacy == "--resources=gpus:{" + ",".join(uuids[i] for i in indices) + "}"
    native = agent.get(f"/mesos/cli?format=native&{query}")[1].decode().split(" ")[1:]
    assert native == [
        f"--resources=gpus:{len(indices)}",
        "--nvidia_gpu_devices=" + ",".join(str(i) for i in indices),
    ]


def test_dev_by_uuid_prefix(agent: Agent, info: tuple[bytes, list[str]]) -> None:
    uuid = info[1][6]
    status, body, _ = agent.get(f"/mesos/cli?format=native&dev={uuid[:12]}")
    assert status == 200
    assert body.decode().endswith(" --resources=gpus:1 --nvidia_gpu_devices=6")


@pytest.mark.parametrize("entry", ["8", "GPU-ffffffff", "first"])
def test_a_dev_naming_no_gpu_is_a_400(agent: Agent, entry: str) -> None:
    for query in (f"dev={entry}", f"format=native&dev=0+{entry}"):
        status, body, _ = agent.get(f"/mesos/cli?{query}")
        assert (status, body) == (400, f"invalid device: {entry}\n".encode())


def test_an_unknown_format_is_a_400(agent: Agent) -> None:
    status, body, _ = agent.get("/mesos/cli?format=json")
    assert status == 400
    assert b"format" in body


def test_any_zlib_inflates_the_live_blob(agent: Agent, info: tuple[bytes, list[str]]) -> None:
    import base64  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    blob = agent.get("/mesos/cli")[1].decode().split(" ")[0].removeprefix("--attributes=gpus:")
    raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
    assert zlib.decompress(raw) == info[0]
    for command in (["pigz", "-dz"], ["zlib-flate", "-uncompress"]):
        if shutil.which(command[0]) is None:
            pytest.fail(f"{command[0]} is missing: scripts/test-all installs pigz and qpdf")
        done = subprocess.run(command, input=raw, capture_output=True, check=True, timeout=30)
        assert done.stdout == info[0]


def test_ctl_flags_and_decode_against_the_agent(
    agent: Agent, info: tuple[bytes, list[str]]
) -> None:
    flags = subprocess.run(
        [*CTL, "flags", "--format", "native", "--dev", "2 3", agent.url],
        capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
    )  # fmt: skip
    assert flags.stdout == agent.get("/mesos/cli?format=native&dev=2+3")[1].decode() + "\n"
    decoded = ctl("decode", "-", stdin=flags.stdout.encode())
    assert decoded.returncode == 0
    assert decoded.stdout == info[0]


def test_ctl_flags_names_the_gpus_a_line_leaves_out(mig_agent: Agent) -> None:
    """The native line cannot offer a GPU in MIG mode: stdout is the line, stderr says why."""
    status, line, _ = mig_agent.get("/mesos/cli?format=native")
    assert status == 200
    result = ctl("flags", "--format", "native", mig_agent.url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == line + b"\n"
    assert line.endswith(b"--resources=gpus:1 --nvidia_gpu_devices=1")
    assert result.stderr.decode() == (
        f"nvidia-docker-ctl: {mig_agent.url}: not offered: GPU 0 is in MIG mode (Mesos's "
        "gpu/nvidia isolator gives whole GPUs and cannot give MIG devices: use format=legacy, "
        "whose gpus set offers MIG devices by UUID)\n"
    )
    legacy = ctl("flags", mig_agent.url)  # the legacy line offers the MIG devices
    assert (legacy.returncode, legacy.stderr) == (0, b"")


def test_ctl_flags_with_a_dev_naming_no_gpu_is_one_line(agent: Agent) -> None:
    result = ctl("flags", "--dev", "9", agent.url)
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr.count(b"\n") == 1
    assert b"invalid device: 9" in result.stderr


def test_exec_replaces_itself_with_the_agent_and_merged_flags(
    agent: Agent, info: tuple[bytes, list[str]], fake_agent: Path
) -> None:
    proc = subprocess.Popen(
        [
            *CTL, "exec", "--format", "native", "--dev", "0 1 2 3", "--node", agent.url, "--",
            str(fake_agent), "--master=zk://zk1:2181/mesos", "--work_dir=/var/lib/mesos",
            "--attributes=rack:r7", "--resources", "cpus:32;mem:262144",
            "--isolation=docker/runtime,gpu/nvidia,cgroups/cpu",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"}, cwd=ROOT,
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    printed = json.loads(out)
    assert printed["pid"] == proc.pid  # exec: the agent took the helper's process
    argv = printed["argv"]
    assert argv == [
        str(fake_agent),
        "--master=zk://zk1:2181/mesos",
        "--work_dir=/var/lib/mesos",
        argv[3],
        "--resources=cpus:32;mem:262144;gpus:4",
        "--isolation=docker/runtime,cgroups/cpu,cgroups/devices,filesystem/linux,gpu/nvidia",
        "--nvidia_gpu_devices=0,1,2,3",
    ]
    assert argv[3].startswith("--attributes=rack:r7;gpus:")
    flags = mesos_rules.load_flags(argv)  # no flag twice: Mesos would refuse it
    assert decode(flags["attributes"] or "") == info[0]
    for version in [(1, 0), (1, 1), (1, 2), (1, 6), (1, 7), (1, 11)]:
        assert mesos_rules.native_gpus_offered(flags, version) == 4


def test_exec_legacy_keeps_the_old_line_and_the_operators_flags(
    agent: Agent, info: tuple[bytes, list[str]], fake_agent: Path
) -> None:
    result = ctl(
        "exec", "--node", agent.url, "--", str(fake_agent), "--master=m", "--", "tail",
        env={"PATH": "/usr/bin:/bin", "MESOS_ATTRIBUTES": "os:u"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    argv = json.loads(result.stdout)["argv"]
    legacy = agent.get("/mesos/cli")[1].decode().split(" ")
    assert argv[1] == "--master=m"
    assert argv[2] == legacy[0].replace("--attributes=", "--attributes=os:u;")
    assert argv[3:] == [legacy[1], "--", "tail"]


def test_exec_refuses_the_legacy_line_with_the_gpu_isolator(agent: Agent, fake_agent: Path) -> None:
    isolation = "--isolation=cgroups/devices,filesystem/linux,gpu/nvidia"
    result = ctl("exec", "--node", agent.url, "--", str(fake_agent), isolation)
    assert result.returncode == 2  # the operator's command line cannot be merged: usage
    assert result.stdout == b""  # the agent never ran
    assert "use the native format" in error_of(result.stderr.decode())


def test_exec_dry_run_pasted_into_a_shell_runs_the_same_command(
    agent: Agent, fake_agent: Path
) -> None:
    """The line used to be printed unquoted: a shell split --attributes=rack:r7;gpus:... at
    the ;. Pasted into sh now, it runs the very argv exec would have run."""
    args = [str(fake_agent), "--master=zk://zk1:2181/mesos", "--attributes=rack:r7"]
    dry = ctl("exec", "--format", "native", "--dry-run", "--node", agent.url, "--", *args)
    assert dry.returncode == 0, dry.stderr.decode()
    line = dry.stdout.decode()
    assert "'--attributes=rack:r7;gpus:" in line
    pasted = subprocess.run(
        ["sh", "-c", line],
        check=False,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert pasted.returncode == 0, pasted.stderr.decode()
    ran = ctl("exec", "--format", "native", "--node", agent.url, "--", *args)
    assert json.loads(pasted.stdout)["argv"] == json.loads(ran.stdout)["argv"]


def test_ctl_flags_through_ssh_to_the_nodes_localhost(
    agent: Agent, sshd_server: SshServer, tmp_path: Path
) -> None:
    home = sshd_server.client_home(tmp_path / "home")
    node = f"ssh://{sshd_server.user}@{sshd_server.host}:{sshd_server.port}:{agent.port}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    result = ctl("flags", "--format", "native", "--dev", "7", node, env=env)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == agent.get("/mesos/cli?format=native&dev=7")[1].decode() + "\n"
