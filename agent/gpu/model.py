"""The GPU model: what a node knows about its GPUs, as frozen values with units in names.

Every backend (NVML, simulated) produces these types and nothing else; the REST API only
renders them. A value the hardware or driver does not report is ``None``.

These declarations are also the schema of node files and of ``--dump-node`` (``codec``
reads and writes them field by field): a new field needs a default, so that node files
written before it existed still load. A field's JSON name is its own unless its metadata
says otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PciLink(enum.IntEnum):
    """PCI relation between two GPUs, the integer of ``Topology[].Link`` in ``/gpu/info/json``."""

    UNKNOWN = 0
    CROSS_CPU = 1  # traverses the interconnect between CPU sockets (SYS)
    SAME_CPU = 2  # PCIe host bridges of one CPU socket (NODE)
    HOST_BRIDGE = 3  # through one PCIe host bridge (PHB)
    MULTIPLE_SWITCHES = 4  # several PCIe switches, no host bridge (PXB)
    SINGLE_SWITCH = 5  # at most one PCIe switch (PIX)
    SAME_BOARD = 6  # two GPUs of one board

    @property
    def label(self) -> str:
        """Human label used by the text rendering."""
        return _LINK_LABELS[self]


_LINK_LABELS = {
    PciLink.UNKNOWN: "Unknown",
    PciLink.CROSS_CPU: "Cross CPU socket",
    PciLink.SAME_CPU: "Same CPU socket",
    PciLink.HOST_BRIDGE: "Host PCI bridge",
    PciLink.MULTIPLE_SWITCHES: "Multiple PCI switches",
    PciLink.SINGLE_SWITCH: "Single PCI switch",
    PciLink.SAME_BOARD: "Same board",
}


@dataclass(frozen=True, slots=True)
class PeerLink:
    """A peer GPU this one can reach directly (P2P), and how."""

    bus_id: str
    link: PciLink = PciLink.UNKNOWN
    nvlinks: int = 0  # bonded NVLinks between the pair, 0 when none


@dataclass(frozen=True, slots=True)
class PciInfo:
    bus_id: str  # "00000000:00:06.0", NVML's 8-digit-domain form
    bar1_mib: int | None
    bandwidth_mbps: int | None  # max link generation x max width, MB/s


@dataclass(frozen=True, slots=True)
class Clocks:
    cores_mhz: int | None
    memory_mhz: int | None


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    ecc: bool | None
    global_mib: int | None
    shared_kib: int | None  # shared memory per multiprocessor
    constant_kib: int | None
    l2_cache_kib: int | None
    bandwidth_mbps: int | None  # 2 x memory clock MHz x bus width bits / 8


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device of a GPU in MIG mode: a GPU instance with one compute instance.

    ``index`` is NVML's MIG device index on its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``;
    ``<gpu>:<index>`` names it in ``dev``, ``NV_GPU`` and CDI, as NVIDIA's tools do).
    ``capabilities`` are the device nodes that grant access to it
    (``/dev/nvidia-caps/nvidia-cap<minor>`` of its GPU instance and compute instance, minors
    from ``/proc/driver/nvidia-caps/mig-minors``); empty when they are unknown.
    """

    index: int
    uuid: str | None  # "MIG-<uuid>"
    profile: str | None  # "1g.18gb", "1c.2g.35gb"
    memory_mib: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    capabilities: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts of one GPU, read once at start (``/gpu/info``)."""

    index: int = field(metadata={"json": None})  # the position in the node, not stored
    uuid: str | None
    path: str | None  # "/dev/nvidia<minor>"
    model: str | None
    power_w: int | None  # power management limit
    cpu_affinity: int | None  # NUMA node of the GPU
    pci: PciInfo
    clocks: Clocks  # maximum clocks
    topology: tuple[PeerLink, ...]
    family: str | None  # "Hopper"
    arch: str | None  # compute capability "9.0"
    cores: int | None  # CUDA cores: SMs x cores per SM
    memory: DeviceMemory
    # MIG mode now (not the pending mode); None: the GPU cannot do MIG, or it was not read.
    mig_enabled: bool | None = None
    mig_devices: tuple[MigDevice, ...] = ()  # in MIG index order; empty unless MIG is on


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Everything static about a node: driver, CUDA version and the devices in index order."""

    driver_version: str
    cuda_version: str  # "13.0"
    devices: tuple[DeviceInfo, ...]

    def device(self, index: int) -> DeviceInfo:
        return self.devices[index]


@dataclass(frozen=True, slots=True)
class Utilization:
    gpu_pct: int | None
    memory_pct: int | None
    encoder_pct: int | None
    decoder_pct: int | None


@dataclass(frozen=True, slots=True)
class EccErrors:
    """Uncorrected, volatile ECC error counts."""

    l1_cache: int | None
    l2_cache: int | None
    global_: int | None = field(metadata={"json": "global"})


@dataclass(frozen=True, slots=True)
class PcieThroughput:
    """PCIe throughput sample; NVML samples each direction for about 20 ms."""

    rx_mbps: int | None
    tx_mbps: int | None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    name: str | None
    memory_used_mib: int | None


@dataclass(frozen=True, slots=True)
class FrameBuffer:
    """Device memory as NVML's version-2 memory call splits it (what nvidia-smi shows).

    ``used_mib`` excludes what the driver reserves for itself (``reserved_mib``), unlike
    ``DeviceStatus.memory_used_mib`` (the old tool's ``GlobalUsed``, which includes it).
    """

    used_mib: int | None = None
    free_mib: int | None = None
    reserved_mib: int | None = None


@dataclass(frozen=True, slots=True)
class RemappedRows:
    """HBM row remapping (Ampere and later): spare rows that replaced faulty ones."""

    correctable: int | None = None  # rows remapped after correctable errors
    uncorrectable: int | None = None  # rows remapped after uncorrectable errors
    pending: bool | None = None  # a remapping waits for the next GPU reset
    failed: bool | None = None  # a remapping failed: the GPU needs service


@dataclass(frozen=True, slots=True)
class Profiling:
    """What the GPU's performance monitors (NVML's GPM, Hopper and later) measured over the
    last interval between two samples, in GPM's own units (percent, MiB per second).

    A value the GPU cannot measure, or that no pair of recent samples gives, is ``None``.
    """

    graphics_pct: float | None = None  # time any graphics or compute engine was active
    sm_pct: float | None = None  # SMs with at least one warp assigned
    sm_occupancy_pct: float | None = None  # resident warps against the SMs' maximum
    tensor_pct: float | None = None  # cycles any tensor pipe was active
    dram_pct: float | None = None  # device memory bandwidth used against its peak
    pcie_tx_mib_s: float | None = None  # PCIe traffic from the GPU, headers included
    pcie_rx_mib_s: float | None = None  # PCIe traffic to the GPU
    nvlink_tx_mib_s: float | None = None  # NVLink traffic from the GPU, every link
    nvlink_rx_mib_s: float | None = None  # NVLink traffic to the GPU
    interval_s: float | None = None  # how far apart the two samples were


UNKNOWN_PROFILING = Profiling()


@dataclass(frozen=True, slots=True)
class MigTelemetry:
    """Live values of one MIG device (``MigDevice.index`` on its GPU), for ``/metrics``."""

    index: int
    framebuffer: FrameBuffer = FrameBuffer()  # the MIG device's own memory
    profiling: Profiling = UNKNOWN_PROFILING  # its GPU instance's performance monitors


@dataclass(frozen=True, slots=True)
class DeviceTelemetry:
    """Live values that only ``/metrics`` exports (dcgm-exporter's fields).

    Kept apart from the fields ``/gpu/status`` renders, so its bodies stay those of the old
    tool; every field defaults to unknown, so node files without them still load.
    """

    power_mw: int | None = None  # the draw ``power_w`` rounds down, in milliwatts
    memory_temperature_c: int | None = None  # HBM temperature
    total_energy_mj: int | None = None  # since the driver was loaded, millijoules
    pcie_replay_count: int | None = None  # PCIe link retries since the driver was loaded
    framebuffer: FrameBuffer = FrameBuffer()
    remapped_rows: RemappedRows = RemappedRows()
    profiling: Profiling = UNKNOWN_PROFILING  # the whole GPU's performance monitors
    mig_devices: tuple[MigTelemetry, ...] = ()  # in MIG index order; empty unless MIG is on


UNKNOWN_TELEMETRY = DeviceTelemetry()


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """Live facts of one GPU (``/gpu/status``), except the PCIe throughput.

    The throughput is slow to read and comes from the background sampler; the REST layer
    joins both.
    """

    power_w: int | None  # power draw
    temperature_c: int | None
    utilization: Utilization
    memory_used_mib: int | None
    ecc_errors: EccErrors
    clocks: Clocks  # current clocks
    bar1_used_mib: int | None
    processes: tuple[GpuProcess, ...]  # compute processes; empty when none
    telemetry: DeviceTelemetry = UNKNOWN_TELEMETRY  # for /metrics only


UNKNOWN_UTILIZATION = Utilization(None, None, None, None)
UNKNOWN_ECC = EccErrors(None, None, None)
UNKNOWN_CLOCKS = Clocks(None, None)
UNKNOWN_THROUGHPUT = PcieThroughput(None, None)

LOST_DEVICE_STATUS = DeviceStatus(
    power_w=None,
    temperature_c=None,
    utilization=UNKNOWN_UTILIZATION,
    memory_used_mib=None,
    ecc_errors=UNKNOWN_ECC,
    clocks=UNKNOWN_CLOCKS,
    bar1_used_mib=None,
    processes=(),
)
"""The status of a GPU that does not answer at all (lost, fallen off the bus)."""
