"""A GPU create's lease: asked of the agent's ``LeaseService`` (in-process), turned into the
create's ``Addition``, given back when the engine does not create the container.

Where the engine reads the node's CDI spec (``agent.engine_socket.cdi_form``), the leased
GPUs are given as the spec's CDI names (``/docker/cli?format=cdi``'s), and the spec brings
the nodes and the driver volume. Elsewhere the devices and the driver volume are
``/docker/cli``'s (``agent.api.docker_cli``: the node's control devices, then the leased
GPUs' nodes, MIG capability nodes included; the volumes of the plugin's driver). An engine
without Docker's volume plugins (Podman's service: ``driver_volumes`` given) gets each
driver volume's directory bound read-only instead, the volume built first where it is not
on disk yet (in a thread: a first build copies the driver's files). The labels
are ``labels_for`` the lease; the cpuset is the grant's NUMA nodes' CPUs where this host has
those nodes (``agent.api.leases.Cpusets``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.api.docker_cli import docker_cli_for
from agent.api.leases import Cpusets
from agent.cdi_spec.inputs import CdiNaming, cdi_names
from agent.engine_socket.cdi_form import CdiForm
from agent.engine_socket.create import Addition, CreateError, GpuRequest, Mount
from agent.engines.containers import created_container
from agent.health.selection import UnhealthyDevice
from agent.leases.answers import Granted
from agent.leases.asks import Ask, InvalidAsk
from agent.leases.labels import labels_for
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from agent.node.selection import InvalidParameter, select_volumes
from plugin.volume_specs import VOLUME_DRIVER
from plugin.volumes import VolumeError

log = logging.getLogger("nvidia-docker-plugin.engine-socket")

OWNER_VIA = ("via", "engine-socket")
MAX_OWNER_VALUE = 128


class GpuCreates:
    """Leases for creates through the engine socket."""

    def __init__(
        self,
        leases: LeaseService,
        facts: Callable[[], NodeFacts],
        cpusets: Cpusets | None = None,
        cdi: CdiForm | None = None,
        driver_volumes: Callable[[str], Path] | None = None,
        engine: str = "",
    ) -> None:
        self._leases = leases
        self._facts = facts
        self._cpusets = cpusets or Cpusets()
        self._cdi = cdi  # None: the device-node form always (the agent writes no CDI spec)
        # A driver volume's name -> its directory, built if missing (blocking): given for an
        # engine that has no Docker volume plugins, whose creates bind the directories.
        self._driver_volumes = driver_volumes
        self._engine = engine  # the engine's name in the lease table (its socket's path)

    def _ask(self, request: GpuRequest, name: str | None) -> Ask:
        owner = [OWNER_VIA]
        if name:
            owner.append(("name", name[:MAX_OWNER_VALUE]))
        if request.device_ids:
            devices = " ".join(request.device_ids)
        elif request.every_gpu:
            targets = self._facts().usable(None)
            devices = " ".join(str(t.gpu.index) for t in targets if t.mig is None)
            if not devices:
                raise CreateError(409, "this node has no healthy GPU to give")
        else:
            return Ask(
                count=request.count,
                mig_profile=request.mig_profile,
                owner=tuple(owner),
                wait_s=request.wait_s,
            )
        return Ask(devices=devices, owner=tuple(owner), wait_s=request.wait_s)

    async def lease(self, request: GpuRequest, name: str | None) -> tuple[Granted, Addition]:
        """The grant for ``request`` and what it adds to the create; ``CreateError`` with
        the table's own line when it cannot be had now, or within the request's wait (409),
        or is malformed (400). A create that waits is queued first come, first served."""
        try:
            answer = await self._leases.ask(self._ask(request, name))
        except InvalidAsk as err:
            raise CreateError(400, str(err)) from None
        if not isinstance(answer, Granted):
            raise CreateError(409, answer.text)
        try:
            naming = await self._cdi.naming() if self._cdi is not None else None
            addition = self._addition(answer, naming)
            return answer, await self._bound(addition)
        except (InvalidParameter, UnhealthyDevice) as err:
            self.release(answer.lease.id)
            raise CreateError(409, f"the leased GPUs cannot be given: {err}") from None
        except (VolumeError, OSError) as err:
            self.release(answer.lease.id)
            raise CreateError(
                500, f"the driver's files cannot be given ({err}): see the agent's log"
            ) from None
        except BaseException:  # its client left meanwhile: given back now, not at its expiry
            self.release(answer.lease.id)
            raise

    def _addition(self, grant: Granted, naming: CdiNaming | None) -> Addition:
        facts = self._facts()
        targets = facts.usable(grant.dev)
        cpus, mems = self._cpusets.of(grant.numa_nodes)
        uuids = [u.uuid for u in grant.units if u.uuid]
        visible = (
            ",".join(uuids)
            if len(uuids) == len(grant.units)
            else ",".join(u.name for u in grant.units)
        )
        devices: tuple[str, ...] = ()
        mounts: tuple[Mount, ...] = ()
        cdi_devices: tuple[str, ...] = ()
        if naming is not None:  # the spec brings the nodes and the driver volume
            cdi_devices = cdi_names(targets, naming)
        else:
            specs = select_volumes(None)
            version = facts.node.driver_version
            devices = docker_cli_for(version, facts.control_devices, targets, specs).devices
            mounts = tuple(
                Mount(
                    spec.docker_name(version),
                    spec.mountpoint,
                    "ro" in spec.mount_options.split(","),
                    VOLUME_DRIVER,
                )
                for spec in specs
            )
        return Addition(
            devices=devices,
            mounts=mounts,
            cdi_devices=cdi_devices,
            labels=labels_for(grant.lease),
            visible=visible,
            cpuset_cpus=cpus,
            cpuset_mems=mems,
        )

    async def _bound(self, addition: Addition) -> Addition:
        """``addition`` with its driver volumes as their directories bound, where the
        engine has no volume plugins; as it is elsewhere."""
        built = self._driver_volumes
        if built is None or not addition.mounts:
            return addition
        mounts = []
        for mount in addition.mounts:
            try:
                path = await asyncio.to_thread(built, mount.source)
            except (VolumeError, OSError):
                log.exception("Engine socket: the volume %s could not be made", mount.source)
                raise
            mounts.append(replace(mount, source=str(path), driver=None))
        return replace(addition, mounts=tuple(mounts))

    def bind(self, sent: Mapping[str, Any], answer: bytes) -> None:
        """The engine made the container of a leased create (``sent``: the body sent on, its
        lease labels ours; ``answer``: the engine's, ``{"Id": ...}``): the table binds the
        lease to it now. Its events may come too late to: Podman's inspects and list wait
        while a container starts, and a ``docker run --rm`` of a short job is gone by then,
        which left the lease pending until its expiry. An answer without a container id is
        left to the events. Never raises: the client gets the engine's answer whatever
        happens here."""
        try:
            made = created_container(None, sent)
            container = replace(made, id=json.loads(answer)["Id"], engine=self._engine)
        except (ValueError, TypeError, KeyError):
            log.debug("Engine socket: the create's answer names no container: left to events")
            return
        if container.lease is None:
            return
        try:
            self._leases.created(container)
        except Exception:  # a bug: the client still gets the engine's answer
            log.exception("Engine socket: binding %s failed", container.lease.lease_id)

    def release(self, lease_id: str) -> None:
        """Give back the lease of a create the engine refused."""
        answer = self._leases.release(lease_id)
        log.info("Engine socket: the engine did not create the container: %s", answer.text)
