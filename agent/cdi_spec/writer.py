"""The node's CDI spec on disk (``<cdi spec dir>/nvidia-docker.json``), kept current.

The daemon builds one ``CdiSpecWriter`` when ``--cdi-spec-dir`` is set, writes the spec once
before it serves the REST API (a failure there is retried, as below), and subscribes the
writer to the node state: every ``NodeState.replace`` (a driver upgrade, a GPU's health, MIG
devices) rewrites it. A rewrite first makes sure the driver volume of the node's driver
exists (the spec mounts it), then replaces the file through
``agent.files.write_atomically``: a temporary file with a random name, created inside the
directory without following links (``O_EXCL | O_NOFOLLOW``), mode 0644, fsynced and renamed
over the spec, so an engine reads the old spec or the new one, never a part, and nothing
planted in the directory is ever opened or exposed. The spec on disk is read back (to leave
an identical one alone) only when it is a regular file of at most ``MAX_SPEC_BYTES``, opened
without following a link or blocking on a FIFO; anything else at its name is replaced.
Rewrites run one at a time; node changes that arrive meanwhile fold into one more rewrite
with the latest facts. A spec with the same bytes as the file is not rewritten.

Each rewrite also finds the host files containers get (``agent.cdi_spec.host_files``) and
looks at the other specs in the directories engines read (``agent.cdi_spec.other_specs``;
a poll every ``WATCH_INTERVAL_S`` asks whether they changed, and a change rewrites). When
another spec in the directory engines read ours from defines some of our devices, engines
would drop those devices from both: the agent then *steps aside*, removes its spec and
leaves the kind to the other one, says so once (``agent.cdi_spec.beside``) and answers
``/docker/cli?format=cdi`` with that spec's names (``naming``); its spec comes back when the
other goes. Another spec elsewhere is only warned about: engines take each device from the
later directory of their list, so one of the two serves it (docs/cdi.md, "Beside NVIDIA's
toolkit: one producer per kind").

A rewrite that fails (a full disk, a directory at the spec's name, a volume that cannot be
built) is one log line; it is tried again after ``RETRY_FIRST_S``, then after twice as long
each time up to ``RETRY_MAX_S``, at once when the node changes, and at ``SIGHUP``
(``reload``).

When the agent stops, the spec stays: containers with a restart policy that name devices of
its kind (``--cdi-kind``, ``nvidia.com/gpu`` by default) must still start while the agent
restarts, and the devices and the driver volume it names are still there. The next start
rewrites it (docs/cdi.md).
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

from agent import files
from agent.cdi_spec.beside import Beside, aside_reason
from agent.cdi_spec.host_files import HostFiles, find_host_files
from agent.cdi_spec.inputs import OWN_NAMING, ROOT, CdiNaming, spec_inputs
from agent.cdi_spec.other_specs import OtherSpecs
from agent.node.facts import NodeFacts
from cdi import others, spec
from plugin.volume_specs import VOLUMES
from plugin.volumes import VolumeStore

log = logging.getLogger("nvidia-docker-plugin.cdi")

SPEC_NAME = "nvidia-docker.json"
# Where every CDI reader looks (Podman always; Docker 25+ unless its daemon.json says else).
SCANNED_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
FILE_MODE = 0o644
# A spec names a few hundred files at most (tens of KB); anything larger is not ours.
MAX_SPEC_BYTES = 4 * 1024 * 1024
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
WATCH_INTERVAL_S = 2.0  # how often the other specs' directories are looked at
HOOK_PROGRAM = "nvidia-docker-cdi-hook"
SYSTEM_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"

EnsureVolume = Callable[[str], Path]  # driver version -> the volume's directory (blocking)
# facts -> the units not handed out: GPU indices, and (GPU, MIG device) of MIG devices
# withdrawn on their own
Unhealthy = Callable[[NodeFacts], frozenset[int | tuple[int, int]]]


def no_unhealthy_gpus(_facts: NodeFacts) -> frozenset[int | tuple[int, int]]:
    """Until the node's health is known to the facts, every GPU counts as healthy."""
    return frozenset()


def volume_builder(store: VolumeStore) -> EnsureVolume:
    """The driver volume of a driver version, built by the plugin's store when missing (the
    same volume ``docker run --volume-driver=nvidia-docker`` mounts), and kept: the plugin's
    Remove refuses it from then on (Docker does not know the containers that mount it by
    path through the spec), until another driver's volume is asked for."""
    driver = VOLUMES[0]  # nvidia_driver, at /usr/local/nvidia

    def ensure(driver_version: str) -> Path:
        return store.create(driver.docker_name(driver_version), keep=True)

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
    dev_root: Path = ROOT  # where device nodes and the driver's host files are
    hook: spec.LinkerCacheHook | None = None
    kind: str = spec.KIND
    scanned_dirs: tuple[Path, ...] = SCANNED_DIRS  # where engines look, in their order
    watch_interval_s: float = WATCH_INTERVAL_S


class CdiSpecWriter:
    """Writes the spec for the facts it is given; see the module docstring."""

    def __init__(
        self,
        settings: CdiSettings,
        ensure_volume: EnsureVolume,
        unhealthy: Unhealthy = no_unhealthy_gpus,
        *,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.settings = settings
        self._ensure_volume = ensure_volume
        self._unhealthy = unhealthy
        self._retry_first_s = retry_first_s
        self._retry_max_s = retry_max_s
        self._current: bytes | None = None
        self._wanted: NodeFacts | None = None
        self._task: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()
        self._quiet = asyncio.Event()  # no rewrite running: done, or waiting to retry
        self._quiet.set()
        self._checked_readers = False
        self.failure: str | None = None  # why the last rewrite failed; None once one works
        self._facts: NodeFacts | None = None  # the latest facts, for a rewrite of the poll
        self._others = OtherSpecs((*settings.scanned_dirs, settings.spec_dir), self.path)
        self._beside = Beside(self.path, settings.kind, settings.scanned_dirs)
        self._standing = others.Standing()
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def path(self) -> Path:
        return self.settings.spec_dir / SPEC_NAME

    @property
    def current(self) -> bytes | None:
        """The spec as last written (or found already written); None before that, and
        while the agent steps aside."""
        return self._current

    @property
    def aside(self) -> str | None:
        """Why the agent stepped aside for another spec, one line; None when it did not."""
        if not self._standing.aside:
            return None
        return aside_reason(self._standing, self.settings.kind)

    @property
    def naming(self) -> CdiNaming:
        """The spec in force, for ``/docker/cli?format=cdi``: ours, or the one ours stepped
        aside for (its names)."""
        if self._standing.aside:
            source = ", ".join(sorted(other.path for other in self._standing.clashing))
            return CdiNaming(self.settings.kind, self._standing.names_in_force, source)
        if self.settings.kind != OWN_NAMING.kind:
            return CdiNaming(self.settings.kind)
        return OWN_NAMING

    @property
    def dirs_in_force(self) -> frozenset[Path]:
        """The directories of the spec whose names are in force: this agent's spec directory
        once its spec is written, the other producer's while the agent steps aside for it;
        empty before either (an engine must read one of them for the names to resolve)."""
        if self._standing.aside:
            return frozenset(Path(other.directory) for other in self._standing.clashing)
        return frozenset((self.settings.spec_dir,)) if self._current is not None else frozenset()

    def build(
        self, facts: NodeFacts, driver_volume: Path | None, host: HostFiles | None = None
    ) -> spec.BuiltSpec:
        host = host or HostFiles()
        inputs = spec_inputs(
            facts.node,
            unhealthy=self._unhealthy(facts),
            driver_volume=driver_volume,
            hook=self.settings.hook,
            dev_root=self.settings.dev_root,
            kind=self.settings.kind,
            host_files=host.mounts,
            drm=host.drm,
        )
        return spec.build_spec(inputs)

    async def write(self, facts: NodeFacts) -> bool:
        """Write the spec for ``facts`` once; False (one line logged) when it could not be,
        and the previous spec stays. ``start`` and node changes retry; this does not."""
        self._facts = facts
        failure = await self._attempt(facts)
        if failure is not None:
            log.error("%s", failure)
        return failure is None

    async def _attempt(self, facts: NodeFacts) -> str | None:
        """One rewrite; what went wrong as one line, or None."""
        version = facts.node.driver_version
        try:
            volume = await asyncio.to_thread(self._ensure_volume, version)
        except Exception as err:
            return self._failed(f"the driver volume of driver {version} cannot be built ({err})")
        root = self.settings.dev_root
        host = await asyncio.to_thread(find_host_files, facts.node, volume, root)
        built = self.build(facts, volume, host)
        if not built.document["devices"]:
            return self._failed("no GPU can be named")
        ours = frozenset(built.device_names)
        standing, our_dirs = await asyncio.to_thread(self._stand, ours)
        if standing.aside:
            return await self._step_aside(standing, ours, our_dirs)
        data = spec.encode(built.document)
        on_disk, found = await asyncio.to_thread(self._read)
        if found is not None:
            log.warning("CDI spec %s: %s; replacing it", self.path, found)
        try:
            if on_disk != data:
                await asyncio.to_thread(
                    files.write_atomically,
                    self.settings.spec_dir,
                    SPEC_NAME,
                    data,
                    mode=FILE_MODE,
                )
        except OSError as err:
            return self._failed(_os_reason(err, self.path))
        changed = on_disk != data
        self._current = data
        self._standing = standing
        self._beside.tell(standing, ours, our_dirs)
        if self.failure is not None:
            log.info("CDI spec %s: written again after the failure", self.path)
        self.failure = None
        if not self._checked_readers:
            self._checked_readers = True
            scanned = self.settings.scanned_dirs
            if not readers_find(self.path, scanned):
                log.warning(
                    "CDI readers (Podman; Docker 25+ by default) scan %s only, and none of "
                    "them holds %s or a link to it: link %s to it (docs/cdi.md)",
                    " and ".join(map(str, scanned)),
                    self.path,
                    scanned[-1] / SPEC_NAME,
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
        return None

    def _stand(self, ours: frozenset[str]) -> tuple[others.Standing, frozenset[str]]:
        """Where ours stands among the other specs now, and the directories it is read from
        (blocking)."""
        found = self._others.read()
        our_dirs = self._others.our_directories()
        return others.standing(self.settings.kind, ours, our_dirs, found), our_dirs

    async def _step_aside(
        self, standing: others.Standing, ours: frozenset[str], our_dirs: frozenset[str]
    ) -> str | None:
        """Remove our spec, so that the other one in its directory serves the devices."""
        try:
            await asyncio.to_thread(self._remove)
        except OSError as err:
            return self._failed(f"cannot be removed to step aside ({_os_reason(err, self.path)})")
        self._current = None
        self._standing = standing
        self._beside.tell(standing, ours, our_dirs)
        self.failure = None
        return None

    def _remove(self) -> None:
        """Unlink whatever is at our spec's name (a directory there is no spec: left)."""
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(self.path)

    def _failed(self, why: str) -> str:
        self.failure = why
        return f"CDI spec {self.path} not written: {why}; keeping the previous one"

    def _read(self) -> tuple[bytes | None, str | None]:
        """The spec on disk if it is ours to compare (a regular file, within the bound),
        and what else is at its name when that is worth a warning."""
        try:
            return files.read_regular(
                self.path, limit=MAX_SPEC_BYTES, what="CDI spec", follow=False
            ), None
        except files.UnusableFile as err:
            if not os.path.lexists(self.path):
                return None, None
            return None, str(err).removeprefix(f"CDI spec {self.path} ")

    def start(self, facts: NodeFacts) -> None:
        """Write the spec for ``facts`` soon, retrying until it is written, and watch the
        other specs (in the loop)."""
        self.on_node_change(facts)
        if self._watch_task is None:
            loop = asyncio.get_running_loop()
            self._watch_task = loop.create_task(self._watch(), name="cdi-other-specs")

    async def _watch(self) -> None:
        """Every ``watch_interval_s``: rewrite when the other specs changed (not while a
        failed rewrite waits for its retry: that one looks again)."""
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            try:
                changed = await asyncio.to_thread(self._others.changed)
            except Exception:  # a bug of ours: the next poll asks again
                log.debug("CDI spec directories could not be looked at", exc_info=True)
                continue
            if changed and self.failure is None and self._facts is not None:
                self.on_node_change(self._facts)

    def on_node_change(self, facts: NodeFacts) -> None:
        """A ``NodeState`` listener (called in the event loop): rewrite soon, one at a time."""
        self._facts = facts
        self._wanted = facts
        self._poke.set()
        self._quiet.clear()  # the drain sets it again when done, or waiting to retry
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="cdi-spec")

    async def reload(self, facts: NodeFacts) -> None:
        """SIGHUP: write the spec for ``facts`` now, even while a retry waits (a spec removed
        by hand comes back); raises ``OSError`` with the reason when it cannot be."""
        self.on_node_change(facts)
        await self.settled()
        if self.failure is not None:
            raise OSError(f"{self.path}: {self.failure}")

    async def _drain(self) -> None:
        delay = self._retry_first_s
        while self._wanted is not None:
            facts, self._wanted = self._wanted, None
            self._poke.clear()
            self._quiet.clear()
            try:
                failure = await self._attempt(facts)
            except Exception as err:  # a bug of ours: one line, and the retry
                failure = self._failed(f"{type(err).__name__}: {err}")
                log.debug("CDI spec rewrite failed", exc_info=True)
            if failure is None:
                delay = self._retry_first_s
                continue
            log.error("%s; trying again in %g s, at a node change or at SIGHUP", failure, delay)
            if self._wanted is None:
                self._wanted = facts
            self._quiet.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), delay)
            delay = min(delay * 2, self._retry_max_s)
        self._quiet.set()

    async def settled(self) -> None:
        """Wait until every node change seen so far is written, or failed and waits to be
        tried again."""
        while self._task is not None and not self._task.done() and not self._quiet.is_set():
            quiet = asyncio.ensure_future(self._quiet.wait())
            await asyncio.wait({quiet, self._task}, return_when=asyncio.FIRST_COMPLETED)
            quiet.cancel()

    async def close(self) -> None:
        """Stop rewriting; the spec stays on disk (see the module docstring)."""
        for task in (self._watch_task, self._task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._current is not None:
            log.info(
                "Leaving the CDI spec %s in place: containers that name %s devices still "
                "start while the agent is down",
                self.path,
                self.settings.kind,
            )


def _os_reason(err: OSError, path: Path) -> str:
    """An ``OSError`` of a rewrite as a person reads it, with what to do where it helps."""
    reason = err.strerror or str(err)
    if isinstance(err, IsADirectoryError | NotADirectoryError) or err.errno == 39:
        return f"{reason}: a directory is in the way at {path}; remove it"
    if err.errno == 28:
        return f"{reason} on the file system of {path.parent}"
    return reason
