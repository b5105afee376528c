"""Container ids read off cgroup paths, in the formats the runtimes really write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.attribution.cgroup import HOST, UNKNOWN, CgroupPlace, OwnerKind, place_of, read_place

ID = "8f3c2b1a" * 8  # 64 hex
OTHER = "0123abcd" * 8


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v1, Docker's cgroupfs driver: one line per hierarchy
        f"12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n0::/\n",
        # cgroup v2, cgroupfs driver
        f"0::/docker/{ID}\n",
        # cgroup v2, systemd driver (Docker's default on systemd hosts with cgroup v2)
        f"0::/system.slice/docker-{ID}.scope\n",
        # cgroup v1, systemd driver: the session line says nothing, the others do
        f"4:memory:/system.slice/docker-{ID}.scope\n1:name=systemd:/user.slice/session-3.scope\n",
        # a Docker container of a Kubernetes pod (dockershim, systemd driver)
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e.slice/"
        f"docker-{ID}.scope\n",
        # v2 with a sub-cgroup inside the container's
        f"0::/docker/{ID}/init\n",
    ],
)
def test_docker_container(text: str) -> None:
    assert place_of(text) == CgroupPlace(OwnerKind.DOCKER, container_id=ID)


def test_docker_in_docker_names_the_outer_container() -> None:
    """The outer container is the one this node's engine knows."""
    assert place_of(f"0::/docker/{ID}/docker/{OTHER}\n").container_id == ID


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # Docker in Docker, the node's dockerd with the systemd driver (cgroup v2's default),
        # the inner one with cgroupfs: the inner id is unknown to the node's dockerd
        (f"0::/system.slice/docker-{ID}.scope/docker/{OTHER}\n", OwnerKind.DOCKER),
        (f"0::/system.slice/docker-{ID}.scope/system.slice/docker-{OTHER}.scope\n",
         OwnerKind.DOCKER),
        # Docker inside a Podman container: Podman's container, not a Docker one
        (f"0::/machine.slice/libpod-{ID}.scope/container/docker/{OTHER}\n", OwnerKind.PODMAN),
        # Podman inside a Docker container
        (f"0::/docker/{ID}/libpod_parent/libpod-{OTHER}\n", OwnerKind.DOCKER),
    ],
)  # fmt: skip
def test_nested_containers_are_the_outer_one(text: str, kind: OwnerKind) -> None:
    assert place_of(text) == CgroupPlace(kind, container_id=ID)


@pytest.mark.parametrize(
    "text",
    [f"0::/system.slice/docker-{ID}.scope (deleted)\n", f"0::/docker/{ID} (deleted)\n"],
)
def test_a_removed_cgroup_still_names_its_container(text: str) -> None:
    """cgroup v2 marks the path of a removed cgroup (an exited process's container, gone):
    the process is the container's, not the host's."""
    assert place_of(text) == CgroupPlace(OwnerKind.DOCKER, container_id=ID)


@pytest.mark.parametrize(
    "text",
    [
        f"0::/machine.slice/libpod-{ID}.scope/container\n",
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n",
        f"5:memory:/libpod_parent/libpod-{ID}\n",
    ],
)
def test_podman_container(text: str) -> None:
    assert place_of(text) == CgroupPlace(OwnerKind.PODMAN, container_id=ID)


def test_podman_monitor_is_not_the_container() -> None:
    assert place_of(f"0::/machine.slice/libpod-conmon-{ID}.scope\n") == HOST


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # Kubernetes with containerd (CRI), systemd driver
        (
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod3c1d.slice/"
            f"cri-containerd-{ID}.scope\n",
            OwnerKind.CONTAINERD,
        ),
        # nerdctl (containerd without Kubernetes), systemd driver
        (f"0::/system.slice/nerdctl-{ID}.scope\n", OwnerKind.CONTAINERD),
        # Kubernetes with CRI-O, cgroup v1
        (
            f"4:memory:/kubepods.slice/kubepods-pod9a8b.slice/crio-{ID}.scope\n"
            "1:name=systemd:/system.slice/kubelet.service\n",
            OwnerKind.CRIO,
        ),
        # Kubernetes, cgroupfs driver: the path names the pod, not the runtime
        (f"0::/kubepods/burstable/pod1f2e3d4c-aaaa-bbbb-cccc-0123456789ab/{ID}\n",
         OwnerKind.KUBERNETES),
        (f"0::/kubepods/pod1f2e3d4c-aaaa-bbbb-cccc-0123456789ab/{ID}\n", OwnerKind.KUBERNETES),
    ],
)  # fmt: skip
def test_other_runtimes_are_containers_not_the_host(text: str, kind: OwnerKind) -> None:
    assert place_of(text) == CgroupPlace(kind, container_id=ID)


def test_cri_o_monitor_is_not_the_container() -> None:
    assert place_of(f"0::/system.slice/crio-conmon-{ID}.scope\n") == HOST


@pytest.mark.parametrize(
    ("text", "container"),
    [
        # cgroup v1, the cgroups isolators: every hierarchy under --cgroups_root=mesos
        (
            "11:memory:/mesos/6b4a3f7e-2d1c-4e9a-9c1b-6f0d2a7e5c31\n"
            "5:devices:/mesos/6b4a3f7e-2d1c-4e9a-9c1b-6f0d2a7e5c31\n"
            "1:name=systemd:/mesos_executors.slice\n",
            "6b4a3f7e-2d1c-4e9a-9c1b-6f0d2a7e5c31",
        ),
        # a task of a task group: a nested container, written parent.child
        ("4:memory:/mesos/parent-id/mesos/child-id\n", "parent-id.child-id"),
        # cgroup v2 layout, with the leaf the agent keeps processes in
        ("0::/mesos/6b4a3f7e/leaf\n", "6b4a3f7e"),
    ],
)
def test_mesos_container(text: str, container: str) -> None:
    assert place_of(text) == CgroupPlace(OwnerKind.MESOS, mesos_container=container)


@pytest.mark.parametrize(
    "text",
    [
        "0::/\n",
        "0::/user.slice/user-0.slice/session-1.scope\n",
        "0::/system.slice/nvidia-persistenced.service\n",
        "1:name=systemd:/mesos_executors.slice\n0::/\n",  # the executor slice is not a task
        f"0::/docker/{ID[:12]}\n",  # a short id is not Docker's cgroup
        "0::/system.slice/docker.service\n",  # dockerd itself
    ],
)
def test_host(text: str) -> None:
    assert place_of(text) == HOST


def test_empty_file_means_the_process_is_exiting() -> None:
    assert place_of("") == UNKNOWN


def test_a_live_process_is_placed_from_the_real_proc() -> None:
    assert read_place(os.getpid()).kind is not OwnerKind.UNKNOWN


def test_vanished_process_is_unknown() -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(child.stdout)  # it has exited and been reaped
    assert not Path(f"/proc/{pid}").exists()
    assert read_place(pid) == UNKNOWN


def test_unreadable_proc_root_is_unknown(tmp_path: Path) -> None:
    assert read_place(1, proc=tmp_path) == UNKNOWN


def _fake_proc(tmp_path: Path, cgroup: str, flags: int) -> Path:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(cgroup)
    (tmp_path / "4242" / "stat").write_text(
        f"4242 (python3 (x)) S 1 4242 4242 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 100\n"
    )
    return tmp_path


V1_AS_EXITING = "12:memory:/\n4:devices:/\n1:name=systemd:/\n"


def test_an_exiting_cgroup_v1_process_is_unknown_not_the_host(tmp_path: Path) -> None:
    """Under cgroup v1 the kernel shows every line of an exiting process (PF_EXITING, still
    closing its GPU) as ``/``: that says nothing of its container."""
    proc = _fake_proc(tmp_path, V1_AS_EXITING, 0x400104)  # PF_EXITING among others
    assert read_place(4242, proc) == UNKNOWN


def test_a_cgroup_v1_process_in_the_root_cgroups_is_the_hosts(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, V1_AS_EXITING, 0x400100)
    assert read_place(4242, proc) == HOST
