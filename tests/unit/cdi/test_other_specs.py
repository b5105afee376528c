"""Reading the other specs of the spec directories: YAML and JSON, ours left out, and what a
hostile directory holds neither blocks nor exhausts the reader."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from agent.cdi_spec import other_specs
from agent.cdi_spec.other_specs import OtherSpecs

TOOLKIT_YAML = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
"""


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    etc, run, own = tmp_path / "etc-cdi", tmp_path / "run-cdi", tmp_path / "state-cdi"
    for directory in (etc, run, own):
        directory.mkdir()
    return etc, run, own


def reader(etc: Path, run: Path, own: Path) -> OtherSpecs:
    return OtherSpecs((etc, run, own), own / "nvidia-docker.json")


def test_yaml_and_json_specs_are_read_ours_and_links_to_ours_are_not(
    dirs: tuple[Path, Path, Path],
) -> None:
    etc, run, own = dirs
    (own / "nvidia-docker.json").write_text(json.dumps({"kind": "nvidia.com/gpu"}))
    (run / "nvidia-docker.json").symlink_to(own / "nvidia-docker.json")  # the packaged link
    (run / "nvidia.yaml").write_text(TOOLKIT_YAML)
    (etc / "other.json").write_text(json.dumps({"kind": "x.com/y", "devices": [{"name": "a"}]}))
    (etc / "notes.txt").write_text("kind: nvidia.com/gpu\n")  # engines read *.json, *.yaml only
    found = reader(etc, run, own)
    specs = sorted(found.read(), key=lambda s: s.path)
    assert [(s.path, s.directory, s.kind, s.names) for s in specs] == [
        (str(etc / "other.json"), str(etc), "x.com/y", frozenset({"a"})),
        (str(run / "nvidia.yaml"), str(run), "nvidia.com/gpu", frozenset({"0", "all"})),
    ]
    assert found.our_directories() == {str(own), str(run)}  # where ours, and its link, are


def test_a_change_is_seen_by_the_cheap_question(dirs: tuple[Path, Path, Path]) -> None:
    etc, run, own = dirs
    found = reader(etc, run, own)
    assert found.read() == ()
    assert not found.changed()
    (run / "nvidia.yaml").write_text(TOOLKIT_YAML)
    assert found.changed()
    assert len(found.read()) == 1
    assert not found.changed()
    (own / "nvidia-docker.json").write_text("{}")  # ours changes at every rewrite: not a change
    assert not found.changed()
    (run / "nvidia.yaml").unlink()
    assert found.changed()
    assert found.read() == ()


def test_a_file_read_once_is_not_read_again_until_it_changes(
    dirs: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    etc, run, own = dirs
    (run / "nvidia.yaml").write_text(TOOLKIT_YAML)
    found = reader(etc, run, own)
    assert len(found.read()) == 1
    reads: list[Path] = []
    original = other_specs._read_regular

    def counted(path: Path, stamp: tuple[int, int, int, int]) -> bytes:
        reads.append(path)
        return original(path, stamp)

    monkeypatch.setattr(other_specs, "_read_regular", counted)
    assert len(found.read()) == 1
    assert reads == []
    os.utime(run / "nvidia.yaml", ns=(1, 1))
    assert len(found.read()) == 1
    assert reads == [run / "nvidia.yaml"]


def test_what_is_not_a_readable_spec_defines_nothing_and_nothing_blocks(
    dirs: tuple[Path, Path, Path],
) -> None:
    etc, run, own = dirs
    os.mkfifo(run / "fifo.yaml")  # opening it would block: never opened
    (run / "zero.json").symlink_to("/dev/zero")  # endless: never opened
    (run / "dir.yaml").mkdir()
    (run / "dangling.yaml").symlink_to(run / "nowhere")
    (run / "broken.yaml").write_text("kind: [unclosed\n")
    (run / "tabs.json").write_text('{\t"kind":\t"nvidia.com/gpu", "devices": [{"name": "7"}]}')
    (run / "deep.yaml").write_text("[" * 5000 + "]" * 5000)
    (run / "big.yaml").write_bytes(b"#" * (other_specs.MAX_OTHER_BYTES + 1))
    aliases = "a: &a [" + ", ".join(["x"] * 100) + "]\n"
    aliases += "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}]\n" for i in range(50))
    (run / "bomb.yaml").write_text(aliases + "kind: nvidia.com/gpu\ndevices: [*b49]\n")
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(reader(etc, run, own).read()))
    started = time.monotonic()
    worker.start()
    worker.join(timeout=20)
    assert done, "the read did not finish"
    assert time.monotonic() - started < 20
    (result,) = done
    assert isinstance(result, tuple)
    kinds = {spec.path.rsplit("/", 1)[1]: spec.names for spec in result}
    assert kinds == {"tabs.json": frozenset({"7"}), "bomb.yaml": frozenset()}


def test_a_crowded_directory_is_read_within_its_bound(
    dirs: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    etc, run, own = dirs
    for i in range(other_specs.MAX_FILES + 10):
        (run / f"spec-{i:03}.json").write_text(json.dumps({"kind": "x.com/y"}))
    found = reader(etc, run, own)
    assert len(found.read()) == other_specs.MAX_FILES
    assert f"more than {other_specs.MAX_FILES} spec files" in caplog.text
    found.read()
    assert caplog.text.count("more than") == 1  # said once
