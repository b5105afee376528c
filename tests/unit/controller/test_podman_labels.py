"""A Podman image's labels remembered while its store is unchanged
(``controller.wrapper.podman_labels``).

The store here is the directory layout Podman (containers/storage) keeps, with an
``images.json`` this test replaces the way Podman does (a new file renamed over it), and
the ``podman`` a real ELF program compiled here; what real Podman prints and changes is
checked in ``tests/e2e/test_podman_labels.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from controller.wrapper import podman_labels
from controller.wrapper.podman_labels import Memory
from tests.unit.controller.cli_program import cli_program

LAYER = "84ff92691f909a05b224e1c56abb4864f01b4f8e3c854e4bb4c7baf1d3f6d652"
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}


class Node:
    """A Podman program, a store, and the environment the wrapper gets."""

    def __init__(self, tmp: Path) -> None:
        self.bin = tmp / "bin"
        self.bin.mkdir(parents=True)
        cli_program(self.bin / "podman", "podman version 4.3.1", tmp / "calls")
        self.store = tmp / "storage"
        self.make_store()
        self.environment = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "XDG_CACHE_HOME": str(tmp / "cache"),
            "XDG_CONFIG_HOME": str(tmp / "config"),
        }
        self.docker: tuple[str, ...] = ("podman", "--root", str(self.store))

    def make_store(self) -> None:
        (self.store / "overlay" / LAYER / "diff").mkdir(parents=True)
        (self.store / "overlay-images").mkdir()
        self.replace_images('{"images": []}')

    def replace_images(self, text: str) -> None:
        """What Podman does to ``images.json`` at a pull, tag or removal."""
        images = self.store / "overlay-images" / "images.json"
        new = images.with_name("images.json.new")
        new.write_text(text)
        new.replace(images)

    def printed(self, labels: dict[str, str] | None, driver: object = None) -> str:
        """``podman image inspect --format FORMAT``'s answer for an image of this store."""
        upper = str(self.store / "overlay" / LAYER / "diff")
        graph = driver if driver is not None else {"Name": "overlay", "Data": {"UpperDir": upper}}
        return f"{json.dumps(labels)}\n{json.dumps(graph)}\n"

    def memory(self, *global_args: str, **environment: str) -> Memory:
        found = Memory.open(self.docker, global_args, {**self.environment, **environment})
        assert found is not None
        return found

    def run(self, image: str, labels: dict[str, str] | None) -> tuple[str, dict[str, str]]:
        """One wrapper run: where the labels came from, and what they were."""
        memory = self.memory()
        known = memory.recall(image)
        if known is not None:
            return "remembered", known
        return "inspected", memory.learn(image, self.printed(labels))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_labels_are_remembered_from_the_second_inspect_on(node: Node) -> None:
    seen = [node.run("cuda:12.4", GPU_LABELS) for _ in range(4)]
    # the first run learns where the store is; the second remembers what it inspected
    assert [source for source, _ in seen] == ["inspected", "inspected", "remembered", "remembered"]
    assert all(labels == GPU_LABELS for _, labels in seen)
    assert node.run("plain", None) == ("inspected", {})  # another name: asked
    assert node.run("plain", None) == ("remembered", {})  # an image without labels too


def test_any_change_of_the_image_store_asks_again(node: Node) -> None:
    for _ in range(3):
        node.run("cuda:12.4", GPU_LABELS)
    node.replace_images('{"images": ["retagged"]}')  # podman tag plain cuda:12.4
    assert node.run("cuda:12.4", None) == ("inspected", {})  # the new image's labels
    assert node.run("cuda:12.4", None) == ("remembered", {})


def test_a_store_changed_while_podman_answered_is_not_remembered(node: Node) -> None:
    node.run("cuda:12.4", GPU_LABELS)  # the store learnt
    memory = node.memory()
    assert memory.recall("cuda:12.4") is None
    node.replace_images('{"images": ["pulled meanwhile"]}')
    assert memory.learn("cuda:12.4", node.printed(GPU_LABELS)) == GPU_LABELS
    assert node.memory().recall("cuda:12.4") is None  # asked again: the answer may be old


def test_a_settings_file_or_another_store_option_is_another_memory(node: Node) -> None:
    storage_conf = Path(node.environment["XDG_CONFIG_HOME"]) / "containers" / "storage.conf"
    for _ in range(3):
        node.run("cuda:12.4", GPU_LABELS)
    assert node.memory().recall("cuda:12.4") == GPU_LABELS
    assert node.memory("--storage-driver", "vfs").recall("cuda:12.4") is None
    assert node.memory(CONTAINERS_STORAGE_CONF="/etc/other.conf").recall("cuda:12.4") is None
    storage_conf.parent.mkdir(parents=True)
    storage_conf.write_text('[storage]\ndriver = "overlay"\n')  # the user's own storage.conf
    assert node.memory().recall("cuda:12.4") is None


def test_the_memory_file_is_kept_for_the_user_and_bounded(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podman_labels, "MAX_IMAGES", 2)
    for image in ("a", "b", "c"):
        node.run(image, {"name": image})
        node.run(image, {"name": image})
    path = Path(node.environment["XDG_CACHE_HOME"]) / "nvidia-docker" / "podman-labels.json"
    assert path.stat().st_mode & 0o777 in (0o600, 0o644)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert node.run("c", None) == ("remembered", {"name": "c"})
    assert node.run("a", None)[0] == "inspected"  # the oldest went
    path.write_text("{not json")  # a damaged file is no memory, and no failure
    assert node.run("c", {"name": "c"}) == ("inspected", {"name": "c"})


def test_a_drop_in_edited_in_place_is_another_memory(node: Node) -> None:
    drop_ins = Path(node.environment["XDG_CONFIG_HOME"]) / "containers" / "storage.conf.d"
    drop_ins.mkdir(parents=True)
    settings = drop_ins / "10-store.conf"
    settings.write_text('[storage]\ndriver = "overlay"\n')
    for _ in range(3):
        node.run("cuda:12.4", GPU_LABELS)
    assert node.memory().recall("cuda:12.4") == GPU_LABELS
    with settings.open("a") as edit:  # the same file, the directory's list as it was
        edit.write('graphroot = "/srv/containers/storage"\n')
    assert node.memory().recall("cuda:12.4") is None


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("containers.conf", "[engine]\nremote = true\n"),
        ("containers.conf.d/50-remote.conf", "[engine]\n  remote=true # the service\n"),
    ],
)
def test_a_podman_made_remote_by_its_settings_is_never_remembered(
    node: Node, where: str, text: str
) -> None:
    settings = Path(node.environment["XDG_CONFIG_HOME"]) / "containers" / where
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(text.replace("true", "false"))
    for _ in range(3):
        node.run("cuda:12.4", GPU_LABELS)
    assert node.memory().recall("cuda:12.4") == GPU_LABELS  # remote = false: a local Podman
    settings.write_text(text)
    assert Memory.open(node.docker, (), node.environment) is None
    named = Path(node.environment["XDG_CONFIG_HOME"]).parent / "named.conf"  # by a variable
    named.write_text(text)
    settings.unlink()
    assert Memory.open(node.docker, (), node.environment) is not None
    assert Memory.open(node.docker, (), {**node.environment, "CONTAINERS_CONF": str(named)}) is None


@pytest.mark.parametrize(
    ("docker", "environment"),
    [
        (("podman-remote",), {}),
        (("podman", "--remote"), {}),
        (("podman", "--connection=build"), {}),
        (("podman", "-c", "build"), {}),
        (("podman", "--url", "unix:///run/podman/podman.sock"), {}),
        (("podman", "-H", "ssh://root@gpu7/run/podman/podman.sock"), {}),
        (("podman", "--host=tcp://gpu7:8080"), {}),
        (("podman", "--context", "default"), {}),
        (("podman",), {"CONTAINER_HOST": "ssh://root@gpu7/run/podman/podman.sock"}),
        (("sudo", "podman"), {}),
        (("docker",), {}),
    ],
)
def test_a_remote_or_indirect_podman_is_never_remembered(
    node: Node, docker: tuple[str, ...], environment: dict[str, str]
) -> None:
    assert Memory.open(docker, (), {**node.environment, **environment}) is None


def test_nothing_is_remembered_without_a_home_or_for_a_script(node: Node, tmp_path: Path) -> None:
    assert Memory.open(node.docker, (), {"PATH": node.environment["PATH"]}) is None
    script = tmp_path / "scripts" / "podman"
    script.parent.mkdir()
    script.write_text('#!/bin/sh\nexec /usr/bin/podman "$@"\n')
    script.chmod(0o755)
    assert Memory.open((str(script),), (), node.environment) is None


@pytest.mark.parametrize(
    "driver",
    [
        {"Name": "vfs", "Data": None},  # no UpperDir: nothing says where the store is
        {"Name": "overlay", "Data": {"UpperDir": "relative/overlay/x/diff"}},
        {"Name": "btrfs", "Data": {"UpperDir": "/var/lib/containers/storage/overlay/x/diff"}},
        {"Name": "overlay", "Data": {"UpperDir": "/nowhere/overlay/x/diff"}},
        "not an object",
    ],
)
def test_a_store_that_cannot_be_found_is_not_remembered(node: Node, driver: object) -> None:
    for _ in range(3):
        memory = node.memory()
        assert memory.recall("cuda:12.4") is None
        assert memory.learn("cuda:12.4", node.printed(GPU_LABELS, driver)) == GPU_LABELS


def test_a_store_of_another_user_is_not_remembered(node: Node) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(node.store, 65534, 65534)
    for _ in range(3):
        assert node.run("cuda:12.4", GPU_LABELS)[0] == "inspected"


def test_an_answer_without_the_store_line_still_gives_the_labels(node: Node) -> None:
    memory = node.memory()
    assert memory.learn("cuda:12.4", json.dumps(GPU_LABELS)) == GPU_LABELS
    assert memory.learn("cuda:12.4", "null\n{broken") == {}
    with pytest.raises(ValueError, match="not a mapping"):
        memory.learn("cuda:12.4", '["a"]\n{}')


def test_a_relative_store_option_is_remembered_per_directory(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``podman --root storage``: two directories, two stores, never the other's labels."""
    first, second = node.store, tmp_path / "elsewhere" / "storage"
    node.docker = ("podman", "--root", "storage")
    for store, labels in ((first, GPU_LABELS), (second, {"plain": "yes"})):
        node.store = store
        if not store.exists():
            node.make_store()
        monkeypatch.chdir(store.parent)
        assert [node.run("cuda:12.4", labels)[0] for _ in range(3)] == [
            "inspected", "inspected", "remembered",
        ]  # fmt: skip
    monkeypatch.chdir(first.parent)
    assert node.memory().recall("cuda:12.4") == GPU_LABELS
    monkeypatch.chdir(second.parent)
    assert node.memory().recall("cuda:12.4") == {"plain": "yes"}


def test_a_one_word_podman_is_one_memory_wherever_it_runs(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.docker = ("podman",)
    for _ in range(3):
        node.run("cuda:12.4", GPU_LABELS)
    monkeypatch.chdir(tmp_path)
    assert node.memory().recall("cuda:12.4") == GPU_LABELS
