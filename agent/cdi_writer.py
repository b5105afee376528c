"""The node's CDI spec on disk (``<cdi spec dir>/nvidia-docker.json``), kept current.

The daemon builds one ``CdiSpecWriter`` when ``--cdi-spec-dir`` is set, writes the spec
once before it serves, and subscribes the writer to the node state: every
``NodeState.replace`` (a driver upgrade, a GPU's health, MIG devices) rewrites it. A rewrite
first makes sure the driver volume of the node's driver exists (the spec mounts it), then
writes a temporary file next to the spec (``.nvidia-docker.json.<pid>.tmp``: CDI readers load
``*.json`` and ``*.yaml`` only), mode 0644, fsyncs it and renames it over the spec, so an
engine reads the old spec or the new one, never a part. Rewrites run one at a time; node
changes that arrive meanwhile fold into one more rewrite with the latest facts. A spec with
the same bytes as the file is not rewritten.

When the agent stops, the spec stays: containers with a restart policy that name
``nvidia.com/gpu`` devices must still start while the agent restarts, and the devices and
the driver volume it names are still there. The next start rewrites it (docs/cdi.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.cdi_inputs import ROOT, spec_inputs
from agent.node_facts import NodeFacts
from cdi import spec
from plugin.volume_specs import VOLUMES
from plugin.volumes import VolumeStore

log = logging.getLogger("nvidia-docker-plugin.cdi")

SPEC_NAME = "nvidia-docker.json"
# Where every CDI reader looks (Podman always; Docker 25+ unless its daemon.json says else).
SCANNED_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
FILE_MODE = 0o644
HOOK_PROGRAM = "nvidia-docker-cdi-hook"
SYSTEM_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"

EnsureVolume = Callable[[str], Path]  # driver version -> the volume's directory (blocking)
Unhealthy = Callable[[NodeFacts], frozenset[int]]  # facts -> indices of unhealthy GPUs


def no_unhealthy_gpus(_facts: NodeFacts) -> frozenset[int]:
    """Until the node's health is known to the facts, every GPU counts as healthy."""
    return frozenset()


def volume_builder(store: VolumeStore) -> EnsureVolume:
    """The driver volume of a driver version, built by the plugin's store when missing (the
    same volume ``docker run --volume-driver=nvidia-docker`` mounts)."""
    driver = VOLUMES[0]  # nvidia_driver, at /usr/local/nvidia

    def ensure(driver_version: str) -> Path:
        return store.create(driver.docker_name(driver_version))

    return ensure


def find_linker_cache_hook() -> spec.LinkerCacheHook | None:
    """Our hook beside the running interpreter (the same installation), else on PATH, and
    the host's ldconfig; None (and a warning) when either is missing."""
    beside = Path(sys.executable).with_name(HOOK_PROGRAM)
    program = str(beside) if beside.is_file() else shutil.which(HOOK_PROGRAM)
    ldconfig = shutil.which("ldconfig", path=SYSTEM_PATH)
    if program is None or ldconfig is None:
        missing = HOOK_PROGRAM if program is None else "ldconfig"
        log.warning(
            "%s not found: the CDI spec has no linker cache hook, so programs in images "
            "without LD_LIBRARY_PATH=/usr/local/nvidia/lib64 will not find libcuda.so.1",
            missing,
        )
        return None
    return spec.LinkerCacheHook(program=os.path.abspath(program), ldconfig=ldconfig)


def readers_find(spec_file: Path, scanned: tuple[Path, ...] = SCANNED_DIRS) -> bool:
    """Whether CDI readers see ``spec_file``: it is in a directory they scan, or such a
    directory holds a ``.json``/``.yaml`` link to it (the packaged unit's way)."""
    real = os.path.realpath(spec_file)
    for directory in scanned:
        if os.path.realpath(directory) == os.path.dirname(real):
            return True
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith((".json", ".yaml")) and os.path.realpath(entry) == real:
                    return True
    return False


@dataclass(frozen=True, slots=True)
class CdiSettings:
    spec_dir: Path
    dev_root: Path = ROOT
    hook: spec.LinkerCacheHook | None = None


def write_atomically(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Temporary file beside ``path``, fsync, rename over it, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # whatever the umask
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class CdiSpecWriter:
    """Writes the spec for the facts it is given; see the module docstring."""

    def __init__(
        self,
        settings: CdiSettings,
        ensure_volume: EnsureVolume,
        unhealthy: Unhealthy = no_unhealthy_gpus,
    ) -> None:
        self.settings = settings
        self._ensure_volume = ensure_volume
        self._unhealthy = unhealthy
        self._current: bytes | None = None
        self._wanted: NodeFacts | None = None
        self._task: asyncio.Task[None] | None = None
        self._checked_readers = False

    @property
    def path(self) -> Path:
        return self.settings.spec_dir / SPEC_NAME

    @property
    def current(self) -> bytes | None:
        """The spec as last written (or found already written); None before that."""
        return self._current

    def build(self, facts: NodeFacts, driver_volume: Path | None) -> spec.BuiltSpec:
        inputs = spec_inputs(
            facts.node,
            unhealthy=self._unhealthy(facts),
            driver_volume=driver_volume,
            hook=self.settings.hook,
            dev_root=self.settings.dev_root,
        )
        return spec.build_spec(inputs)

    async def write(self, facts: NodeFacts) -> bool:
        """Write the spec for ``facts``; False (logged) when it could not be, and the
        previous spec stays."""
        version = facts.node.driver_version
        try:
            volume = await asyncio.to_thread(self._ensure_volume, version)
        except Exception as err:
            log.error(
                "CDI spec %s not written: the driver volume of driver %s cannot be built "
                "(%s); keeping the previous one",
                self.path,
                version,
                err,
            )
            return False
        built = self.build(facts, volume)
        if not built.document["devices"]:
            log.error(
                "CDI spec %s not written: no GPU can be named; keeping the previous one", self.path
            )
            return False
        data = spec.encode(built.document)
        try:
            on_disk = await asyncio.to_thread(self._read)
            if on_disk != data:
                await asyncio.to_thread(write_atomically, self.path, data)
        except OSError as err:
            log.error("CDI spec %s not written: %s; keeping the previous one", self.path, err)
            return False
        changed = on_disk != data
        self._current = data
        if not self._checked_readers:
            self._checked_readers = True
            if not readers_find(self.path):
                log.warning(
                    "CDI readers (Podman; Docker 25+ by default) scan %s only, and none of "
                    "them holds %s or a link to it: link /var/run/cdi/%s to it (docs/cdi.md)",
                    " and ".join(map(str, SCANNED_DIRS)),
                    self.path,
                    SPEC_NAME,
                )
        for line in built.left_out:
            log.warning("CDI spec: %s", line)
        log.info(
            "%s the CDI spec %s (CDI %s, driver %s): %d device names",
            "Wrote" if changed else "Kept",
            self.path,
            built.document["cdiVersion"],
            version,
            len(built.device_names),
        )
        return True

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def on_node_change(self, facts: NodeFacts) -> None:
        """A ``NodeState`` listener (called in the event loop): rewrite soon, one at a time."""
        self._wanted = facts
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="cdi-spec")

    async def _drain(self) -> None:
        while self._wanted is not None:
            facts, self._wanted = self._wanted, None
            try:
                await self.write(facts)
            except Exception:
                log.exception("CDI spec %s: rewrite failed", self.path)

    async def settled(self) -> None:
        """Wait until every node change seen so far is written (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def close(self) -> None:
        """Stop rewriting; the spec stays on disk (see the module docstring)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._current is not None:
            log.info(
                "Leaving the CDI spec %s in place: containers that name nvidia.com/gpu "
                "devices still start while the agent is down",
                self.path,
            )
