"""``nvidia-docker run|create`` with GPU leases (docs/nvidia-docker.md, "Leases"): every form
that asks (``NV_GPU=auto...``, docker's ``--gpus``), what docker gets (the lease's devices,
labels, cpuset), every refusal as one line, and the forms that keep nvidia-docker 1.0's
behaviour. The wrapper runs as a process; docker is the recording stand-in of
test_wrapper.py and the node's agent ``tests.support.lease_agent`` (the contract of
docs/leases.md, "The REST API"), on a loopback port.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.errors import GpuError
from controller.options import AutoGpus, Options, OptionsError
from controller.wrapper import docker_args
from controller.wrapper.leases import GpusFlag, Grant, lease_ask, parse_gpus_flag
from tests.support.lease_agent import GPU_UUIDS, UNITS, LeaseAgent
from tests.support.services import port_open, serve_on_loopback
from tests.unit.controller.test_wrapper import (
    GPU_LABELS,
    PODMAN,
    REPO,
    Docker,
    Result,
    docker,
    nvidia_docker,
)

__all__ = ["docker"]  # the fixture, used by name

VOLUME_ARGS = [
    "--volume-driver=nvidia-docker",
    "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro",
    "--device=/dev/nvidiactl",
    "--device=/dev/nvidia-uvm",
]
IMAGE = "nvidia/cuda:12.4"


class Node:
    """The fake agent and how the wrapper reaches it."""

    def __init__(self, agent: LeaseAgent, port: int) -> None:
        self.agent = agent
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {"NV_HOST": self.url, "DOCKER_HOST": "tcp://127.0.0.1:2375", "USER": "alice"}


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    agent = LeaseAgent()
    async with serve_on_loopback(agent.application()) as port:
        yield Node(agent, port)


async def run(docker: Docker, node: Node, *args: str, **env: str) -> Result:
    docker.image(IMAGE, GPU_LABELS)
    return await nvidia_docker(docker, *args, **{**node.env, **env})


def labels(
    lease: str, units: list[str], owner: dict[str, str], mode: str = "exclusive"
) -> list[str]:
    return [
        f"--label=nvidia-docker.lease={lease}",
        f"--label=nvidia-docker.lease.devices={','.join(units)}",
        f"--label=nvidia-docker.lease.mode={mode}",
        f"--label=nvidia-docker.lease.owner={json.dumps(owner, separators=(',', ':'))}",
    ]


OWNER = {"user": "alice", "image": IMAGE}


# --- the forms that ask ---------------------------------------------------------------------


async def test_nv_gpu_auto_asks_for_one_gpu_and_docker_gets_the_lease(
    docker: Docker, node: Node
) -> None:
    result = await run(docker, node, "run", "--rm", IMAGE, "nvidia-smi", NV_GPU="auto")
    assert result.code == 0, result.stderr
    assert result.stderr == ""
    assert node.agent.asks == [
        {"count": 1, "exclusive": True, "wait_s": 0.0, "owner": OWNER, "cpuset": True}
    ]
    assert result.executed == [
        "run",
        *VOLUME_ARGS,
        "--device=/dev/nvidia0",
        *labels("lease-1", [GPU_UUIDS[0]], OWNER),
        "--cpuset-cpus=0-7",
        "--cpuset-mems=0",
        f"--env=NVIDIA_VISIBLE_DEVICES={GPU_UUIDS[0]}",
        "--rm",
        IMAGE,
        "nvidia-smi",
    ]
    # one connection's worth: info (CUDA check), the ask, the device arguments of its Dev
    assert node.agent.requests == ["GET /gpu/info/json", "POST /leases", "GET /docker/cli"]
    assert node.agent.queries == [{"vol": "nvidia_driver", "dev": GPU_UUIDS[0]}]


async def test_auto_n_asks_for_n_and_the_next_ask_gets_other_gpus(
    docker: Docker, node: Node
) -> None:
    first = await run(docker, node, "run", IMAGE, NV_GPU="auto:2")
    assert node.agent.asks[0]["count"] == 2
    assert first.executed is not None
    assert "--device=/dev/nvidia0" in first.executed
    assert "--device=/dev/nvidia1" in first.executed
    assert "--cpuset-cpus=0-7" in first.executed
    second = await run(docker, node, "create", "--name", "job-2", IMAGE, NV_GPU="auto")
    assert second.code == 0, second.stderr
    assert node.agent.asks[1]["owner"] == {**OWNER, "name": "job-2"}
    assert second.executed is not None
    assert second.executed[0] == "create"
    assert "--device=/dev/nvidia2" in second.executed
    assert "--label=nvidia-docker.lease=lease-2" in second.executed
    cpuset = [a for a in second.executed if a.startswith("--cpuset")]
    assert cpuset == ["--cpuset-cpus=8-15", "--cpuset-mems=1"]


async def test_auto_mig_asks_for_mig_devices_of_a_profile(docker: Docker, node: Node) -> None:
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto:mig:1g.18gb:2")
    assert result.code == 0, result.stderr
    assert node.agent.asks[0]["mig_profile"] == "1g.18gb"
    assert node.agent.asks[0]["count"] == 2
    assert "devices" not in node.agent.asks[0]
    migs = [u.key for u in UNITS if u.mig is not None]
    assert node.agent.queries[0]["dev"] == " ".join(migs)
    assert result.executed is not None
    assert "--device=/dev/nvidia-caps/nvidia-cap21" in result.executed
    assert f"--env=NVIDIA_VISIBLE_DEVICES={','.join(migs)}" in result.executed
    one = await run(docker, node, "run", IMAGE, NV_GPU="auto:mig:1g.18gb")
    assert node.agent.asks[1]["count"] == 1
    assert one.code == 1  # both are leased already
    assert "has no lease for 1 MIG 1g.18gb device now: not enough free GPUs" in one.error()


@pytest.mark.parametrize(
    ("gpus", "asked"),
    [
        (["--gpus", "2"], {"count": 2}),
        (["--gpus=2"], {"count": 2}),
        (["--gpus", "count=1,capabilities=utility"], {"count": 1}),
        (["--gpus", "capabilities=compute"], {"count": 1}),  # docker's default: one
        (["--gpus", '"device=1,2"'], {"devices": "1 2"}),
        (["--gpus", "device=1,2"], {"devices": "1 2"}),  # docker needs the quotes; we do not
        (["--gpus", f"device={GPU_UUIDS[2][:8]}"], {"devices": GPU_UUIDS[2][:8]}),
        (["--gpus", '"device=3:1"'], {"devices": "3:1"}),
    ],
)
async def test_docker_s_gpus_flag_asks_and_is_replaced_by_the_lease(
    docker: Docker, node: Node, gpus: list[str], asked: dict[str, object]
) -> None:
    result = await run(docker, node, "run", "--rm", *gpus, "-e", "A=B", IMAGE, "sh")
    assert result.code == 0, result.stderr
    (ask,) = node.agent.asks
    assert {k: v for k, v in ask.items() if k in ("count", "devices")} == asked
    assert result.executed is not None
    assert not any(a.startswith("--gpus") for a in result.executed)
    assert all(a not in result.executed for a in gpus[1:])
    assert result.executed[-5:] == ["--rm", "-e", "A=B", IMAGE, "sh"]
    assert "--label=nvidia-docker.lease=lease-1" in result.executed


async def test_gpus_all_asks_for_every_healthy_gpu_by_name(docker: Docker, node: Node) -> None:
    node.agent.unhealthy[2] = "XID 79 (GPU has fallen off the bus)"
    result = await run(docker, node, "run", "--gpus", "all", IMAGE)
    assert result.code == 0, result.stderr
    assert node.agent.requests[:3] == ["GET /gpu/info/json", "GET /gpu/health/json", "POST /leases"]
    assert node.agent.asks[0]["devices"] == " ".join(GPU_UUIDS[i] for i in (0, 1, 3))
    assert result.executed is not None
    assert "--device=/dev/nvidia2" not in result.executed
    assert "--cpuset-cpus=0-7,8-15" in result.executed
    assert "--cpuset-mems=0,1" in result.executed


async def test_gpus_all_is_refused_while_any_gpu_is_taken_with_who_holds_it(
    docker: Docker, node: Node
) -> None:
    node.agent.hold("1", container="3f2a1b9c0d4e")
    result = await run(docker, node, "run", "--gpus", "all", IMAGE)
    assert result.code == 1
    assert result.executed is None
    assert result.error() == (
        f"--gpus all: {node.url} has no lease for every GPU now: devices taken: GPU 1 by "
        "container 3f2a1b9c0d4e (lease-1) since 2026-12-01T10:00:00Z; ask for other devices, "
        "for a count, or ask to wait (to wait for them in the node's queue: "
        "NV_GPU_WAIT=SECONDS, up to 600)"
    )


async def test_container_create_and_global_options_keep_their_place(
    docker: Docker, node: Node
) -> None:
    result = await run(
        docker, node, "-D", "container", "create", "--gpus=1", "--name=x", IMAGE, NV_GPU=""
    )
    assert result.code == 0, result.stderr
    assert result.executed is not None
    assert result.executed[:4] == ["-D", "container", "create", *VOLUME_ARGS[:1]]
    assert result.executed[-2:] == ["--name=x", IMAGE]


async def test_a_lease_wants_gpus_even_for_an_image_without_the_label(
    docker: Docker, node: Node
) -> None:
    """Today's images carry no com.nvidia.volumes.needed: asking is enough, and the
    container gets the driver volume too."""
    docker.image("pytorch", {"maintainer": "x"})
    result = await nvidia_docker(docker, "run", "--gpus", "1", "pytorch", **node.env)
    assert result.code == 0, result.stderr
    assert node.agent.queries == [{"vol": "", "dev": GPU_UUIDS[0]}]
    assert result.executed is not None
    assert result.executed[1:5] == VOLUME_ARGS
    assert "--gpus" not in result.executed


async def test_the_cdi_form_names_the_leased_units(docker: Docker, node: Node) -> None:
    docker.engine(PODMAN)
    result = await run(docker, node, "run", "--gpus", "2", IMAGE)
    assert result.code == 0, result.stderr
    assert node.agent.queries == [
        {"vol": "nvidia_driver", "dev": f"{GPU_UUIDS[0]} {GPU_UUIDS[1]}", "format": "cdi"}
    ]
    assert result.executed is not None
    assert result.executed[1:3] == [f"--device=nvidia.com/gpu={GPU_UUIDS[i]}" for i in (0, 1)]
    assert "--label=nvidia-docker.lease=lease-1" in result.executed


# --- cpuset ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "own",
    [["--cpuset-cpus", "2-3"], ["--cpuset-mems=1"], ["--cpuset-cpus=0", "--cpuset-mems=0"]],
)
async def test_the_user_s_own_cpuset_is_kept_and_none_is_added(
    docker: Docker, node: Node, own: list[str]
) -> None:
    result = await run(docker, node, "run", *own, IMAGE, NV_GPU="auto")
    assert result.code == 0, result.stderr
    assert node.agent.asks[0]["cpuset"] is False
    assert result.executed is not None
    assert [a for a in result.executed if a.startswith("--cpuset")] == [
        a for a in own if a.startswith("--cpuset")
    ]
    assert result.executed[-len(own) - 1 :] == [*own, IMAGE]


@pytest.mark.parametrize("value", ["no", "0", "false"])
async def test_nv_cpuset_no_turns_the_cpuset_off(docker: Docker, node: Node, value: str) -> None:
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto", NV_CPUSET=value)
    assert result.code == 0, result.stderr
    assert node.agent.asks[0]["cpuset"] is False
    assert result.executed is not None
    assert not any(a.startswith("--cpuset") for a in result.executed)
    assert "--label=nvidia-docker.lease=lease-1" in result.executed


# --- refusals -------------------------------------------------------------------------------


async def test_not_enough_free_gpus_is_one_line_naming_who_holds_what_since_when(
    docker: Docker, node: Node
) -> None:
    node.agent.hold("0", "1", container="3f2a1b9c0d4e")
    node.agent.hold("2", container="c0ffee000000", foreign="--device /dev/nvidia2")
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto:2")
    assert result.code == 1
    assert result.executed is None
    assert result.error() == (
        f"NV_GPU=auto:2: {node.url} has no lease for 2 GPUs now: not enough free GPUs: asked "
        "for 2, 0 free (none); taken: GPU 0, GPU 1 by container 3f2a1b9c0d4e (lease-1) since "
        "2026-12-01T10:00:00Z; GPU 2 by foreign container c0ffee000000 (--device /dev/nvidia2) "
        "since 2026-12-01T10:00:00Z; ask for fewer, or ask to wait (to wait for them in the "
        "node's queue: NV_GPU_WAIT=SECONDS, up to 600)"
    )
    assert node.agent.queries == []  # no device arguments asked for
    assert [c for c in docker.calls() if "run" in c] == []  # docker never ran


async def test_explicit_devices_are_checked_against_the_table(docker: Docker, node: Node) -> None:
    node.agent.hold("1", container="9a8b7c6d5e4f")
    result = await run(docker, node, "run", "--gpus", '"device=0,1"', IMAGE)
    assert result.code == 1
    assert result.error() == (
        f'--gpus "device=0,1": {node.url} has no lease for devices 0 1 now: devices taken: '
        "GPU 1 by container 9a8b7c6d5e4f (lease-1) since 2026-12-01T10:00:00Z; ask for other "
        "devices, for a count, or ask to wait (to wait for them in the node's queue: "
        "NV_GPU_WAIT=SECONDS, up to 600)"
    )
    free = await run(docker, node, "run", "--gpus", '"device=0,2"', IMAGE)
    assert free.code == 0, free.stderr


async def test_an_unhealthy_device_and_an_impossible_ask_say_so(docker: Docker, node: Node) -> None:
    node.agent.unhealthy[0] = "XID 79 (GPU has fallen off the bus)"
    sick = await run(docker, node, "run", "--gpus", "device=0", IMAGE)
    assert sick.error() == (
        f"--gpus device=0: {node.url} has no lease for devices 0 now: unhealthy device: GPU 0 "
        "unhealthy since 2026-12-01T10:00:00Z: XID 79 (GPU has fallen off the bus); choose "
        "another GPU"
    )  # no hint to wait: waiting does not heal it
    many = await run(docker, node, "run", "--gpus", "5", IMAGE, NV_GPU_WAIT="30")
    assert many.error() == (
        f"--gpus 5: {node.url} has no lease for 5 GPUs now: asked for 5 GPUs: this node has 3 "
        "GPUs to lease (in MIG mode: GPU 3; ask for a MIG profile: 1g.18gb)"
    )


async def test_a_device_the_node_does_not_have_is_the_agent_s_400(
    docker: Docker, node: Node
) -> None:
    result = await run(docker, node, "run", "--gpus", "device=9", IMAGE)
    assert result.code == 1
    assert result.error() == (
        f"--gpus device=9: {node.url} refused the ask: invalid ask: invalid device: 9 (it has "
        "GPUs 0 to 3; name indices, GPU-/MIG- UUID prefixes or <gpu>:<mig>)"
    )


async def test_an_agent_older_than_leases_is_told_apart(docker: Docker) -> None:
    agent = LeaseAgent(leases_route=False)
    async with serve_on_loopback(agent.application()) as port:
        env = {"NV_HOST": f"127.0.0.1:{port}", "DOCKER_HOST": "tcp://h:1"}
        docker.image(IMAGE, GPU_LABELS)
        result = await nvidia_docker(docker, "run", IMAGE, NV_GPU="auto:2", **env)
        plain = await nvidia_docker(docker, "run", IMAGE, NV_GPU="0", **env)
    assert result.code == 1
    assert result.error() == (
        f"NV_GPU=auto:2 asks http://127.0.0.1:{port} for a GPU lease, but its agent is older "
        "than leases (404 to POST /leases): upgrade nvidia-docker-plugin on that node, or name "
        "GPUs without a lease (NV_GPU=0,1, and no --gpus)"
    )
    assert plain.code == 0, plain.stderr  # the explicit form never asks


async def test_the_local_node_without_an_agent_cannot_lease(docker: Docker) -> None:
    if port_open(3476, "localhost"):
        pytest.skip("an agent listens on localhost:3476 here")
    docker.image(IMAGE, GPU_LABELS)
    result = await nvidia_docker(docker, "run", "--gpus", "1", IMAGE)
    assert result.code == 1
    assert result.error().startswith(
        "--gpus 1 asks the node's agent for a GPU lease, but none answers on localhost:3476 ("
    )
    assert result.error().endswith(
        "start the agent on this node (nvidia-docker-plugin), or name a GPU node's agent in "
        "NV_HOST (e.g. NV_HOST=ssh://user@gpu-node:)"
    )


async def test_an_agent_kept_out_of_the_engine_says_so_in_one_line(
    docker: Docker, node: Node
) -> None:
    """503 ``no_engine_access`` (docs/leases.md): the agent's line, not an HTTP error."""
    node.agent.denied = (
        "no GPU leases: the agent cannot reach the Docker engine at unix:///var/run/docker.sock"
        ": [Errno 13] Permission denied (this user may not use the socket: give it the "
        "socket's group)"
    )
    result = await run(docker, node, "run", "--gpus", "1", IMAGE)
    assert result.code == 1
    assert result.error() == f"--gpus 1: {node.url} has no lease for 1 GPU: {node.agent.denied}"
    assert [c for c in docker.calls() if "run" in c] == []  # docker never ran


# --- waiting --------------------------------------------------------------------------------


async def test_a_wait_is_sent_and_its_end_is_the_agent_s_408(docker: Docker, node: Node) -> None:
    node.agent.hold("0", "1", "2", container="3f2a1b9c0d4e")
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto", NV_GPU_WAIT="0.5")
    assert node.agent.asks[0]["wait_s"] == 0.5
    assert result.code == 1
    assert result.error() == (
        f"NV_GPU=auto:1: {node.url} has no lease for 1 GPU: wait-1 waited 0.5 s for 1 GPUs and "
        "got none: not enough free GPUs: asked for 1, 0 free (none); taken: GPU 0, GPU 1, "
        "GPU 2 by container 3f2a1b9c0d4e (lease-1) since 2026-12-01T10:00:00Z; ask for fewer, "
        "or ask to wait"
    )


async def test_a_waiting_ask_gets_the_gpu_a_release_frees(docker: Docker, node: Node) -> None:
    held = node.agent.hold("0", "1", "2")
    waiting = asyncio.ensure_future(
        run(docker, node, "run", IMAGE, NV_GPU="auto", NV_GPU_WAIT="30")
    )
    for _ in range(200):  # until the ask is in
        if node.agent.asks:
            break
        await asyncio.sleep(0.05)
    assert not waiting.done()
    import aiohttp  # noqa: PLC0415

    async with (
        aiohttp.ClientSession() as session,
        session.delete(f"{node.url}/leases/{held}") as released,
    ):
        assert released.status == 200
    result = await waiting
    assert result.code == 0, result.stderr
    assert result.executed is not None
    assert "--label=nvidia-docker.lease=lease-2" in result.executed


# --- sharing, failures after the grant, debug -----------------------------------------------


async def test_a_shared_lease_says_so(docker: Docker) -> None:
    agent = LeaseAgent(sharing=4)
    async with serve_on_loopback(agent.application()) as port:
        env = {"NV_HOST": f"127.0.0.1:{port}", "DOCKER_HOST": "tcp://h:1", "USER": "alice"}
        docker.image(IMAGE, GPU_LABELS)
        result = await nvidia_docker(
            docker, "run", IMAGE, NV_GPU="auto", NV_GPU_SHARED="yes", **env
        )
    assert result.code == 0, result.stderr
    assert agent.asks[0]["exclusive"] is False
    assert result.executed is not None
    assert "--label=nvidia-docker.lease.mode=shared" in result.executed
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith(
        "Warning: lease-1 is a shared lease: GPU 0 (1 of 4); other containers may use these "
        "GPUs at the same time"
    )


async def test_a_lease_the_wrapper_cannot_use_is_given_back(docker: Docker, node: Node) -> None:
    node.agent.cli_status = 500
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto")
    assert result.code == 1
    assert "the agent answered 500 to GET /docker/cli" in result.error()
    assert node.agent.released == ["lease-1"]
    assert node.agent.holders[GPU_UUIDS[0]] == []


async def test_nv_debug_shows_the_grant(docker: Docker, node: Node) -> None:
    result = await run(docker, node, "run", IMAGE, NV_GPU="auto", NV_DEBUG="1", NV_CDI="no")
    assert result.code == 0, result.stderr
    assert (
        "nvidia-docker | lease: granted lease-1 (1 GPU): GPU 0; NUMA node 0; create its "
        "container with its labels within 60 s (node asked in "
    ) in result.stderr


# --- what does not ask ----------------------------------------------------------------------


async def test_explicit_nv_gpu_and_no_selection_ask_for_no_lease(
    docker: Docker, node: Node
) -> None:
    """As in nvidia-docker 1.0: NV_GPU=0,1 and the default (every GPU) are today's behaviour."""
    explicit = await run(docker, node, "run", IMAGE, NV_GPU="0,2")
    everything = await run(docker, node, "run", IMAGE)
    assert (explicit.code, everything.code) == (0, 0)
    assert node.agent.asks == []
    assert "POST /leases" not in node.agent.requests
    assert explicit.executed is not None
    assert not any(a.startswith(("--label", "--cpuset", "--env")) for a in explicit.executed)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--gpus", "1"],
            {"NV_GPU": "0"},
            "NV_GPU=0 and --gpus 1 both choose GPUs: use one of them (unset NV_GPU, or drop "
            "--gpus)",
        ),
        (
            ["--gpus", "1"],
            {"NV_GPU": "auto:2"},
            "NV_GPU=auto:2 and --gpus 1 both choose GPUs: use one of them (unset NV_GPU, or drop "
            "--gpus)",
        ),
        (
            ["--gpus", "1", "--gpus", "2"],
            {},
            "--gpus is given 2 times: give it once (one lease per container)",
        ),
        (
            ["--gpus", "0"],
            {},
            "--gpus '0' asks for no GPU (docker reads a bare number as a count): for GPU 0 write "
            "--gpus '\"device=0\"', for one free GPU --gpus 1",
        ),
        (
            ["--gpus", "bogus=1"],
            {},
            "--gpus 'bogus=1': unexpected key 'bogus' (docker's --gpus takes N, all, count=N, "
            "device=LIST, capabilities=, driver=, options=)",
        ),
        (
            ["--gpus", "driver=amd"],
            {},
            "--gpus 'driver=amd': nvidia-docker leases NVIDIA GPUs, not driver 'amd': run docker "
            "itself for that driver",
        ),
        (
            [],
            {"NV_GPU": "auto:x"},
            "NV_GPU='auto:x' cannot be used: give auto, auto:N, auto:mig:PROFILE or "
            "auto:mig:PROFILE:N (e.g. auto:2, auto:mig:1g.18gb)",
        ),
        (
            [],
            {"NV_GPU": "auto,0"},
            "NV_GPU='auto,0' cannot be used: auto asks for a lease alone, without GPU names: give "
            "auto, auto:N, auto:mig:PROFILE or auto:mig:PROFILE:N (e.g. auto:2, auto:mig:1g.18gb)",
        ),
        (
            [],
            {"NV_GPU": "auto", "NV_GPU_WAIT": "soon"},
            "NV_GPU_WAIT='soon' cannot be used: give a number from 0 to 600",
        ),
        (
            [],
            {"NV_GPU": "auto", "NV_CPUSET": "maybe"},
            "NV_CPUSET='maybe' cannot be used: give yes or no",
        ),
    ],
)
async def test_asks_that_cannot_be_made_are_one_line_before_docker_is_asked(
    docker: Docker, node: Node, args: list[str], env: dict[str, str], message: str
) -> None:
    result = await run(docker, node, "run", *args, IMAGE, **env)
    assert result.code == 1
    assert result.error() == message
    assert docker.calls() == []  # said before docker image inspect
    assert node.agent.requests == []


# --- the pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("auto", AutoGpus(1)),
        ("AUTO:3", AutoGpus(3)),
        (" auto:mig:1g.18gb ", AutoGpus(1, "1g.18gb")),
        ("auto:mig:1c.2g.35gb:4", AutoGpus(4, "1c.2g.35gb")),
        ("0, 1", "0 1"),
        ("GPU-8f", "GPU-8f"),
        ("", ""),
    ],
)
def test_nv_gpu_forms(text: str, parsed: object) -> None:
    assert Options.build({"HOME": "/", "USER": "u", "NV_GPU": text}, command="wrapper").gpus == (
        parsed
    )


@pytest.mark.parametrize("text", ["auto:0", "auto:65", "auto:mig", "auto:mig:big", "auto:1:2"])
def test_bad_auto_forms(text: str) -> None:
    with pytest.raises(OptionsError, match="NV_GPU="):
        Options.build({"HOME": "/", "USER": "u", "NV_GPU": text}, command="wrapper")


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("all", GpusFlag(-1)),
        ("-1", GpusFlag(-1)),
        ("count=all", GpusFlag(-1)),
        ("3", GpusFlag(3)),
        ('"device=0,1",capabilities=compute', GpusFlag(0, ("0", "1"))),
        ("device=GPU-8f,MIG-1a", GpusFlag(0, ("GPU-8f", "MIG-1a"))),
        ("driver=nvidia,count=2", GpusFlag(2)),
        ("options=x", GpusFlag(1)),
    ],
)
def test_gpus_flag_as_docker_reads_it(value: str, parsed: GpusFlag) -> None:
    assert parse_gpus_flag(value) == parsed


@pytest.mark.parametrize("value", ["", "device=", "count=2,device=0", "x", "count=1,count=2"])
def test_gpus_flags_docker_refuses_too(value: str) -> None:
    with pytest.raises(GpuError, match="--gpus"):
        parse_gpus_flag(value)


def test_the_gpus_option_is_dropped_wherever_it_is() -> None:
    args = [
        "-H",
        "h",
        "run",
        "-it",
        "--gpus",
        "2",
        "--rm",
        "--gpus=all",
        "-v",
        "a:b",
        "img",
        "--gpus",
        "x",
    ]
    command = docker_args.scan(args)
    assert command.given("gpus") == 2
    assert command.with_inserted(["X"], ("gpus",)) == [
        "-H", "h", "run", "X", "-it", "--rm", "-v", "a:b", "img", "--gpus", "x",
    ]  # fmt: skip
    assert command.with_inserted(["X"]) == [*args[:3], "X", *args[3:]]


def test_owner_labels_are_cut_to_the_agent_s_bound() -> None:
    options = Options.build({"HOME": "/", "USER": "bob", "NV_GPU": "auto"}, command="wrapper")
    image = "registry.example.com/" + "x" * 200
    command = docker_args.scan(["run", "--name", "n1", image])
    ask = lease_ask(command, options)
    assert ask is not None
    assert ask.owner == (("user", "bob"), ("image", image[:128]), ("name", "n1"))


# --- the fast path stays as it was ----------------------------------------------------------


def test_pass_through_imports_nothing_of_the_lease_path() -> None:
    probe = (
        "import os, sys\n"
        "from controller.wrapper import cli as wrapper\n"
        "os.execvp = lambda *a: (_ for _ in ()).throw(SystemExit(0))\n"
        "for args in (['ps'], ['inspect', 'x'], ['run', '--help'], ['--version']):\n"
        "    try:\n"
        "        wrapper.main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('controller.wrapper.leases', 'controller.options', 'csv', 'json', 'asyncio')\n"
        "sys.stderr.write(repr(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO), "NV_GPU": "auto:2"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr == "[]"


def test_podman_s_containers_get_the_lease_as_annotations_too() -> None:
    """Podman's start hook reads annotations (a runtime config has no labels); Podman 4
    splits an annotation's value at commas, so the devices are joined by ';' there."""
    pairs = [
        arg.removeprefix("--label=").split("=", 1) for arg in labels("lease-2", ["0", "1"], OWNER)
    ]
    grant = Grant(
        lease="lease-2",
        dev="GPU-a GPU-b",
        uuids=("GPU-a", "GPU-b"),
        labels=tuple((key, value) for key, value in pairs),
        cpuset_cpus=None,
        cpuset_mems=None,
        shared=(),
        text="",
    )
    plain = grant.docker_args()
    assert not [arg for arg in plain if arg.startswith("--annotation")]
    assert grant.docker_args(annotations=True) == [
        *plain[:4],
        "--annotation=nvidia-docker.lease=lease-2",
        "--annotation=nvidia-docker.lease.devices=0;1",
        "--annotation=nvidia-docker.lease.mode=exclusive",
        *plain[4:],
    ]


# --- rootless Podman ------------------------------------------------------------------------


def _ask_as_rootless_podman(port: int, uid: int | None = None) -> Grant:
    """``ask_lease`` as the wrapper makes it for rootless Podman of ``uid`` (``rootless_uid``;
    by default this user's)."""
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415
    from controller.transport.plain_http import PlainAgentClient  # noqa: PLC0415
    from controller.wrapper.leases import LeaseAsk, ask_lease  # noqa: PLC0415

    uid = os.geteuid() if uid is None else uid
    ask = LeaseAsk("NV_GPU=auto", owner=(("user", "alice"),), rootless_podman=uid)
    with PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{port}")) as agent:
        return ask_lease(agent, ask, agent.get_json("/gpu/info/json"))


async def test_rootless_podman_gets_no_lease_from_an_agent_that_does_not_follow_it(
    node: Node, tmp_path: Path
) -> None:
    """Its containers are seen by no engine the agent follows: the lease would end when
    podman returns. Root Podman's socket (another user's) followed does not count."""
    root_podman = tmp_path / "podman.sock"
    root_podman.touch()
    os.chown(root_podman, 65534, 65534)
    for engines in ([], [{"Socket": str(root_podman), "Following": True}]):
        node.agent.engines = engines
        with pytest.raises(GpuError) as refused:
            await asyncio.to_thread(_ask_as_rootless_podman, node.port)
        assert str(refused.value).startswith(
            f"NV_GPU=auto asks for a GPU lease, but Podman runs rootless here (uid {os.geteuid()}) "
            "and the node's agent does not follow this user's containers"
        )
        assert 'NV_DOCKER="sudo podman"' in str(refused.value)
    assert node.agent.asks == []


async def test_rootless_podman_gets_a_lease_where_the_agent_follows_its_service(
    node: Node, tmp_path: Path
) -> None:
    own = tmp_path / "podman.sock"  # this user's: rootless Podman's service
    own.touch()
    node.agent.engines = [{"Socket": str(own), "Following": False}]
    with pytest.raises(GpuError):
        await asyncio.to_thread(_ask_as_rootless_podman, node.port)
    node.agent.engines = [{"Socket": str(own), "Following": True}]
    grant = await asyncio.to_thread(_ask_as_rootless_podman, node.port)
    assert grant.lease == "lease-1"
    assert len(node.agent.asks) == 1


async def test_the_users_own_dockerd_followed_does_not_hold_a_rootless_podman_lease(
    node: Node, tmp_path: Path
) -> None:
    """An agent that follows this user's rootless Docker (``--docker-socket
    /run/user/<uid>/docker.sock``: a row with dockerd's version) never sees the containers
    of the user's Podman: the lease would end when podman returns."""
    rootless_docker = tmp_path / "docker.sock"
    rootless_docker.touch()  # this user's
    node.agent.engines = [{"Socket": str(rootless_docker), "Following": True, "Version": "28.0.1"}]
    with pytest.raises(GpuError) as refused:
        await asyncio.to_thread(_ask_as_rootless_podman, node.port)
    assert "Podman runs rootless here" in str(refused.value)
    assert node.agent.asks == []


async def test_the_service_followed_must_be_that_of_the_rootless_podmans_user(
    node: Node, tmp_path: Path
) -> None:
    """``sudo -u alice podman``, a client of alice's socket: alice's Podman, whoever runs
    the wrapper; the line names alice's uid, and only alice's service followed will do."""
    service = tmp_path / "podman.sock"
    service.touch()  # the wrapper's user's (root here)
    node.agent.engines = [{"Socket": str(service), "Following": True}]
    with pytest.raises(GpuError) as refused:
        await asyncio.to_thread(_ask_as_rootless_podman, node.port, 1000)
    assert "Podman runs rootless here (uid 1000) and the node's agent" in str(refused.value)
    assert node.agent.asks == []
    os.chown(service, 1000, 1000)
    grant = await asyncio.to_thread(_ask_as_rootless_podman, node.port, 1000)
    assert grant.lease == "lease-1"


PODMAN_DOCKER = '#!/bin/sh\nexec {podman} "$@"\n'  # podman-docker's /usr/bin/docker, in short


def _podman_docker(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine whose ``docker`` is podman-docker's script, its
    ``podman`` the recording docker (named ``podman``), and the variables that make it a
    client of ``tmp_path/podman.sock`` (NV_DOCKER unset: ``docker``)."""
    from tests.unit.controller.test_wrapper import FAKE_DOCKER  # noqa: PLC0415

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    podman = bin_dir / "podman"
    podman.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_DOCKER} "$@"\n')
    docker = bin_dir / "docker"
    docker.write_text(PODMAN_DOCKER.format(podman=podman))
    for program in (podman, docker):
        program.chmod(0o755)
    return {
        "NV_DOCKER": "docker",
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CONTAINER_HOST": f"unix://{tmp_path / 'podman.sock'}",
    }


async def test_podman_docker_asking_a_users_service_gets_no_lease_the_agent_would_not_keep(
    docker: Docker, node: Node, tmp_path: Path
) -> None:
    """The whole run, as root: ``docker`` is Podman (podman-docker's script), a client of
    a user's own service (uid 1000's socket): its containers are that user's, which the
    agent does not follow. One line naming uid 1000; nothing leased, no container made."""
    env = _podman_docker(tmp_path)
    service = tmp_path / "podman.sock"
    service.touch()
    os.chown(service, 1000, 1000)
    result = await run(docker, node, "run", "-d", IMAGE, NV_GPU="auto", **env)
    assert result.code == 1, result.stderr
    assert result.error().startswith(
        "NV_GPU=auto:1 asks for a GPU lease, but Podman runs rootless here (uid 1000) and the "
        "node's agent does not follow this user's containers"
    ), result.stderr
    assert result.executed is None
    assert node.agent.asks == []
    node.agent.engines = [{"Socket": str(service), "Following": True}]
    result = await run(docker, node, "run", "-d", IMAGE, NV_GPU="auto", **env)
    assert result.code == 0, result.stderr
    assert result.executed is not None
    assert "--label=nvidia-docker.lease=lease-1" in result.executed


async def test_a_refused_lease_pulls_no_image_first(
    docker: Docker, node: Node, tmp_path: Path
) -> None:
    """The image is not here: the refusal that the agent on loopback can tell comes before
    docker pulls it (gigabytes, at times, for a run that is then refused)."""
    env = _podman_docker(tmp_path)
    service = tmp_path / "podman.sock"
    service.touch()
    os.chown(service, 1000, 1000)  # a user's service, which the agent does not follow
    docker.image("nvidia/cuda", GPU_LABELS, in_registry=True)
    result = await run(docker, node, "run", "-d", "nvidia/cuda", NV_GPU="auto", **env)
    assert result.code == 1, result.stderr
    assert "Podman runs rootless here (uid 1000)" in result.error(), result.stderr
    assert not [call for call in docker.calls() if "pull" in call]
    assert node.agent.asks == []


async def test_podman_docker_asking_roots_service_gets_its_lease(
    docker: Docker, node: Node, tmp_path: Path
) -> None:
    env = _podman_docker(tmp_path)
    (tmp_path / "podman.sock").touch()  # root's
    result = await run(docker, node, "run", "-d", IMAGE, NV_GPU="auto", **env)
    assert result.code == 0, result.stderr
    assert node.agent.requests[:2] == ["GET /gpu/info/json", "POST /leases"]


# --- the engine docker runs on, as the agent sees it ----------------------------------------


async def test_an_agent_of_another_machine_refuses_a_lease_for_a_dockerd_it_does_not_follow(
    node: Node, tmp_path: Path
) -> None:
    """``NV_HOST`` names a node's agent, but docker creates the container on this machine's
    dockerd (no ``DOCKER_HOST`` for that node): the engine's ``ID`` is not one the agent
    follows, so the lease would end when docker returns. The node's own dockerd, reached
    here through a forwarded socket, says the ``ID`` the agent follows."""
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415
    from controller.transport.plain_http import PlainAgentClient  # noqa: PLC0415
    from controller.wrapper.docker_args import scan  # noqa: PLC0415
    from controller.wrapper.gpu_args import CdiChoice, _refuse_an_unfollowed_engine  # noqa: PLC0415
    from controller.wrapper.leases import LeaseAsk  # noqa: PLC0415
    from tests.support.fake_engine import FakeEngine, json_answer  # noqa: PLC0415

    nodes = "5b0f3a4e-9d2c-4c1e-8f7a-2d6b1e0c9a37"
    node.agent.boot = "another-machine"
    node.agent.engines = [
        {"Socket": "/var/run/docker.sock", "Following": True, "Version": "26.1.5", "ID": nodes}
    ]
    engine = FakeEngine(tmp_path / "docker.sock")
    engine.answers["/info"] = json_answer({"ID": "0e1d2c3b-4a59-4687-9a1b-c2d3e4f5a6b7"})
    await engine.start()

    def check() -> None:
        options = Options.build({"PATH": os.environ["PATH"]}, command="wrapper")
        cdi = CdiChoice(options, scan(["run", IMAGE]), None, lease_engine=str(engine.socket_path))
        with PlainAgentClient(parse_endpoint(node.url)) as agent:
            _refuse_an_unfollowed_engine(agent, LeaseAsk("NV_GPU=auto:1"), cdi)

    try:
        node.agent.engines = []  # an agent that lists no engine cannot say: nothing asked
        await asyncio.to_thread(check)
        assert engine.requests == []
        node.agent.engines = [
            {"Socket": "/var/run/docker.sock", "Following": True, "Version": "26.1.5", "ID": nodes}
        ]
        with pytest.raises(GpuError) as refused:
            await asyncio.to_thread(check)
        assert str(refused.value).startswith(
            f"NV_GPU=auto:1 asks for a GPU lease, but docker runs its containers on the engine "
            f"at unix://{engine.socket_path} (ID 0e1d2c3b-4a59-4687-9a1b-c2d3e4f5a6b7), which "
            f"the agent of {node.url} does not follow (it follows "
            f"/var/run/docker.sock (ID {nodes}))"
        ), refused.value
        engine.answers["/info"] = json_answer({"ID": nodes})  # the node's dockerd, forwarded
        await asyncio.to_thread(check)
        assert engine.requests == ["/info", "/info"]  # asked once a run
    finally:
        await engine.stop()
