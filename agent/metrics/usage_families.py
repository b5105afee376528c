"""The usage ledger's metric families (docs/metrics.md, docs/usage.md).

- ``nvidia_docker_usage_gpu_seconds_total`` and ``nvidia_docker_usage_busy_gpu_seconds_total``
  (counters since the agent started): GPU-seconds held, and busy, by owner label:
  ``owner_label`` is the label's key (``team``, ``com.docker.compose.project``), ``owner``
  its value (empty for holders without it). Every holder counts once under each recorded
  key, so the series of one key add up to the node's total. At most
  ``agent.usage.ledger.MAX_SERIES`` (1000) series in all; a value beyond counts as ``(other)``.
- ``nvidia_docker_gpu_idle_seconds`` (a gauge): for each idle GPU unit and holder, how long
  it has been idle, with the policy that applies and what was done.
- ``nvidia_docker_usage_ledger_behind``: 1 while the ledger cannot write (a full disk, say;
  its figures are kept in memory and written once it can), else 0.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.usage.ledger import UsageLedger, idle_rows


def usage_families(ledger: UsageLedger, hostname: str) -> list[Metric]:
    held = CounterMetricFamily(
        "nvidia_docker_usage_gpu_seconds",
        "GPU-seconds held (a MIG device's seconds count as its own), by owner label, since "
        "the agent started.",
        labels=("owner_label", "owner", "Hostname"),
    )
    busy = CounterMetricFamily(
        "nvidia_docker_usage_busy_gpu_seconds",
        "GPU-seconds held times the GPU's utilisation, by owner label, since the agent started.",
        labels=("owner_label", "owner", "Hostname"),
    )
    for (key, value), (held_s, busy_s) in sorted(ledger.by_owner.items()):
        held.add_metric([key, value, hostname], held_s)
        busy.add_metric([key, value, hostname], busy_s)
    idle = GaugeMetricFamily(
        "nvidia_docker_gpu_idle_seconds",
        "Seconds a held GPU (or MIG device) has had no utilisation and no process of its "
        "holder, for each idle one (docs/usage.md, 'Idle GPUs').",
        labels=(
            "gpu", "UUID", "device", "Hostname", "holder", "lease", "container_id",
            "container", "policy", "action",
        ),
    )  # fmt: skip
    now_s = time.time()
    for found, action in idle_rows(ledger):
        holder = found.holder
        idle.add_metric(
            [
                str(found.gpu_index),
                found.mig_uuid or found.gpu_uuid,
                found.unit,
                hostname,
                holder.kind.value,
                holder.lease_id or "",
                holder.container_id or "",
                holder.container_name or "",
                found.policy.value,
                action or "",
            ],
            max(0.0, now_s - found.idle_since_s),
        )
    behind = GaugeMetricFamily(
        "nvidia_docker_usage_ledger_behind",
        "1 while the usage ledger cannot write its database (its figures wait in memory).",
    )
    status = ledger.store_status()
    behind.add_metric([], 1.0 if status is not None and status.behind else 0.0)
    return [held, busy, idle, behind]
