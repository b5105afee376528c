"""What a fleet query shows of each node: its table rows, its JSON entry, and the progress.

- ``status_rows``, ``status_process_rows`` (``--processes``), ``info_rows``, ``docker_rows``
  (with their ``*_COLUMNS``): one row per GPU (``info``, ``status``) or per node
  (``docker-cli``); ``leases`` has its own (``lease_view``). A node that failed gets one row
  with its reason in a few words (and the agent's own one-line reason when it answered an
  error: ``error: HTTP 409: GPU 3 is unhealthy ...``). ``controller.fleet.report.TableSink``
  prints them, fitted to the terminal's width (node and model names cut with ``…``; not a
  terminal: nothing cut).
- ``node_entry(result)``: a node's entry in the ``--json`` document
  (``controller.fleet.report.JsonDocumentSink``): ``{"endpoint", <the agent's JSON as-is
  under its key>, "error", "reason", "elapsed_s"}``.
- ``json_line(result)``: the same entry for one node, with ``"node"``, on one line.
- ``Progress``: ``status [####....] 312/1000 nodes  3 failed`` redrawn on stderr, a
  terminal only; ``ProgressAware`` clears it before any row is written to stdout (both may
  be the same terminal), and the next update draws it again below the rows.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from controller.fleet.query import NodeResult, json_int
from controller.fleet.table import Column, Row, Span

MIB_PER_GIB = 1024


def _get(value: Any, *keys: str) -> Any:
    for key in keys:
        if type(value) is not dict and not isinstance(value, Mapping):  # JSON: a dict
            return None
        value = value.get(key)
    return value


def _num(value: Any, suffix: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return f"{value:.0f}{suffix}"


def _gib(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return f"{value / MIB_PER_GIB:.0f}"


def _pair(used: Any, total: Any) -> str:
    return f"{used}/{total}"


def short_model(model: Any) -> str:
    """``NVIDIA H200`` -> ``H200``; the vendor is the same on every row."""
    if not isinstance(model, str) or not model:
        return "-"
    text: str = model
    for prefix in ("NVIDIA ", "Tesla ", "Quadro "):
        text = text.removeprefix(prefix)
    return text


def _versions(info: Any) -> tuple[str, str]:
    driver = _get(info, "Version", "Driver")
    cuda = _get(info, "Version", "CUDA")
    return (driver if isinstance(driver, str) else "-", cuda if isinstance(cuda, str) else "-")


def _devices(answer: Any) -> list[Any]:
    devices = _get(answer, "Devices")
    return devices if isinstance(devices, list) else []


STATUS_COLUMNS = (
    Column("NODE", min_width=8),
    Column("GPU", right=True),
    Column("MODEL", min_width=6),
    Column("MEM GiB", right=True),
    Column("UTIL", right=True),
    Column("POWER W", right=True),
    Column("DRIVER"),
    Column("CUDA"),
)
STATUS_PROCESS_COLUMNS = (*STATUS_COLUMNS, Column("USED BY", min_width=8))
INFO_COLUMNS = (
    Column("NODE", min_width=8),
    Column("GPU", right=True),
    Column("MODEL", min_width=6),
    Column("MEM GiB", right=True),
    Column("POWER W", right=True),
    Column("UUID", min_width=8),
    Column("DRIVER"),
    Column("CUDA"),
)
DOCKER_COLUMNS = (
    Column("NODE", min_width=8),
    Column("GPUS", right=True),
    Column("DEVICES", min_width=10),
    Column("VOLUMES", min_width=12),
)


def failed_row(result: NodeResult) -> Span:
    # the reason in a few words (an agent's answer: its own one line too); the whole
    # message follows the table on stderr
    said = f": {result.agent_message}" if result.agent_message else ""
    return Span((result.node.name, "-"), f"error: {result.reason}{said}")


def status_rows(result: NodeResult) -> list[Row]:
    if not result.ok:
        return [failed_row(result)]
    info, status = result.answers.get("info"), result.answers.get("status")
    driver, cuda = _versions(info)
    infos, statuses = _devices(info), _devices(status)
    if not infos:
        return [Span((result.node.name, "-"), "no GPUs")]
    rows: list[Row] = []
    for index, device in enumerate(infos):
        live = statuses[index] if index < len(statuses) else None
        used = _gib(_get(live, "Memory", "GlobalUsed"))
        total = _gib(_get(device, "Memory", "Global"))
        power = _num(_get(live, "Power"))
        limit = _num(_get(device, "Power"))
        rows.append(
            (
                result.node.name,
                str(index),
                short_model(_get(device, "Model")),
                _pair(used, total),
                _num(_get(live, "Utilization", "GPU"), "%"),
                _pair(power, limit),
                driver,
                cuda,
            )
        )
    return rows


def status_process_rows(result: NodeResult) -> list[Row]:
    """The status rows, each with what uses that GPU (``status --processes``)."""
    rows = status_rows(result)
    if not result.ok:
        return rows
    answer = result.answers.get("processes")
    by_gpu: dict[int, list[Any]] = {}
    for device in _devices(answer):
        index = _get(device, "Index")
        processes = _get(device, "Processes")
        if isinstance(index, int) and isinstance(processes, list):
            by_gpu[index] = processes
    out: list[Row] = []
    for row in rows:
        if isinstance(row, Span):
            out.append(row)
            continue
        used_by = "?" if answer is None else users(by_gpu.get(int(row[1]), []))
        out.append((*row, used_by))
    return out


def users(processes: Sequence[Any]) -> str:
    """``trainer, mesos:6b4a3f7e, host:python3(4242)``: each owner once, in order."""
    seen: dict[str, None] = {}
    for process in processes:
        seen.setdefault(process_owner(process), None)
    return ", ".join(seen) or "-"


# Owners of /gpu/processes/json that are containers of a runtime other than Docker's.
CONTAINER_RUNTIMES = frozenset({"podman", "containerd", "cri-o", "kubernetes"})


def process_owner(process: Any) -> str:
    """A few words for who runs one process of ``/gpu/processes/json``."""
    owner = _get(process, "Owner")
    name, container_id = _get(process, "ContainerName"), _get(process, "ContainerID")
    mesos = _get(process, "MesosContainer")
    short_id = container_id[:12] if isinstance(container_id, str) else None
    if isinstance(mesos, str) and mesos:  # a Mesos task, whichever containerizer runs it
        return f"mesos:{mesos}"
    if owner == "docker":
        return name if isinstance(name, str) and name else short_id or "docker"
    if owner in CONTAINER_RUNTIMES:  # podman:trainer, containerd:9f1c2b3a4d5e, ...
        named = name if isinstance(name, str) and name else short_id
        return f"{owner}:{named}" if named else str(owner)
    if owner == "mesos":
        return "mesos"
    pid, command = _get(process, "PID"), _get(process, "Name")
    label = f"{command}({pid})" if isinstance(command, str) else f"pid {pid}"
    if owner == "host":
        return f"host:{label}"
    return f"unknown:{label}"


def info_rows(result: NodeResult) -> list[Row]:
    if not result.ok:
        return [failed_row(result)]
    info = result.answers.get("info")
    driver, cuda = _versions(info)
    devices = _devices(info)
    if not devices:
        return [Span((result.node.name, "-"), "no GPUs")]
    rows: list[Row] = []
    for index, device in enumerate(devices):
        uuid = _get(device, "UUID")
        rows.append(
            (
                result.node.name,
                str(index),
                short_model(_get(device, "Model")),
                _gib(_get(device, "Memory", "Global")),
                _num(_get(device, "Power")),
                uuid[4:12] if isinstance(uuid, str) and uuid.startswith("GPU-") else "-",
                driver,
                cuda,
            )
        )
    return rows


def docker_rows(result: NodeResult) -> list[Row]:
    if not result.ok:
        return [failed_row(result)]
    cli = result.answers.get("docker_cli")
    devices = [d for d in _devices(cli) if isinstance(d, str)]
    gpus = [d.removeprefix("/dev/nvidia") for d in devices if d[len("/dev/nvidia") :].isdigit()]
    volumes = _get(cli, "Volumes")
    names = (
        [v.split(":", 1)[0] for v in volumes if isinstance(v, str)]
        if isinstance(volumes, list)
        else []
    )
    return [
        (
            result.node.name,
            str(len(gpus)),
            "nvidia" + number_ranges(int(g) for g in gpus) if gpus else "-",
            " ".join(names) or "-",
        )
    ]


def number_ranges(numbers: Iterable[int]) -> str:
    """0 1 2 3 5 -> ``0-3,5``."""
    spans: list[list[int]] = []
    for number in sorted(set(numbers)):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def node_entry(result: NodeResult) -> dict[str, Any]:
    entry: dict[str, Any] = {"endpoint": result.node.endpoint.uri()}
    entry.update(result.answers)
    entry["error"] = result.error
    entry["reason"] = result.reason
    entry["elapsed_s"] = round(result.elapsed_s, 3)
    return entry


def gpu_count(result: NodeResult) -> int:
    """GPUs the node reported (info, or its ``/leases/free`` answer), the GPUs of its lease
    units (leases), or GPU devices it handed to docker (docker-cli)."""
    if not result.ok:
        return 0
    if "info" in result.answers:
        return len(_devices(result.answers["info"]))
    if "free" in result.answers:  # /leases/free says how many GPUs the node has
        return json_int(_get(result.answers["free"], "GPUs")) or 0
    if "leases" in result.answers:  # the GPUs its units are on (None: an older agent)
        units = _get(result.answers["leases"], "Units")
        return len({_get(u, "GPU") for u in units}) if isinstance(units, list) else 0
    devices = _devices(result.answers.get("docker_cli"))
    return sum(1 for d in devices if isinstance(d, str) and d[len("/dev/nvidia") :].isdigit())


def json_line(result: NodeResult) -> str:
    return json.dumps({"node": result.node.name, **node_entry(result)}, separators=(",", ":"))


class Progress:
    """``status [####....] 312/1000 nodes  3 failed  1.4 s`` on stderr (a terminal's), redrawn
    at most 10 times a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self._drawn_at = 0.0
        self._shown = False

    def update(self, result: NodeResult) -> None:
        self.done += 1
        self.failed += 0 if result.ok else 1
        now = time.monotonic()
        if now - self._drawn_at >= 0.1 or self.done == self.total:
            self._drawn_at = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        failed = f"  {self.failed} failed" if self.failed else ""
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} nodes{failed}"
            f"  {now - self.started:.1f} s\033[K"
        )
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the line (rows are about to be written); the next update draws it again."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False
            self._drawn_at = 0.0

    def close(self) -> None:
        self.clear()


class ProgressAware:
    """Standard output for rows while a ``Progress`` is drawn on the terminal: each write
    first erases the progress line and is flushed at once, so that a row never lands on the
    same line as the progress (stdout and stderr are often one terminal)."""

    def __init__(self, out: TextIO, progress: Progress) -> None:
        self.out = out
        self.progress = progress

    def write(self, text: str) -> int:
        self.progress.clear()
        written = self.out.write(text)
        self.out.flush()
        return written

    def flush(self) -> None:
        self.out.flush()
