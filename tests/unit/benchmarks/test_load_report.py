"""The benchmark's summary: ranges over rounds, which side was CPU-bound, and ratios
against 1.0.1's side-by-side figures only where that run gave them."""

from __future__ import annotations

from tests.benchmarks.load_report import summary_table
from tests.benchmarks.loadgen import Measurement


def _measurement(
    path: str, clients: int, rate_per_s: float, server_cores: float, client_cores: float
) -> Measurement:
    window_s = 3.0
    return Measurement(
        path=path,
        clients=clients,
        connections_per_process=(clients,),
        requests=int(rate_per_s * window_s),
        errors=0,
        elapsed_s=window_s,
        p50_ms=1.0,
        p99_ms=2.0,
        window_s=window_s,
        client_cpu_s=(client_cores * window_s,),
        server_cpu_s=server_cores * window_s,
        machine_cpu_s=(client_cores + server_cores) * window_s,
        cpus=16,
    )


def test_rounds_become_ranges_and_a_busy_server_is_named() -> None:
    rounds = [
        _measurement("/gpu/info/json", 64, 25_000, server_cores=1.0, client_cores=0.4),
        _measurement("/gpu/info/json", 64, 27_000, server_cores=0.99, client_cores=0.5),
    ]
    table = summary_table(rounds, against_old_tool=True)
    row = table[2]
    assert "25,000-27,000" in row
    assert "| server |" in row
    assert "0.99-1.00" in row
    # against 85,000-93,000 req/s: 25,000 / 93,000 = 0.27 ... 27,000 / 85,000 = 0.32
    assert "0.27-0.32x of 85,000-93,000/s" in row


def test_a_saturated_client_process_is_named() -> None:
    row = summary_table(
        [_measurement("/docker/cli", 1, 9_000, server_cores=0.5, client_cores=0.95)],
        against_old_tool=False,
    )[2]
    assert "| client |" in row
    assert "vs 1.0.1" not in summary_table([], against_old_tool=False)[0]


def test_routes_with_only_a_ratio_show_that_ratio_and_no_invented_rate() -> None:
    table = summary_table(
        [
            _measurement("/docker/cli", 64, 30_000, 1.0, 0.5),
            _measurement("/gpu/status/json", 16, 16_000, 1.0, 0.3),
        ],
        against_old_tool=True,
    )
    assert table[2].endswith("| side-by-side run 0.44-1.07x |")
    assert table[3].endswith("|  |"), "the side-by-side run had no figure for 16 clients"
