"""The agent's own metrics (``nvidia_docker_*``), kept in a registry of its own.

What happens between scrapes is counted as it happens: REST requests (by route template
and status code, through ``count``, the REST API's connection guard's ``on_answer``, and
``count_resource``, the fast path's: a plain dictionary on the event loop, rendered by a
collector at scrape time, because prometheus_client's ``labels(...).inc()`` costs
about 4 us, a tenth of a cached answer's whole cost), and with prometheus_client's own
metric types status sweeps and their duration (``observe_sweep``, a ``StatusService`` listener),
driver volume builds (``observe_volume_build``, a ``VolumeStore`` listener, called from
the plugin's threads: prometheus_client's metrics are thread-safe). The process's own
CPU, memory and open files come from prometheus_client's process collector (``process_*``).
With TLS, ``nvidia_docker_tls_certificate_expiry_timestamp_seconds`` is read at scrape time
from the certificate served then (``follow_certificate``), so that it follows reloads.

Routes are labelled by their template (``/gpu/status/json``), never by the raw path, and
every path the router does not know is ``unmatched``: a scanner cannot grow the series.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import cast

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plugin.volume_build import BuildReport

UNMATCHED_ROUTE = "unmatched"
SWEEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
BUILD_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0)


class RequestCounts(Collector):
    """``nvidia_docker_http_requests_total`` by route and code, counted in a dictionary by
    the event loop (one thread: no lock), keyed by the route's resource object and the
    status number (the cheapest key to make per request), and named at scrape time."""

    def __init__(self) -> None:
        self.by_resource: Tally[tuple[object, int]] = Tally()
        self._templates: dict[int, str] = {}  # id(resource) -> its template, once

    def count(self, resource: object, canonical: str | None, status: int) -> None:
        self.by_resource[resource, status] += 1
        if id(resource) not in self._templates:
            self._templates[id(resource)] = canonical or UNMATCHED_ROUTE

    @property
    def counts(self) -> Tally[tuple[str, str]]:
        """By (route template, code), as the metric shows them."""
        named: Tally[tuple[str, str]] = Tally()
        for (resource, status), count in self.by_resource.items():
            named[self._templates[id(resource)], str(status)] += count
        return named

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "nvidia_docker_http_requests",
            "REST API requests answered, by route template and HTTP status code.",
            labels=("route", "code"),
        )
        for (route, code), count in sorted(self.counts.items()):
            family.add_metric([route, code], count)
        yield family


class CertificateExpiry(Collector):
    """``nvidia_docker_tls_certificate_expiry_timestamp_seconds``: the served certificate's
    ``notAfter`` (Unix time), read from ``source`` at scrape time; absent while ``source``
    gives None (no TLS, or a date that cannot be read)."""

    def __init__(self, source: Callable[[], float | None]) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        expires = self.source()
        if expires is None:
            return
        yield GaugeMetricFamily(
            "nvidia_docker_tls_certificate_expiry_timestamp_seconds",
            "When the REST API's TLS certificate (the one served now) expires: its notAfter, "
            "in seconds since the epoch.",
            value=expires,
        )


class AgentMetrics:
    """Counters of one running agent; ``render()`` gives their exposition text."""

    def __init__(self) -> None:
        # No *_created series: they double the series count for a start time that
        # nvidia_docker_build_info's process already gives (process_start_time_seconds).
        cast(Callable[[], None], disable_created_metrics)()  # untyped in prometheus_client
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = RequestCounts()
        self.registry.register(self.requests)
        self.sweeps = Histogram(
            "nvidia_docker_status_sweep_duration_seconds",
            "Time one status sweep of every GPU took (shared by concurrent requests).",
            buckets=SWEEP_BUCKETS_S,
            registry=self.registry,
        )
        self.volume_builds = Counter(
            "nvidia_docker_volume_builds",
            "Driver volumes built.",
            ("volume",),
            registry=self.registry,
        )
        self.volume_build_seconds = Histogram(
            "nvidia_docker_volume_build_duration_seconds",
            "Time a driver volume build took.",
            ("volume",),
            buckets=BUILD_BUCKETS_S,
            registry=self.registry,
        )
        self.volume_build_bytes = Counter(
            "nvidia_docker_volume_build_bytes",
            "Bytes of driver files placed in built volumes.",
            ("volume",),
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)

    def count(self, request: web.Request, status: int) -> None:
        """Count ``request``, answered ``status``, by route template and status code (given
        to the REST API's connection guard as its ``on_answer``)."""
        self.count_resource(request.match_info.route.resource, status)

    def count_resource(self, resource: AbstractResource | None, status: int) -> None:
        """Count one request of the route ``resource``, answered ``status`` (the REST API's
        fast path, agent.edge.fast_gets, counts its answers here)."""
        if (resource, status) in self.requests.by_resource:  # the hot path: seen before
            self.requests.by_resource[resource, status] += 1
            return
        unmatched = resource is None or resource.name == UNMATCHED_ROUTE
        canonical = None if unmatched or resource is None else resource.canonical
        self.requests.count(resource, canonical, status)

    def follow_certificate(self, source: Callable[[], float | None]) -> None:
        """Serve the TLS certificate's expiry, as ``source`` gives it at each scrape
        (``ServerTls.not_after``)."""
        self.registry.register(CertificateExpiry(source))

    def observe_sweep(self, duration_s: float) -> None:
        self.sweeps.observe(duration_s)

    def observe_volume_build(self, volume: str, report: BuildReport) -> None:
        self.volume_builds.labels(volume).inc()
        self.volume_build_seconds.labels(volume).observe(report.seconds)
        self.volume_build_bytes.labels(volume).inc(report.size_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
