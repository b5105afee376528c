"""``/metrics``: the node as a Prometheus target, under dcgm-exporter's names (docs/metrics.md).

Only this package imports prometheus_client.
"""
