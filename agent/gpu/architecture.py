"""Data tables about GPU hardware: architecture families, CUDA cores per SM, PCIe bandwidth.

NVML does not say how many CUDA cores one streaming multiprocessor (SM) holds nor what a
PCIe link generation is worth, so these facts live here as data. The old tool's tables
stopped at Pascal and PCIe gen 3 (an H200 showed ``Family: null`` and ``Bandwidth: 0``);
extend the tables, not the code, when new hardware comes out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    family: str  # marketing name of the architecture, as /gpu/info shows it
    cores_per_sm: int  # FP32 CUDA cores in one streaming multiprocessor


# Compute capability (major, minor) -> architecture. Sources: the CUDA C Programming Guide,
# "Compute Capabilities" (arithmetic instruction throughput table: 32-bit floating-point
# add/multiply results per clock per SM), and NVIDIA's architecture whitepapers.
ARCHITECTURES: dict[tuple[int, int], Architecture] = {
    (3, 0): Architecture("Kepler", 192),  # GK104 (GTX 680, Tesla K10)
    (3, 2): Architecture("Kepler", 192),  # Tegra K1
    (3, 5): Architecture("Kepler", 192),  # GK110 (Tesla K20, K40)
    (3, 7): Architecture("Kepler", 192),  # GK210 (Tesla K80)
    (5, 0): Architecture("Maxwell", 128),  # GM107 (GTX 750)
    (5, 2): Architecture("Maxwell", 128),  # GM200/GM204 (Tesla M40, M60)
    (5, 3): Architecture("Maxwell", 128),  # Tegra X1
    (6, 0): Architecture("Pascal", 64),  # GP100 (Tesla P100)
    (6, 1): Architecture("Pascal", 128),  # GP102/GP104 (Tesla P40, P4, GTX 1080)
    (6, 2): Architecture("Pascal", 128),  # Tegra X2
    (7, 0): Architecture("Volta", 64),  # GV100 (Tesla V100)
    (7, 2): Architecture("Volta", 64),  # Jetson AGX Xavier
    (7, 5): Architecture("Turing", 64),  # TU10x (Tesla T4, RTX 20xx)
    (8, 0): Architecture("Ampere", 64),  # GA100 (A100, A30)
    (8, 6): Architecture("Ampere", 128),  # GA10x (A10, A40, RTX 30xx)
    (8, 7): Architecture("Ampere", 128),  # Jetson AGX Orin
    (8, 9): Architecture("Ada Lovelace", 128),  # AD10x (L4, L40S, RTX 40xx)
    (9, 0): Architecture("Hopper", 128),  # GH100 (H100, H200, GH200)
    (10, 0): Architecture("Blackwell", 128),  # GB100/GB200 (B200, GB200)
    (10, 1): Architecture("Blackwell", 128),  # Jetson Thor before CUDA 13 (now 11.0)
    (10, 3): Architecture("Blackwell", 128),  # GB300 (B300, GB300)
    (11, 0): Architecture("Blackwell", 128),  # Jetson Thor from CUDA 13 on
    (12, 0): Architecture("Blackwell", 128),  # GB20x (RTX PRO 6000, RTX 50xx)
    (12, 1): Architecture("Blackwell", 128),  # GB10 (DGX Spark)
}


def architecture(major: int, minor: int) -> Architecture | None:
    """The architecture of a compute capability, ``None`` when the table does not know it."""
    return ARCHITECTURES.get((major, minor))


# PCIe bandwidth of one lane in one direction, MB/s, after line encoding, per link generation:
# gen 1 and 2 use 8b/10b encoding (2.5 and 5 GT/s -> 250 and 500 MB/s), gen 3 to 5 use
# 128b/130b (8, 16, 32 GT/s -> 985, 1969, 3938 MB/s, rounded as in the PCI-SIG tables).
# Gen 6 runs 64 GT/s PAM4 in 256-byte FLITs of which 242 bytes carry data (FEC and CRC take
# the rest), so 64e9 / 8 * 242 / 256 = 7562.5 -> 7563 MB/s. The figure is the raw link rate
# after encoding; TLP headers cost a few percent more, which no table can know.
PCIE_LANE_MBPS: dict[int, int] = {
    1: 250,
    2: 500,
    3: 985,
    4: 1969,
    5: 3938,
    6: 7563,
}


def pcie_bandwidth_mbps(generation: int | None, width: int | None) -> int | None:
    """Bandwidth of a PCIe link in MB/s (one direction): per-lane bandwidth x lanes."""
    if generation is None or width is None or width <= 0:
        return None
    lane = PCIE_LANE_MBPS.get(generation)
    return None if lane is None else lane * width


def memory_bandwidth_mbps(memory_clock_mhz: int | None, bus_width_bits: int | None) -> int | None:
    """Peak memory bandwidth in MB/s: 2 (double data rate) x clock MHz x bus width / 8.

    NVML's memory clock is half the data rate for every memory type it reports (GDDR and
    HBM alike), which is why the factor 2: an H200 at 3201 MHz on a 6016-bit bus gives
    4,814,304 MB/s (4.8 TB/s, NVIDIA's figure for that GPU).
    """
    if memory_clock_mhz is None or bus_width_bits is None:
        return None
    return 2 * memory_clock_mhz * bus_width_bits // 8
