"""The lease table's metric families: who holds each GPU, idle or not (docs/metrics.md).

dcgm-exporter labels a GPU's samples with the Kubernetes pod that was given it, and only
under Kubernetes; here every holder the table knows is a sample of its own, whether its
container uses the GPU right now or sits idle, which is what a usage question ("who has
GPU 3, and is it doing anything?") needs beside ``DCGM_FI_DEV_GPU_UTIL``:

- ``nvidia_docker_gpu_leased`` (1 per unit and lease): ``gpu``, ``UUID``, ``device`` (the
  unit's dev name: ``3``, or ``3:1`` for a MIG device), ``Hostname`` as the GPU families
  have them, then ``lease``, ``state`` (pending, running, stopped), ``container_id`` (empty
  while pending), ``container_name`` and ``image`` (as its engine says them, through the
  attribution's cache; empty while pending or while no engine has answered), ``exclusive``
  and ``owner`` (the ask's owner labels, ``key=value`` joined by commas, cut to
  ``MAX_OWNER_CHARS``);
- ``nvidia_docker_gpu_lease_state`` (1 per unit): the unit's state (free, pending, leased,
  foreign, conflict) and whether it is healthy;
- ``nvidia_docker_lease_waiting``: asks waiting in the queue.

The table is read at scrape time (a view is a few microseconds for 8 GPUs), not per sweep:
a lease granted between two scrapes that share a sweep shows at the next one.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from agent.leases.answers import Hold
from agent.leases.view import TableView

Named = tuple[str | None, str | None]  # a container's name and image

MAX_OWNER_CHARS = 256
_UNIT = ("gpu", "UUID", "device", "Hostname")


def _owner_text(owner: tuple[tuple[str, str], ...]) -> str:
    text = ",".join(f"{key}={value}" for key, value in owner)
    return text if len(text) <= MAX_OWNER_CHARS else text[: MAX_OWNER_CHARS - 1] + "…"


def lease_families(
    view: TableView, hostname: str, containers: Mapping[str, Named] | None = None
) -> list[Metric]:
    """The families of one view of the table (see the module docstring); ``containers``:
    the name and image of the leases' containers, by id, where known."""
    known = containers or {}
    leased = GaugeMetricFamily(
        "nvidia_docker_gpu_leased",
        "1 for each GPU (or MIG device) and the lease that holds it, with its container, "
        "whether the container uses the GPU or not.",
        labels=(
            *_UNIT,
            "lease",
            "state",
            "container_id",
            "container_name",
            "image",
            "exclusive",
            "owner",
        ),
    )
    states = GaugeMetricFamily(
        "nvidia_docker_gpu_lease_state",
        "1 for each GPU (or MIG device), labelled with its lease state and health.",
        labels=(*_UNIT, "state", "healthy"),
    )
    leases = {lease.id: lease for lease in view.leases}
    for unit in view.units:
        base = [str(unit.gpu), unit.uuid or "", unit.name, hostname]
        states.add_metric([*base, unit.state.value, str(unit.healthy).lower()], 1)
        for taken in unit.holders:
            lease = leases.get(taken.lease_id or "")
            if lease is None or taken.hold is Hold.FOREIGN:
                continue
            name, image = known.get(lease.container_id or "", (None, None))
            leased.add_metric(
                [
                    *base,
                    lease.id,
                    lease.state.value,
                    lease.container_id or "",
                    name or "",
                    image or "",
                    str(lease.exclusive).lower(),
                    _owner_text(lease.owner),
                ],
                1,
            )
    waiting = GaugeMetricFamily(
        "nvidia_docker_lease_waiting",
        "Asks for GPUs waiting in the node's queue.",
        value=len(view.waiting),
    )
    return [leased, states, waiting]
