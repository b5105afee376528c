"""A node file is read within bounds: a regular file only, never blocking, at most
``MAX_BYTES``, ``MAX_DEPTH`` levels and ``MAX_DEVICES`` devices, UTF-8, RFC 8259 JSON; every
failure one line. The simulated backend and the daemon's ``SimulatedModule`` keep what the
file said before a bad version and take the next good one; the GPU worker's event thread
outlives any failure of its watch (one line, a pause that grows, and it watches again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import nodefile, worker
from agent.gpu import worker_protocol as wp
from agent.gpu.health import DOUBLE_BIT_ECC, XID, HealthEvent
from agent.gpu.simulated import SimulatedBackend
from agent.gpu.worker_client import WorkerClient
from agent.node.drivers import SimulatedModule
from tests.support.prerequisites import require_root

DEEP = 100_000


def builtin(name: str = "h200") -> dict[str, Any]:
    data: dict[str, Any] = json.loads(nodefile.resolve(name).read_text(encoding="utf-8"))
    data.pop("timing", None)
    return data


def node_bytes(data: dict[str, Any], comment: bytes) -> bytes:
    """``data`` as JSON whose ``comment`` is the raw bytes ``comment``."""
    text = json.dumps({k: v for k, v in data.items() if k != "comment"}).encode()
    return b'{"comment": ' + comment + b", " + text[1:]


def rewrite(path: Path, data: dict[str, Any]) -> None:
    """A new version of the file renamed into place (a directory there is removed first)."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    staged = path.with_name(path.name + ".new")
    staged.write_text(json.dumps(data))
    os.replace(staged, path)


# -- the hostile kinds -----------------------------------------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # no writer: a blocking open would wait forever


def _directory(path: Path) -> None:
    path.mkdir()


def _dev_zero_link(path: Path) -> None:
    os.symlink("/dev/zero", path)


def _character_device(path: Path) -> None:
    require_root()
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # endless zeros


def _sparse(path: Path) -> None:
    with path.open("wb") as out:
        out.truncate(20 * 1000**3)


def _oversized(path: Path) -> None:
    path.write_bytes(node_bytes(builtin(), b'"' + b"x" * nodefile.MAX_BYTES + b'"'))


def _deep_arrays(path: Path) -> None:
    path.write_bytes(b"[" * DEEP + b"]" * DEEP)


def _deep_objects(path: Path) -> None:
    path.write_bytes(b'{"a":' * DEEP + b"0" + b"}" * DEEP)


def _not_utf8(path: Path) -> None:
    path.write_bytes(node_bytes(builtin(), b'"caf\xe9"'))


def _utf16(path: Path) -> None:
    path.write_bytes(json.dumps(builtin()).encode("utf-16"))


def _long_number(path: Path) -> None:
    path.write_bytes(node_bytes(builtin(), b"9" * 5000))


def _nan(path: Path) -> None:
    path.write_bytes(node_bytes(builtin(), b"NaN"))


def _infinite_timing(path: Path) -> None:
    path.write_bytes(
        json.dumps(builtin()).encode()[:-1] + b', "timing": {"status_call_s": Infinity}}'
    )


def _too_many_devices(path: Path) -> None:
    data = builtin()
    device = data["devices"][0]
    data["devices"] = [
        {**device, "pci": {**device["pci"], "bus_id": f"00000000:{n:02X}:00.0"}, "topology": []}
        for n in range(nodefile.MAX_DEVICES + 1)
    ]
    path.write_text(json.dumps(data))


# (id, make it at a path where nothing is, what the one line says after "node file <path>")
HOSTILE: list[tuple[str, Callable[[Path], None], str]] = [
    ("fifo", _fifo, " is a FIFO, not a regular file"),
    ("directory", _directory, " is a directory, not a regular file"),
    ("dev-zero-link", _dev_zero_link, " is a character device, not a regular file"),
    ("character-device", _character_device, " is a character device, not a regular file"),
    ("sparse-20-GB", _sparse, " is 20.0 GB, more than the 1.0 MiB it may be"),
    ("over-the-bound", _oversized, " is 1.0 MiB, more than the 1.0 MiB it may be"),
    ("deep-arrays", _deep_arrays, ": nested deeper than 32 levels"),
    ("deep-objects", _deep_objects, ": nested deeper than 32 levels"),
    ("not-utf-8", _not_utf8, ": not UTF-8 (byte 16)"),
    ("utf-16", _utf16, ": not UTF-8 (byte 0)"),
    ("long-number", _long_number, ": not JSON (a number of more than 4300 digits)"),
    ("nan", _nan, ": not JSON (NaN is not a JSON number)"),
    ("infinite-timing", _infinite_timing, ": not JSON (Infinity is not a JSON number)"),
    ("too-many-devices", _too_many_devices, ": devices: 65 devices, more than the 64"),
]
IDS = [name for name, _, _ in HOSTILE]


def place(make: Callable[[Path], None], path: Path) -> None:
    """Make a hostile thing beside ``path`` and rename it into place."""
    staged = path.with_name(path.name + ".hostile")
    make(staged)
    if staged.is_dir() and not staged.is_symlink():
        path.unlink(missing_ok=True)
    os.replace(staged, path)


@pytest.mark.parametrize(("make", "says"), [(m, s) for _, m, s in HOSTILE], ids=IDS)
def test_a_hostile_node_file_is_refused_in_one_line(
    tmp_path: Path, make: Callable[[Path], None], says: str
) -> None:
    path = tmp_path / "node.json"
    make(path)
    with pytest.raises(nodefile.NodeFileError) as err:
        nodefile.load(str(path))
    message = str(err.value)
    assert message.startswith(f"node file {path}{says}"), message
    assert "\n" not in message
    assert len(message) < 300


def test_a_missing_node_file_still_names_the_built_in_nodes(tmp_path: Path) -> None:
    with pytest.raises(nodefile.NodeFileError, match=r"not found \(built-in nodes: h200, "):
        nodefile.load(str(tmp_path / "none.json"))


def test_a_link_to_a_node_file_is_followed(tmp_path: Path) -> None:
    (tmp_path / "node.json").symlink_to(nodefile.resolve("h200"))
    assert nodefile.load(str(tmp_path / "node.json")) == nodefile.load("h200")


# -- the bounds themselves -------------------------------------------------------------------


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("name", nodefile.BUILTIN_NODES)
def test_the_built_in_nodes_are_far_within_the_bounds(name: str) -> None:
    raw = nodefile.resolve(name).read_bytes()
    assert len(raw) * 50 < nodefile.MAX_BYTES
    assert _depth(json.loads(raw)) <= 8 < nodefile.MAX_DEPTH


def test_a_file_of_exactly_max_bytes_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    text = json.dumps(builtin()).encode()
    path.write_bytes(text + b" " * (nodefile.MAX_BYTES - len(text)))
    assert nodefile.load(str(path)).info == nodefile.load("h200").info
    path.write_bytes(text + b" " * (nodefile.MAX_BYTES + 1 - len(text)))
    with pytest.raises(nodefile.NodeFileError, match=r"more than the 1\.0 MiB it may be$"):
        nodefile.load(str(path))


def test_max_depth_levels_are_read_and_one_more_is_not() -> None:
    at_bound = b"[" * nodefile.MAX_DEPTH + b"]" * nodefile.MAX_DEPTH
    assert _depth(nodefile.decode_json(at_bound)) == nodefile.MAX_DEPTH
    beyond = b'{"a":' * (nodefile.MAX_DEPTH + 1) + b"1" + b"}" * (nodefile.MAX_DEPTH + 1)
    with pytest.raises(nodefile.NodeFileError, match=r"^nested deeper than 32 levels$"):
        nodefile.decode_json(beyond)


def test_brackets_inside_strings_are_no_nesting() -> None:
    brackets = b"[{" * 5000
    value = nodefile.decode_json(
        b'{"a": "' + brackets + b'", "b": "\\"' + brackets + b'\\\\", "c": [[1]]}'
    )
    assert isinstance(value, dict)
    assert value["c"] == [[1]]


def test_max_devices_are_read(tmp_path: Path) -> None:
    data = builtin()
    device = data["devices"][0]
    data["devices"] = [
        {
            **device,
            "uuid": f"GPU-{n}",
            "pci": {**device["pci"], "bus_id": f"00000000:{n:02X}:00.0"},
            "topology": [],
        }
        for n in range(nodefile.MAX_DEVICES)
    ]
    assert len(nodefile.parse(data).devices) == nodefile.MAX_DEVICES


def test_a_long_value_is_cut_short_in_the_message() -> None:
    data = builtin()
    data["schema"] = "x" * 1_000_000
    with pytest.raises(nodefile.NodeFileError) as err:
        nodefile.parse(data)
    assert len(str(err.value)) < 120


# -- while the agent runs: the simulated backend ---------------------------------------------


@pytest.mark.parametrize("make", [m for _, m, _ in HOSTILE], ids=IDS)
def test_the_backend_keeps_the_node_over_a_hostile_version_and_takes_the_next_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make: Callable[[Path], None]
) -> None:
    path = tmp_path / "node.json"
    data = builtin()
    data["devices"][0]["status"]["temperature_c"] = 41
    rewrite(path, data)
    backend = SimulatedBackend.from_file(str(path))
    watch = backend.event_watch()
    place(make, path)
    assert watch.wait(0.3) == []  # three looks: the version is read once, at the first
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].getMessage().startswith(f"node file {path}")
    assert warnings[0].getMessage().endswith(": keeping what the file said before")
    assert backend.device_status(0).temperature_c == 41
    assert backend.health_check(0).answering is True

    data["devices"][0]["status"]["temperature_c"] = 42
    data["events"] = [{"id": 1, "gpu": 0, "kind": "double_bit_ecc"}]
    rewrite(path, data)
    assert [(e.index, e.kind) for e in watch.wait(2.0)] == [(0, DOUBLE_BIT_ECC)]
    assert backend.device_status(0).temperature_c == 42


def test_a_node_file_that_cannot_be_read_at_start_stops_the_backend(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    _fifo(path)
    with pytest.raises(nodefile.NodeFileError, match=r"is a FIFO, not a regular file$"):
        SimulatedBackend.from_file(str(path))


# -- the daemon's look at the driver ---------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [m for _, m, _ in HOSTILE if m is not _too_many_devices],
    ids=[name for name, m, _ in HOSTILE if m is not _too_many_devices],
)
def test_the_simulated_module_keeps_its_version_over_a_hostile_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[Path], None]
) -> None:
    path = tmp_path / "node.json"
    rewrite(path, {"driver_version": "580.159.04"})
    module = SimulatedModule(path)
    assert module.version() == "580.159.04"
    place(make, path)
    reads: list[Path] = []
    real = nodefile.read_json

    def counted(read: Path) -> object:
        reads.append(read)
        return real(read)

    monkeypatch.setattr(nodefile, "read_json", counted)
    assert module.version() == "580.159.04"
    assert module.version() == "580.159.04"
    assert len(reads) == 1  # once per version: a hostile one is not read at every look
    rewrite(path, {"driver_version": "590.48.01"})
    assert module.version() == "590.48.01"


# -- the worker's event thread ---------------------------------------------------------------


class FailingWatch:
    """An event watch whose first ``failures`` waits raise; then it returns one event."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []  # time.monotonic() of each failed wait

    def wait(self, timeout_s: float) -> list[HealthEvent]:
        if len(self.calls) < self.failures:
            self.calls.append(time.monotonic())
            raise RecursionError("maximum recursion depth exceeded\nwhile decoding")
        if len(self.calls) == self.failures:
            self.calls.append(time.monotonic())
            return [HealthEvent(0, XID, 79, time.time())]
        time.sleep(min(timeout_s, 0.05))
        return []

    def close(self) -> None:
        return None


class FailingBackend(SimulatedBackend):
    def __init__(self, watch: FailingWatch) -> None:
        super().__init__(nodefile.load("h200"), str(nodefile.resolve("h200")))
        self.watch = watch

    def event_watch(self) -> FailingWatch:  # type: ignore[override]
        return self.watch


async def test_the_event_thread_outlives_failures_of_its_watch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(worker, "EVENT_RETRY_FIRST_S", 0.05, raising=False)
    monkeypatch.setattr(worker, "EVENT_RETRY_MAX_S", 0.1, raising=False)
    watch = FailingWatch(failures=3)
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=worker.run, args=(theirs, lambda: FailingBackend(watch)))
    thread.start()
    client = await WorkerClient.attach(ours, start_timeout_s=10)
    try:
        events: list[dict[str, Any]] = []
        pushed = asyncio.Event()

        def on_push(message: dict[str, Any]) -> None:
            if message["push"] == wp.PUSH_EVENT:
                events.append(message)
                pushed.set()

        client.set_push_handler(on_push)
        await asyncio.wait_for(pushed.wait(), 10)
        assert [wp.decode_event(m["event"]).xid for m in events] == [79]
    finally:
        await client.stop()
        thread.join(10)
    assert not thread.is_alive()
    failed = [
        r.getMessage() for r in caplog.records if "Watching GPU events failed" in r.getMessage()
    ]
    assert failed == [
        "Watching GPU events failed (RecursionError: maximum recursion depth exceeded while "
        f"decoding): watching again in {pause:g} s"
        for pause in (0.05, 0.1, 0.1)
    ]
    # A pause after each failure, growing to the maximum: not a busy loop.
    gaps = [later - earlier for earlier, later in zip(watch.calls, watch.calls[1:], strict=False)]
    assert len(gaps) == 3
    assert all(gap >= pause for gap, pause in zip(gaps, (0.05, 0.1, 0.1), strict=True))
