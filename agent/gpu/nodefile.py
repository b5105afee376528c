"""Node files: a node's GPU facts as JSON, read by the simulated backend, made by --dump-node.

The schema is documented in ``docs/node-file.md``. Field names are those of the model
(``agent.gpu.model``), so a node file reads like the model it describes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agent.gpu.model import (
    Clocks,
    DeviceInfo,
    DeviceMemory,
    DeviceStatus,
    EccErrors,
    GpuProcess,
    NodeInfo,
    PcieThroughput,
    PciInfo,
    PciLink,
    PeerLink,
    Utilization,
)

SCHEMA = "nvidia-docker-node/1"
BUILTIN_NODES = ("h200", "h200x2", "hgx-h200-8")


class NodeFileError(ValueError):
    """A node file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class SimulatedDevice:
    status: DeviceStatus
    throughput: PcieThroughput
    lost: bool  # every live call fails, as for a GPU that fell off the bus


@dataclass(frozen=True, slots=True)
class NodeFile:
    """A parsed node file: static info, the status each device reports, simulated call costs."""

    info: NodeInfo
    devices: tuple[SimulatedDevice, ...]
    status_call_s: float  # time one device_status() takes, to mimic NVML
    pcie_sample_s: float  # time one pcie_throughput() takes (NVML: about 2 x 20 ms)


def resolve(name_or_path: str) -> Path:
    """A built-in node name (``h200``) or a path to a node file."""
    if name_or_path in BUILTIN_NODES:
        ref = resources.files("agent.gpu") / "nodes" / f"{name_or_path}.json"
        return Path(str(ref))
    return Path(name_or_path)


def load(name_or_path: str) -> NodeFile:
    path = resolve(name_or_path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NodeFileError(
            f"node file {path} not found (built-in nodes: {', '.join(BUILTIN_NODES)})"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise NodeFileError(f"node file {path}: cannot read it: {err}") from None
    except json.JSONDecodeError as err:
        raise NodeFileError(f"node file {path}: not JSON: {err}") from None
    try:
        return parse(raw)
    except NodeFileError as err:
        raise NodeFileError(f"node file {path}: {err}") from None


class _Reader:
    """Typed access to one JSON object, with the field path in every error."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, Mapping):
            raise NodeFileError(f"{where or 'top level'}: expected an object")
        self._data: Mapping[str, Any] = data
        self._where = where

    def _path(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def _get(self, key: str, required: bool) -> Any:
        if key not in self._data:
            if required:
                raise NodeFileError(f"{self._path(key)}: missing")
            return None
        return self._data[key]

    def str_(self, key: str, *, required: bool = False) -> str | None:
        value = self._get(key, required)
        if value is None or isinstance(value, str):
            return value
        raise NodeFileError(f"{self._path(key)}: expected a string, got {value!r}")

    def req_str(self, key: str) -> str:
        value = self.str_(key, required=True)
        if value is None:
            raise NodeFileError(f"{self._path(key)}: must not be null")
        return value

    def int_(self, key: str) -> int | None:
        value = self._get(key, False)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise NodeFileError(f"{self._path(key)}: expected an integer or null, got {value!r}")

    def float_(self, key: str, default: float) -> float:
        value = self._get(key, False)
        if value is None:
            return default
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            return float(value)
        raise NodeFileError(f"{self._path(key)}: expected a number >= 0, got {value!r}")

    def bool_(self, key: str) -> bool | None:
        value = self._get(key, False)
        if value is None or isinstance(value, bool):
            return value
        raise NodeFileError(f"{self._path(key)}: expected true, false or null, got {value!r}")

    def obj(self, key: str) -> _Reader:
        value = self._get(key, False)
        return _Reader({} if value is None else value, self._path(key))

    def list_(self, key: str) -> list[_Reader]:
        value = self._get(key, False)
        if value is None:
            return []
        if not isinstance(value, list | tuple):
            raise NodeFileError(f"{self._path(key)}: expected a list")
        return [_Reader(item, f"{self._path(key)}[{i}]") for i, item in enumerate(value)]


def parse(raw: object) -> NodeFile:
    top = _Reader(raw, "")
    schema = top.str_("schema")
    if schema not in (None, SCHEMA):
        raise NodeFileError(f"schema: {schema!r} is not supported (expected {SCHEMA!r})")
    timing = top.obj("timing")
    devices = top.list_("devices")
    if not devices:
        raise NodeFileError("devices: a node file needs at least one device")
    infos: list[DeviceInfo] = []
    simulated: list[SimulatedDevice] = []
    for index, dev in enumerate(devices):
        infos.append(_device_info(index, dev))
        simulated.append(_simulated(dev))
    bus_ids = {info.pci.bus_id for info in infos}
    if len(bus_ids) != len(infos):
        raise NodeFileError("devices: two devices share a pci.bus_id")
    for info in infos:
        for peer in info.topology:
            if peer.bus_id not in bus_ids or peer.bus_id == info.pci.bus_id:
                raise NodeFileError(
                    f"devices[{info.index}].topology: {peer.bus_id} is not another device"
                )
    node = NodeInfo(
        driver_version=top.req_str("driver_version"),
        cuda_version=top.req_str("cuda_version"),
        devices=tuple(infos),
    )
    return NodeFile(
        info=node,
        devices=tuple(simulated),
        status_call_s=timing.float_("status_call_s", 0.0),
        pcie_sample_s=timing.float_("pcie_sample_s", 0.0),
    )


def _device_info(index: int, dev: _Reader) -> DeviceInfo:
    pci = dev.obj("pci")
    clocks = dev.obj("clocks")
    mem = dev.obj("memory")
    topology = []
    for peer in dev.list_("topology"):
        link = peer.int_("link") or 0
        if link not in PciLink._value2member_map_:
            raise NodeFileError(f"devices[{index}].topology: link {link} is not 0-6")
        topology.append(
            PeerLink(
                bus_id=peer.req_str("bus_id"), link=PciLink(link), nvlinks=peer.int_("nvlinks") or 0
            )
        )
    return DeviceInfo(
        index=index,
        uuid=dev.str_("uuid"),
        path=dev.str_("path"),
        model=dev.str_("model"),
        power_w=dev.int_("power_w"),
        cpu_affinity=dev.int_("cpu_affinity"),
        pci=PciInfo(
            bus_id=pci.req_str("bus_id"),
            bar1_mib=pci.int_("bar1_mib"),
            bandwidth_mbps=pci.int_("bandwidth_mbps"),
        ),
        clocks=Clocks(cores_mhz=clocks.int_("cores_mhz"), memory_mhz=clocks.int_("memory_mhz")),
        topology=tuple(topology),
        family=dev.str_("family"),
        arch=dev.str_("arch"),
        cores=dev.int_("cores"),
        memory=DeviceMemory(
            ecc=mem.bool_("ecc"),
            global_mib=mem.int_("global_mib"),
            shared_kib=mem.int_("shared_kib"),
            constant_kib=mem.int_("constant_kib"),
            l2_cache_kib=mem.int_("l2_cache_kib"),
            bandwidth_mbps=mem.int_("bandwidth_mbps"),
        ),
    )


def _simulated(dev: _Reader) -> SimulatedDevice:
    st = dev.obj("status")
    util = st.obj("utilization")
    ecc = st.obj("ecc_errors")
    clocks = st.obj("clocks")
    pcie = st.obj("pcie")
    processes = tuple(
        GpuProcess(
            pid=p.int_("pid") or 0, name=p.str_("name"), memory_used_mib=p.int_("memory_used_mib")
        )
        for p in st.list_("processes")
    )
    status = DeviceStatus(
        power_w=st.int_("power_w"),
        temperature_c=st.int_("temperature_c"),
        utilization=Utilization(
            gpu_pct=util.int_("gpu_pct"),
            memory_pct=util.int_("memory_pct"),
            encoder_pct=util.int_("encoder_pct"),
            decoder_pct=util.int_("decoder_pct"),
        ),
        memory_used_mib=st.int_("memory_used_mib"),
        ecc_errors=EccErrors(
            l1_cache=ecc.int_("l1_cache"), l2_cache=ecc.int_("l2_cache"), global_=ecc.int_("global")
        ),
        clocks=Clocks(cores_mhz=clocks.int_("cores_mhz"), memory_mhz=clocks.int_("memory_mhz")),
        bar1_used_mib=st.int_("bar1_used_mib"),
        processes=processes,
    )
    throughput = PcieThroughput(rx_mbps=pcie.int_("rx_mbps"), tx_mbps=pcie.int_("tx_mbps"))
    return SimulatedDevice(status=status, throughput=throughput, lost=bool(dev.bool_("lost")))


def dump(
    info: NodeInfo,
    statuses: Sequence[DeviceStatus],
    throughputs: Sequence[PcieThroughput],
    *,
    status_call_s: float | None = None,
    pcie_sample_s: float | None = None,
) -> dict[str, Any]:
    """The node file for a node, the inverse of ``parse`` (used by ``--dump-node``)."""
    devices = []
    for dev, status, tput in zip(info.devices, statuses, throughputs, strict=True):
        entry = dataclasses.asdict(dev)
        del entry["index"]
        for peer in entry["topology"]:
            peer["link"] = int(peer["link"])
        st = dataclasses.asdict(status)
        st["ecc_errors"]["global"] = st["ecc_errors"].pop("global_")
        st["pcie"] = dataclasses.asdict(tput)
        entry["status"] = st
        devices.append(entry)
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "driver_version": info.driver_version,
        "cuda_version": info.cuda_version,
    }
    if status_call_s is not None or pcie_sample_s is not None:
        out["timing"] = {
            "status_call_s": status_call_s or 0.0,
            "pcie_sample_s": pcie_sample_s or 0.0,
        }
    out["devices"] = devices
    return out
