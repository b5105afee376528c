"""The GPU-aware engine socket end to end (docs/engine-socket.md): the Docker 28 CLI with
``DOCKER_HOST=unix://<the agent's engine socket>``, a private dockerd (20.10: the device-node
form) and a real agent serving the simulated ``hgx-h200-8`` node with its lease table.

The device nodes /dev/nvidia0..7, nvidiactl and nvidia-uvm come from test_leases_docker's
module fixture (mknod where missing, under the machine-wide device lock). Checked: two
``docker run --gpus 2`` get four distinct GPUs and their leases are bound; ``docker ps``,
``docker logs -f``, ``docker run -i`` and ``docker exec -i`` (hijacked streams, stdin echoed
back), ``docker events`` (bounded) work through the socket; with all eight GPUs leased a
``docker run --gpus 1`` fails in one line and leaves no container; ``docker rm -f`` frees
the lease; a ``docker run --gpus 1`` labelled ``nvidia-docker.lease.wait`` waits in the queue
and runs once the holder is removed, and one killed while it waits leaves the queue and
creates nothing; the REST API answers while a client holds a half-sent head on the socket;
``docker run -it`` (on a pseudo-terminal), ``attach``, ``cp`` and ``build`` work through it;
Debian 13's Compose v2 (``.cache/compose``, fetched by scripts/test-all; skipped without it)
gives 4 replicas 4 distinct GPUs and ``down`` frees them, and a project whose service is
labelled ``nvidia-docker.lease.wait`` comes up once another project's ``down`` frees a GPU.
"""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_leases_docker import IMAGE, Dockerd, dockerd, nvidia_devices
from tests.support.agent_process import launch_agent, wait_ready
from tests.support.dockerd import RUN_HELP_HINTS
from tests.support.engine_socket_client import COMPOSE, EngineSocketClient, compose_project
from tests.support.services import stop_process, wait_until
from tests.support.wrapper import wrapper_command

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

__all__ = ["dockerd", "nvidia_devices"]  # module fixtures, shared


@dataclass(kw_only=True)
class Served(EngineSocketClient):
    dockerd: Dockerd


@pytest.fixture
def served(dockerd: Dockerd, tmp_path: Path) -> Iterator[Served]:
    base = tmp_path / "agent"
    engine_socket = tmp_path / "engine" / "docker.sock"
    agent = launch_agent(
        base,
        "--docker-socket", dockerd.socket,
        "--podman-socket", str(base / "no-podman.sock"),
        "--state-dir", str(base / "state"),
        "--spec-file", str(dockerd.engine.plugin_specs / "nvidia-docker.spec"),
        "--cdi-spec-dir", "",
        "--engine-socket", str(engine_socket),
        "--usage-interval", "0.5",
        simulate="hgx-h200-8",
        socket_dir=dockerd.plugin_dir,
    )  # fmt: skip
    try:
        wait_ready(agent)
        wait_until(engine_socket.exists, what="the engine socket", timeout_s=20)
        yield Served(dockerd=dockerd, agent=agent, engine_socket=engine_socket)
    finally:
        engine = dockerd.engine
        ids = engine.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            engine.docker("rm", "-f", *ids, check=False)
        volumes = engine.docker(
            "volume", "ls", "-q", "--filter", "driver=nvidia-docker", check=False
        ).stdout.split()
        if volumes:
            engine.docker("volume", "rm", "-f", *volumes, check=False)
        stop_process(agent.proc)
    assert not engine_socket.exists()  # removed at a graceful stop


def test_the_socket_has_the_engines_rights(served: Served) -> None:
    ours, theirs = served.engine_socket.stat(), Path(served.dockerd.socket).stat()
    assert stat.S_ISSOCK(ours.st_mode)
    assert (stat.S_IMODE(ours.st_mode), ours.st_uid, ours.st_gid) == (
        stat.S_IMODE(theirs.st_mode),
        theirs.st_uid,
        theirs.st_gid,
    )


def test_two_runs_of_two_gpus_get_four_distinct_gpus_and_leases(served: Served) -> None:
    first = served.ok("run", "-d", "--gpus", "2", IMAGE, "sleep", "600").strip()
    second = served.ok("run", "-d", "--gpus", "2", "--name", "second", IMAGE, "sleep", "600")
    second = second.strip()
    gpus = served.gpus_of(first) + served.gpus_of(second)
    assert len(set(gpus)) == len(gpus) == 4, gpus
    wait_until(
        lambda: set(served.bound()) == {first, second}, what="both leases bound", timeout_s=20
    )
    inspect = json.loads(served.ok("inspect", first))[0]
    labels, env = inspect["Config"]["Labels"], inspect["Config"]["Env"]
    assert labels["nvidia-docker.lease"] == served.bound()[first]
    assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=GPU-") for e in env), env
    host = inspect["HostConfig"]
    assert host["DeviceRequests"] is None
    paths = {d["PathOnHost"] for d in host["Devices"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths
    assert any(m["Type"] == "volume" and m["Target"] == "/usr/local/nvidia" for m in host["Mounts"])
    owners = {lease["Container"]: lease["Owner"] for lease in served.table()["Leases"]}
    assert owners[second] == {"via": "engine-socket", "name": "second"}
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    leased = [
        line for line in metrics.splitlines()
        if line.startswith("nvidia_docker_gpu_leased{") and f'container_id="{second}"' in line
    ]  # fmt: skip
    assert len(leased) == 2, metrics  # one per GPU, with the container's name and image
    assert all('container_name="second"' in line for line in leased), leased
    assert all(f'image="{IMAGE}"' in line for line in leased), leased

    listed = served.ok("ps", "--format", "{{.ID}}")
    assert {first[:12], second[:12]} <= set(listed.split())

    served.ok("rm", "-f", first)
    wait_until(lambda: set(served.bound()) == {second}, what="the lease freed", timeout_s=5)


def test_the_wrapper_leases_through_the_agents_own_socket(served: Served) -> None:
    """``DOCKER_HOST`` naming the agent's engine socket: the wrapper's lease holds there
    (the agent says the socket is its own in ``GET /engines/json``), so it is not refused
    as an engine the agent does not follow."""

    def docker_row() -> dict[str, Any]:
        with urllib.request.urlopen(f"{served.url}/engines/json", timeout=10) as resp:
            engines = json.loads(resp.read())
        assert engines["EngineSocket"] == str(served.engine_socket)
        row: dict[str, Any] = next(
            r for r in engines["Engines"] if r["Socket"] == served.dockerd.socket
        )
        return row

    # the agent answers before its event stream is open: wait for it, then for its facts
    wait_until(lambda: docker_row()["Following"], what="dockerd followed", timeout_s=20)
    assert docker_row()["ID"], docker_row()  # dockerd's GET /info ID
    env = {k: v for k, v in served.client_env().items() if not k.startswith("NV_")}
    env.update(NV_HOST=served.url, NV_GPU="auto:1", NV_CDI="no", PYTHONPATH=str(REPO))
    run = subprocess.run(
        [*wrapper_command(), "run", "-d", IMAGE, "sleep", "600"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    container = run.stdout.strip()
    wait_until(lambda: container in served.bound(), what="its lease bound", timeout_s=20)
    assert len(served.gpus_of(container)) == 1


def test_streams_and_hijacked_connections_pass_through(served: Served) -> None:
    logs_of = served.ok("run", "-d", IMAGE, "sh", "-c", "echo one; echo two; echo three >&2")
    followed = served.docker("logs", "-f", logs_of.strip(), timeout_s=30)
    assert followed.returncode == 0
    assert followed.stdout == b"one\ntwo\n"
    assert followed.stderr == b"three\n"

    data = b"".join(b"line %d of the input\n" % i for i in range(20000))  # ~0.5 MB
    echoed = served.docker("run", "--rm", "-i", IMAGE, "cat", stdin=data)
    assert echoed.returncode == 0, echoed.stderr
    assert echoed.stdout == data

    since = str(int(time.time()) - 1)
    sleeper = served.ok("run", "-d", IMAGE, "sleep", "600").strip()
    execed = served.docker("exec", "-i", sleeper, "cat", stdin=b"to exec and back\n")
    assert execed.returncode == 0, execed.stderr
    assert execed.stdout == b"to exec and back\n"
    until = str(int(time.time()) + 1)
    events = served.ok("events", "--since", since, "--until", until, "--format", "{{.Action}}")
    actions = events.split()
    assert {"create", "start"} <= set(actions), events
    assert "exec_start: cat " in events, events


def test_all_gpus_leased_a_run_fails_in_one_line_and_leaves_nothing(served: Served) -> None:
    holder = served.ok("run", "-d", "--gpus", "all", IMAGE, "sleep", "600").strip()
    assert len(served.gpus_of(holder)) == 8
    before = served.ok("ps", "-aq").split()

    refused = served.docker("run", "--gpus", "1", IMAGE, "true")
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.decode().splitlines() if line.strip()]
    assert lines
    assert lines[0].startswith("docker: Error response from daemon: nvidia-docker:")
    assert "not enough free GPUs" in lines[0]
    assert f"by container {holder[:12]}" in lines[0]
    assert lines[1:] in RUN_HELP_HINTS  # the CLI's own
    print(f"refused: {lines}")
    assert served.ok("ps", "-aq").split() == before  # nothing left behind

    created = served.docker("create", "--gpus", '"device=3"', IMAGE, "true")
    assert created.returncode != 0
    assert b"nvidia-docker:" in created.stderr

    served.ok("rm", "-f", holder)
    wait_until(lambda: not served.bound(), what="the 8-GPU lease freed", timeout_s=5)
    again = served.ok("run", "-d", "--gpus", '"device=3"', IMAGE, "sleep", "600").strip()
    assert served.gpus_of(again) == ["/dev/nvidia3"]


def test_a_run_labelled_to_wait_starts_when_a_gpu_frees(served: Served) -> None:
    holder = served.ok("run", "-d", "--gpus", "all", IMAGE, "sleep", "600").strip()
    before = served.ok("ps", "-aq").split()
    env = served.client_env()
    waiting = ["docker", "run", "--rm", "--gpus", "1", "--label", "nvidia-docker.lease.wait=120"]

    def queued() -> int:
        return len(served.table()["Waiting"])

    # A client killed while its create waits leaves the queue, and nothing is created.
    gone = subprocess.Popen([*waiting, IMAGE, "true"], env=env, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: queued() == 1, what="the create in the queue", timeout_s=20)
    finally:
        gone.kill()
        gone.wait(timeout=10)
    wait_until(lambda: queued() == 0, what="the killed client's create out of the queue",
               timeout_s=10)  # fmt: skip
    assert served.ok("ps", "-aq").split() == before

    # One that stays gets the GPU the holder gives back, and runs.
    runner = subprocess.Popen(
        [*waiting, IMAGE, "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: queued() == 1, what="the create in the queue", timeout_s=20)
        assert runner.poll() is None  # still waiting: every GPU is the holder's
        served.ok("rm", "-f", holder)
        out, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
    assert runner.returncode == 0, err.decode()
    assert out.decode().strip().startswith("GPU-"), out


def test_a_half_sent_head_holds_only_its_own_connection(served: Served) -> None:
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(str(served.engine_socket))
    try:
        slow.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\n")  # and nothing more
        started = time.monotonic()
        with urllib.request.urlopen(f"{served.url}/gpu/info/json", timeout=5) as resp:
            assert resp.status == 200
        assert served.ok("version", "--format", "{{.Server.Version}}").strip()
        assert time.monotonic() - started < 5
    finally:
        slow.close()
    broken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    broken.connect(str(served.engine_socket))
    try:
        broken.sendall(b"POST /containers/create HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope")
        answer = broken.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b'"message"' in answer
    finally:
        broken.close()


def run_in_a_terminal(served: Served, *args: str, typed: bytes) -> tuple[int, bytes]:
    """``docker ARGS`` with a pseudo-terminal as its stdin and stdout (``-it`` needs one);
    ``typed`` is written to the terminal once the container's shell is waiting. The exit
    status and everything the terminal showed."""
    controller, terminal = os.openpty()
    env = served.client_env()
    proc = subprocess.Popen(
        ["docker", *args], stdin=terminal, stdout=terminal, stderr=terminal, env=env
    )
    os.close(terminal)
    shown = bytearray()
    deadline = time.monotonic() + 30
    sent = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.2)
            if ready:
                try:
                    piece = os.read(controller, 65536)
                except OSError:  # EIO: the terminal's last user closed it
                    break
                if not piece:
                    break
                shown += piece
            if not sent and b"ready>" in shown:
                os.write(controller, typed)
                sent = True
            if proc.poll() is not None and not ready:
                break
        return proc.wait(timeout=10), bytes(shown)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)


def test_a_terminal_attach_cp_and_build_work_through_it(served: Served, tmp_path: Path) -> None:
    script = "test -t 0 && echo is-a-tty; echo -n ready'>'; read line; echo got:$line; exit 3"
    status, shown = run_in_a_terminal(
        served, "run", "--rm", "-it", IMAGE, "sh", "-c", script, typed=b"hello\r"
    )
    assert status == 3, shown
    assert b"is-a-tty" in shown
    assert b"got:hello" in shown

    # attach to a container started -d -i: its stdin stays open after ours ends (Docker's
    # rule, the same on the engine's own socket), so the echo is read, then attach killed
    waiting = served.ok("run", "-d", "-i", IMAGE, "cat").strip()
    env = served.client_env()
    attach = subprocess.Popen(
        ["docker", "attach", waiting],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert attach.stdin is not None
        assert attach.stdout is not None
        attach.stdin.write(b"through attach\n")
        attach.stdin.flush()
        ready, _, _ = select.select([attach.stdout], [], [], 20)
        assert ready, "no echo through docker attach"
        assert attach.stdout.readline() == b"through attach\n"
    finally:
        attach.kill()
        attach.communicate(timeout=10)  # and its pipes closed

    holder = served.ok("run", "-d", IMAGE, "sleep", "600").strip()
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(3 * 1024 * 1024))
    served.ok("cp", str(payload), f"{holder}:/tmp/payload.bin")
    served.ok("cp", f"{holder}:/tmp/payload.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == payload.read_bytes()

    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY note /note\nLABEL built=yes\n")
    (context / "note").write_text("built through the engine socket\n")
    env = {**served.client_env(), "DOCKER_BUILDKIT": "0"}
    built = subprocess.run(
        ["docker", "build", "-q", "-t", "nvd-engine-socket/built:1", str(context)],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    note = served.ok("run", "--rm", "nvd-engine-socket/built:1", "cat", "/note")
    assert note == "built through the engine socket\n"
    served.ok("rmi", "nvd-engine-socket/built:1")


COMPOSE_FILE = """\
services:
  trainer:
    image: {image}
    command: ["sleep", "600"]
    deploy:
      replicas: 4
      resources:
        reservations:
          devices: [{{driver: nvidia, count: 1, capabilities: [gpu]}}]
"""


def test_compose_replicas_get_a_gpu_each_and_down_frees_them(
    served: Served, tmp_path: Path
) -> None:
    project = compose_project(tmp_path / "project", COMPOSE_FILE.format(image=IMAGE))
    served.compose_up(project, "nvdgpus", 4)
    owners = [lease["Owner"] for lease in served.table()["Leases"]]
    assert sorted(o["name"] for o in owners) == [f"nvdgpus-trainer-{i}" for i in range(1, 5)]
    # The usage ledger groups them by the labels Compose gave them (docs/usage.md).
    wait_until(
        lambda: usage(served, "label:com.docker.compose.project").get("nvdgpus", 0.0) >= 4.0,
        what="the ledger's GPU-seconds of project nvdgpus", timeout_s=30,
    )  # fmt: skip
    assert set(usage(served, "label:com.docker.compose.service")) >= {"trainer"}
    replicas = usage(served, "container")
    assert {f"nvdgpus-trainer-{i}" for i in range(1, 5)} <= set(replicas), replicas

    served.compose_down(project, "nvdgpus")


WAITING_SERVICE = """\
services:
  evaluator:
    image: {image}
    command: ["sleep", "600"]
    labels:
      nvidia-docker.lease.wait: "120"
    deploy:
      resources:
        reservations:
          devices: [{{driver: nvidia, count: 1, capabilities: [gpu]}}]
"""


def test_a_compose_service_labelled_to_wait_comes_up_when_another_project_goes_down(
    served: Served, tmp_path: Path
) -> None:
    if not COMPOSE.exists():
        pytest.skip(f"no Docker Compose v2 at {COMPOSE} (scripts/test-all fetches Debian 13's)")
    env = served.client_env()

    def project(name: str, text: str) -> list[str]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "compose.yaml").write_text(text.format(image=IMAGE))
        return [str(COMPOSE), "--project-directory", str(folder), "-p", name]

    every_gpu = COMPOSE_FILE.replace("replicas: 4", "replicas: 8")
    training, evaluation = project("nvdtrain", every_gpu), project("nvdeval", WAITING_SERVICE)

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(args, env=env, capture_output=True, timeout=120, check=False)

    up = run(*training, "up", "-d")
    assert up.returncode == 0, up.stderr.decode()
    waiting = subprocess.Popen(
        [*evaluation, "up", "-d"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        wait_until(lambda: len(served.table()["Waiting"]) == 1, what="the create in the queue",
                   timeout_s=30)  # fmt: skip
        assert waiting.poll() is None  # Compose waits for the create's answer
        down = run(*training, "down")
        assert down.returncode == 0, down.stderr.decode()
        _, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait(timeout=10)
    assert waiting.returncode == 0, err.decode()
    evaluator = served.ok("ps", "-q", "--filter", "label=com.docker.compose.project=nvdeval")
    assert len(evaluator.split()) == 1
    assert len(served.gpus_of(evaluator.strip())) == 1
    assert run(*evaluation, "down").returncode == 0


def usage(served: Served, by: str) -> dict[str, float]:
    """GPU-seconds per group of ``GET /usage/json?by=BY`` over the last hour."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{served.agent.port}/usage/json?by={by}&since=-1h", timeout=10
    ) as resp:
        answer = json.loads(resp.read())
    key = by.removeprefix("label:")
    return {str(row[key]): float(row["gpu_seconds"]) for row in answer["rows"]}


def test_hostile_clients_never_hurt_the_other_servers_and_bodies_are_never_logged(
    served: Served,
) -> None:
    env = served.client_env()
    endless = subprocess.Popen(  # a hijack that never ends: stdin held open, nothing sent
        ["docker", "run", "--rm", "-i", IMAGE, "cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_until(
            lambda: len(served.ok("ps", "-q").split()) == 1, what="the endless cat", timeout_s=20
        )
        slow.connect(str(served.engine_socket))
        slow.sendall(b"POST /v1.41/containers/create HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{")
        huge.connect(str(served.engine_socket))
        huge.sendall(b"POST /containers/create HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n")
        assert huge.recv(65536).startswith(b"HTTP/1.1 413 ")
        status, answer = served.agent.plugin("Plugin.Activate")
        assert status == 200, answer
        assert answer == {"Implements": ["VolumeDriver", "authz"]}
        with urllib.request.urlopen(f"{served.url}/gpu/info/json", timeout=5) as resp:
            assert resp.status == 200
        secret = "hunter2-" + os.urandom(4).hex()
        run = served.docker(
            "run", "-d", "--gpus", "1", "-e", f"TOKEN={secret}", IMAGE, "sleep", "9"
        )
        assert run.returncode == 0, run.stderr
    finally:
        slow.close()
        huge.close()
        endless.kill()
        endless.communicate(timeout=10)
    log = served.agent.log()
    assert "Serving the Docker Engine API on unix://" in log
    assert secret not in log


def post_create(path: str, body: bytes) -> tuple[bytes, dict[str, Any]]:
    """A hand-written ``POST /containers/create`` to the socket at ``path``: the status line
    and the JSON answer (read to the connection's end, which ``Connection: close`` asks)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(20)
        client.connect(path)
        client.sendall(
            b"POST /v1.41/containers/create HTTP/1.1\r\nHost: docker\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        answer = b""
        while piece := client.recv(65536):
            answer += piece
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(payload)


def test_create_keys_dockerd_reads_in_any_case_are_refused_not_passed_unleased(
    served: Served,
) -> None:
    """dockerd 20.10 takes ``hostConfig`` for ``HostConfig`` (checked here against the
    engine's own socket); through the agent's socket such a create is refused in one line
    and creates nothing, as is one with ``DeviceRequests`` at its top."""
    gpu = [{"Driver": "nvidia", "Count": 1, "Capabilities": [["gpu"]]}]
    lower = {"Image": IMAGE, "Cmd": ["true"], "hostConfig": {"DeviceRequests": gpu}}
    top = {"Image": IMAGE, "Cmd": ["true"], "DeviceRequests": gpu}
    before = served.ok("ps", "-aq").split()
    for body, said in ((lower, "spell it 'HostConfig'"), (top, "put them in its HostConfig")):
        status, answer = post_create(str(served.engine_socket), json.dumps(body).encode())
        assert status.startswith(b"HTTP/1.1 400 "), (status, answer)
        assert answer["message"].startswith("nvidia-docker: ")
        assert said in answer["message"], answer
    assert served.ok("ps", "-aq").split() == before
    assert not served.table()["Leases"]

    status, answer = post_create(served.dockerd.socket, json.dumps(lower).encode())
    assert status.startswith(b"HTTP/1.1 201 "), (status, answer)  # the engine's own: a GPU
    asked = served.ok("inspect", "-f", "{{json .HostConfig.DeviceRequests}}", answer["Id"])
    assert json.loads(asked)[0]["Count"] == 1
    served.ok("rm", answer["Id"])
