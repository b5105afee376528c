"""The text exposition of the GPU families, written as dcgm-exporter writes its own.

prometheus-client's renderer names every counter ``<name>_total`` in its ``# HELP`` and
``# TYPE`` lines, as the Prometheus text format recommends; dcgm-exporter declares its
monotonic fields ``counter`` under their own names (``# TYPE
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter``, samples without ``_total``), and those names
are what dashboards query. ``render_families`` writes families of prometheus-client
``Metric`` values exactly as prometheus-client does (the same escaping, label order and
number format), except that a counter keeps its name. Prometheus reads both the same; its
``promtool check metrics`` notes that such a counter lacks the suffix.

The samples of one GPU share one labels mapping, so each distinct mapping is escaped once
per rendering.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString as _go_float

_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _number(value: float) -> str:
    """A sample value as prometheus-client writes it (Go's float format)."""
    text: str = _go_float(value)  # type: ignore[no-untyped-call]
    return text


def render_families(families: Iterable[Metric]) -> bytes:
    """The text format (version 0.0.4) of ``families``; counters keep their names."""
    out: list[str] = []
    label_text: dict[int, tuple[Mapping[str, str], str]] = {}
    for family in families:
        kind = _TYPES.get(family.type, family.type)
        out.append(f"# HELP {family.name} {_escape_help(family.documentation)}\n")
        out.append(f"# TYPE {family.name} {kind}\n")
        for sample in family.samples:
            labels = sample.labels
            cached = label_text.get(id(labels))
            if cached is None or cached[0] is not labels:
                text = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
                cached = (labels, "{" + text + "}" if text else "")
                label_text[id(labels)] = cached
            out.append(f"{sample.name}{cached[1]} {_number(sample.value)}\n")
    return "".join(out).encode("utf-8")
