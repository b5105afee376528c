"""Benchmark of the driver volume: build by hard links and by copies, against ``cp -a``,
and the round trip of ``VolumeDriver.Mount`` through the unix socket.

    python -m tests.benchmarks.bench_volume OUT.json            # fake driver (gcc), 256 MiB
    python -m tests.benchmarks.bench_volume --real OUT.json     # the running driver

``--real`` (or auto-detection: /proc/driver/nvidia/version exists) reads the real
/etc/ld.so.cache. All figures of one run come from the same files on the same filesystems;
the copy build and ``cp -a`` alternate, ``--repeat`` times, and the medians are compared.
The page cache is not dropped: both sides read warm sources.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp

from agent.edge.plugin_socket import start_plugin_site
from plugin.discovery import DriverFiles, find_driver_files
from plugin.volumes import VolumeStore

ACCEPT = {"Accept": "application/vnd.docker.plugins.v1.2+json"}


def _refuse_link(*_: object, **__: object) -> None:
    raise OSError(errno.EXDEV, "links disabled by the benchmark")


@contextlib.contextmanager
def links_disabled() -> Iterator[None]:
    """Force the copy path (what a volume directory on another partition gets)."""
    with mock.patch("os.link", _refuse_link):
        yield


def build_once(files: DriverFiles, base: Path, *, copies: bool) -> float:
    work = Path(tempfile.mkdtemp(prefix="bench-volume-", dir=base))
    try:
        store = VolumeStore(work, files)
        started = time.perf_counter()
        with links_disabled() if copies else contextlib.nullcontext():
            store.create(f"nvidia_driver_{files.driver_version}")
        return time.perf_counter() - started
    finally:
        shutil.rmtree(work)


def cp_once(files: DriverFiles, base: Path) -> tuple[float, float]:
    """``cp -a`` of the same files, and the same followed by ``sync -f`` (the volume build
    fsyncs what it copies, so that a power cut never leaves a volume of empty files)."""
    work = Path(tempfile.mkdtemp(prefix="bench-cp-", dir=base))
    try:
        sources = [str(item.source) for item in files.all_files]
        started = time.perf_counter()
        # One cp per target directory, as the volume has them (names may repeat across).
        for sub, items in (
            ("bin", files.binaries),
            ("lib64", files.libraries_64),
            ("lib", files.libraries_32),
        ):
            (work / sub).mkdir()
            if items:
                subprocess.run(
                    ["cp", "-a", *[str(i.source) for i in items], str(work / sub)], check=True
                )
        assert sources
        copied = time.perf_counter() - started
        subprocess.run(["sync", "-f", str(work)], check=True)
        return copied, time.perf_counter() - started
    finally:
        shutil.rmtree(work)


async def mount_latencies(files: DriverFiles, base: Path, requests: int) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="bench-mount-", dir=base))
    store = VolumeStore(work / "volumes", files)
    name = f"nvidia_driver_{files.driver_version}"
    await asyncio.to_thread(store.create, name)
    runner = await start_plugin_site(store, work / "plugins")
    timings: list[float] = []
    try:
        connector = aiohttp.UnixConnector(path=str(work / "plugins" / "nvidia-docker.sock"))
        async with aiohttp.ClientSession(connector=connector) as session:
            body = json.dumps({"Name": name, "ID": "bench"})
            for _ in range(requests):
                started = time.perf_counter()
                async with session.post(
                    "http://plugin/VolumeDriver.Mount", data=body, headers=ACCEPT
                ) as resp:
                    answer = await resp.json(content_type=None)
                timings.append(time.perf_counter() - started)
                assert answer["Err"] == "", answer
    finally:
        await runner.cleanup()
        shutil.rmtree(work)
    return timings


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def driver_files(real: bool, fake_mib: int, base: Path) -> tuple[DriverFiles, str, Any]:
    if real:
        text = Path("/proc/driver/nvidia/version").read_text()
        version = next(
            w for w in text.split() if w.count(".") >= 1 and w.replace(".", "").isdigit()
        )
        return find_driver_files(version), "real driver", None
    from tests.support.fake_driver import build_fake_driver  # noqa: PLC0415 - needs gcc

    pad = fake_mib * 2**20 // 17
    driver = build_fake_driver(base, pad_bytes=pad)
    files = find_driver_files(driver.version, ldcache=driver.ldcache, search_path=str(driver.bin))
    return files, f"fake driver ({fake_mib} MiB of libraries)", driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the results (JSON)")
    parser.add_argument("--real", action="store_true", help="use the running NVIDIA driver")
    parser.add_argument("--fake-mib", type=int, default=256, help="size of the fake driver")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000, help="Mount requests")
    parser.add_argument("--work-dir", type=Path, default=None, help="where volumes are built")
    args = parser.parse_args()
    real = args.real or Path("/proc/driver/nvidia/version").exists()

    base = Path(tempfile.mkdtemp(prefix="bench-volume-", dir=args.work_dir))
    try:
        files, what, _ = driver_files(real, args.fake_mib, base)
        mib = files.size_bytes / 2**20
        link_s, copy_s, cp_s, cp_sync_s = [], [], [], []
        for _ in range(args.repeat):
            link_s.append(build_once(files, base, copies=False))
            subprocess.run(["sync", "-f", str(base)], check=True)  # start each one clean
            copy_s.append(build_once(files, base, copies=True))
            subprocess.run(["sync", "-f", str(base)], check=True)
            plain, synced = cp_once(files, base)
            cp_s.append(plain)
            cp_sync_s.append(synced)
        timings = asyncio.run(mount_latencies(files, base, args.requests))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    link, copy, cp, cp_sync = (statistics.median(v) for v in (link_s, copy_s, cp_s, cp_sync_s))
    results = {
        "source": what,
        "files": len(files.all_files),
        "size_mib": round(mib, 1),
        "repeat": args.repeat,
        "build_by_links_s": round(link, 4),
        "build_by_copies_s": round(copy, 4),
        "cp_a_s": round(cp, 4),
        "copies_mib_per_s": round(mib / copy, 1),
        "cp_a_mib_per_s": round(mib / cp, 1),
        "cp_a_sync_s": round(cp_sync, 4),
        "cp_a_sync_mib_per_s": round(mib / cp_sync, 1),
        "copies_vs_cp_a_speed": round(cp / copy, 2),
        "copies_vs_cp_a_sync_speed": round(cp_sync / copy, 2),
        "links_vs_copies_speed": round(copy / link, 1),
        "mount_requests": len(timings),
        "mount_p50_ms": round(percentile(timings, 0.50) * 1000, 3),
        "mount_p99_ms": round(percentile(timings, 0.99) * 1000, 3),
        "python": sys.version.split()[0],
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"{what}: {results['files']} files, {mib:.1f} MiB (median of {args.repeat})\n"
        f"  build by hard links  {link * 1000:8.1f} ms  "
        f"({results['links_vs_copies_speed']}x faster than copies)\n"
        f"  build by copies      {copy * 1000:8.1f} ms  {mib / copy:8.1f} MiB/s\n"
        f"  cp -a of the files   {cp * 1000:8.1f} ms  {mib / cp:8.1f} MiB/s  "
        f"(copies/cp -a speed: {results['copies_vs_cp_a_speed']})\n"
        f"  cp -a + sync -f      {cp_sync * 1000:8.1f} ms  {mib / cp_sync:8.1f} MiB/s  "
        f"(copies/(cp -a + sync) speed: {results['copies_vs_cp_a_sync_speed']})\n"
        f"  Mount round trip over the socket: p50 {results['mount_p50_ms']} ms, "
        f"p99 {results['mount_p99_ms']} ms ({len(timings)} requests)\n"
        f"  results written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
