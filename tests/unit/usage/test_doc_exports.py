"""The SQL exports docs/usage.md shows ("The database"), run on a ledger the store wrote."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

from tests.unit.usage import ROOT, batch, hold, open_store

DOC = ROOT / "docs" / "usage.md"


def test_the_csv_export_of_the_last_week_lists_the_holds_of_the_last_week(
    tmp_path: Path,
) -> None:
    found = re.search(r'"(SELECT h\.\*.*?GROUP BY h\.id)"', DOC.read_text(), re.DOTALL)
    assert found is not None, "the CSV export is no longer in docs/usage.md"
    now = time.time()
    path = tmp_path / "usage.db"
    store = open_store(path)
    try:
        store.submit(
            batch(
                hold("lease-1", started=now - 3600, ended=now - 600, labels=(("team", "ml"),)),
                hold("lease-2", started=now - 600, last_seen=now - 10),
                hold("lease-3", started=now - 30 * 86400, ended=now - 20 * 86400),
            )
        )
        assert store.flush(10)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(found.group(1)).fetchall()
    finally:
        conn.close()
    assert sorted((row[1].split("|")[0], row[-1]) for row in rows) == [
        ("lease-1", "team=ml"),
        ("lease-2", None),
    ]
