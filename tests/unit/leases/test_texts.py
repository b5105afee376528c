"""The holder lines every refusal is made of (``agent.leases.texts.taken_text``)."""

from __future__ import annotations

from agent.leases.answers import Hold, Taken
from agent.leases.texts import taken_text

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
ID = "0002abababab" + "cd" * 26


def test_each_kind_of_holder_reads_as_a_sentence() -> None:
    running = Taken("2", None, Hold.RUNNING, "lease-2", ID, T0)
    stopped = Taken("2", None, Hold.STOPPED, "lease-2", ID, T0, T0 + 600)
    foreign = Taken("6", None, Hold.FOREIGN, None, "c0ffee000000" + "0" * 52, T0,
                    why="--device /dev/nvidia6")  # fmt: skip
    process = Taken("5", None, Hold.FOREIGN, None, "pid 9685", T0, why="a GPU process")
    assert (
        taken_text(running)
        == "GPU 2 by container 0002abababab (lease-2) since 2026-01-01T00:00:00Z"
    )
    assert taken_text(stopped) == (
        "GPU 2 by container 0002abababab (lease-2), not running, since 2026-01-01T00:00:00Z, "
        "until 2026-01-01T00:10:00Z"
    )
    assert taken_text(foreign) == (
        "GPU 6 by foreign container c0ffee000000 (--device /dev/nvidia6) since 2026-01-01T00:00:00Z"
    )
    assert taken_text(process) == "GPU 5 by pid 9685 (a GPU process) since 2026-01-01T00:00:00Z"


def test_a_holder_without_an_id_is_named_as_unknown_not_cut_short() -> None:
    running = Taken("2", None, Hold.RUNNING, "lease-2", None, T0)
    foreign = Taken("6", None, Hold.FOREIGN, None, None, T0)
    assert (
        taken_text(running) == "GPU 2 by an unknown container (lease-2) since 2026-01-01T00:00:00Z"
    )
    assert taken_text(foreign) == "GPU 6 by an unknown holder since 2026-01-01T00:00:00Z"
