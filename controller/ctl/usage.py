"""``nvidia-docker-ctl usage|idle``: the nodes' usage ledgers across a fleet (docs/fleet.md,
"Usage and idle GPUs across the fleet").

::

    nvidia-docker-ctl usage -i fleet.yml --by label:team --since -7d     # GPU-hours per team
    nvidia-docker-ctl usage -i fleet.yml --by image --csv > week.csv
    nvidia-docker-ctl idle -i fleet.yml                                  # held, doing nothing

Both are fleet commands (``controller.ctl.fleet``): the same nodes, TLS, tokens, SSH,
timeouts, progress line, error lines and exit codes. Their reports are made once every node
is done (``usage`` sums the nodes' rows; ``idle`` lists the idle GPUs in the nodes' order),
so both print after the last node answers; ``--jsonl`` streams each node's answer as-is, as
the other commands' ``--jsonl`` does.

Exit codes: ``usage`` 0 every node answered, 1 some failed (an agent without a ledger, or
that refused the query, counts as failed: the totals lack it), 3 no node's agent could be
reached; ``idle`` 0 every node answered and no GPU is idle, 1 some GPU is idle or some node
failed (a node that did not answer may have idle GPUs), 3 no node's agent could be reached.
2 for usage errors, as every command.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import click

from controller.ctl.flags import operator_options, request_options
from controller.ctl.fleet import (
    FLEET_OPTIONS,
    PROG,
    PROGRESS_MIN_NODES,
    FleetNodes,
    ask_each,
    gather_nodes,
    transports_for,
)
from controller.errors import EXIT_FAILED, EXIT_NO_ANSWER, EXIT_OK
from controller.fleet.usage_view import MAX_ROWS, check_by, check_time
from controller.options import Options, setting

if TYPE_CHECKING:
    from controller.fleet.query import NodeResult, Query
    from controller.fleet.report import Summary

_NODES = (
    "NODE uses the NV_HOST syntax: node1: | http://10.0.0.1:3476 | ssh://admin@node2:; "
    "no NODE, --nodes or --inventory: NV_HOST, else the local agent. "
)
USAGE_EPILOG = _NODES + (
    "S is Unix seconds, a time before now (-30m, -24h, -7d) or ISO 8601 with its zone "
    "(2026-12-01T00:00:00Z); each agent gets it as given. A node whose ledger is behind is "
    "named on stderr. Exit codes: 0 all nodes answered, 1 some failed (an agent without a "
    "usage ledger counts: the totals lack it), 2 usage or inventory error, 3 no agent could "
    "be reached. See docs/fleet.md."
)
IDLE_EPILOG = _NODES + (
    "For cron and alerting: exit 0 every node answered and no GPU is idle, 1 some GPU is idle "
    "or some node failed (stderr says which: a node that did not answer may have idle GPUs), "
    "2 usage or inventory error, 3 no agent could be reached. See docs/fleet.md."
)


# The agents' rule for a time before now (agent.api.usage): at most 9 digits before the unit
# or the fraction; a longer one is refused by every node, so it is refused here first.
_AGENT_RELATIVE = re.compile(r"-([0-9]{1,9}(?:\.[0-9]+)?)([smhd])")
_ANY_RELATIVE = re.compile(r"-[0-9]+(?:\.[0-9]+)?[smhd]")


def check_range_time(text: str) -> str:
    """``--since``/``--until`` as given, once it is known to be one the agents take: the
    fleet's ``check_time``, and a time before now of at most 9 digits (the agents' rule)."""
    value = text.strip()
    if _ANY_RELATIVE.fullmatch(value) and not _AGENT_RELATIVE.fullmatch(value):
        raise ValueError(
            "a time before now has at most 9 digits before its unit or decimal point "
            "(-30m, -24h, -7d, -1.5h): the agents refuse more"
        )
    return check_time(text)


@dataclass(frozen=True, slots=True)
class UsageRequest:
    since: str | None = setting(
        None,
        "Start of the range: Unix seconds, a time before now (-30m, -24h, -7d), or ISO 8601 "
        "with its zone (2026-12-01T00:00:00Z).",
        flags=("--since",),
        metavar="S",
        parse=check_range_time,
        shown="-24h",
    )
    until: str | None = setting(
        None,
        "End of the range, as --since.",
        flags=("--until",),
        metavar="U",
        parse=check_range_time,
        shown="now",
    )
    by: str = setting(
        "gpu",
        "Group the GPU time by gpu or container (rows of one node each), or by image or "
        "label:KEY (a label's values, label:team: summed across the nodes).",
        flags=("--by",),
        metavar="GROUP",
        parse=check_by,
    )
    max_rows: int | None = setting(
        None,
        f"At most N rows, the largest: each agent's limit= (its default 1000, at most "
        f"{MAX_ROWS}) and the report's. (-l/--limit selects inventory hosts.)",
        flags=("--max-rows",),
        kind="int",
        minimum=1,
        maximum=MAX_ROWS,
        metavar="N",
    )
    output: str = setting(
        "table",
        "How the report is printed.",
        flags=("--csv", "--json", "--jsonl"),
        kind="output",
        choices=("table", "csv", "json", "jsonl"),
        choice_help=(
            "",
            "CSV: a header, a row per group in seconds and joules, TOTAL last.",
            "One JSON list of the summed rows, largest first.",
            "One JSON line per node as it answers: its agent's answer as-is, not summed.",
        ),
    )


@dataclass(frozen=True, slots=True)
class IdleRequest:
    output: str = setting(
        "table",
        "How the idle GPUs are printed.",
        flags=("--json", "--jsonl"),
        kind="output",
        choices=("table", "json", "jsonl"),
        choice_help=(
            "",
            "One JSON list of the idle GPUs, each the agent's entry with its node.",
            "One JSON line per node as it answers: its agent's answer as-is.",
        ),
    )


def report_command(name: str, epilog: str) -> Callable[[Callable[..., Any]], click.Command]:
    """``fleet_command``'s arguments and options, less its ``--json``/``--jsonl``: these
    commands declare their own formats (their JSON is a report, not the nodes' answers)."""

    def decorate(function: Callable[..., Any]) -> click.Command:
        function = operator_options(*(o for o in FLEET_OPTIONS if o != "output"))(function)
        function = request_options(FleetNodes, "nodes")(function)
        function = click.argument("node", nargs=-1, metavar="[NODE]...")(function)
        return click.command(name, epilog=epilog)(function)

    return decorate


@report_command("usage", USAGE_EPILOG)
@request_options(UsageRequest, "request")
def usage(
    node: tuple[str, ...], nodes: FleetNodes, options: Options, request: UsageRequest
) -> None:
    """GPU-hours, busy share and energy from the nodes' usage ledgers, summed across the fleet
    by GPU, container, image or label."""
    from controller.fleet.usage_view import (  # noqa: PLC0415 (keep other commands fast)
        USAGE_PATH,
        UsageAsk,
        UsageReport,
        usage_query,
    )

    ask = UsageAsk(request.by, request.since, request.until, request.max_rows)
    ask.check()
    report = UsageReport(ask, request.max_rows)
    summary = run_report(usage_query(ask), report, USAGE_PATH, node, nodes, options, request.output)
    if summary.failed == 0:
        sys.exit(EXIT_OK)
    sys.exit(EXIT_NO_ANSWER if summary.reached == 0 else EXIT_FAILED)


@report_command("idle", IDLE_EPILOG)
@request_options(IdleRequest, "request")
def idle(node: tuple[str, ...], nodes: FleetNodes, options: Options, request: IdleRequest) -> None:
    """GPUs held but idle across the fleet: node, unit, holder, image, idle for, policy and
    what the agent did."""
    from controller.fleet.idle_view import IDLE, IDLE_PATH, IdleReport  # noqa: PLC0415

    report = IdleReport()
    summary = run_report(IDLE, report, IDLE_PATH, node, nodes, options, request.output)
    if summary.failed and summary.reached == 0:
        sys.exit(EXIT_NO_ANSWER)
    sys.exit(EXIT_FAILED if report.found or summary.failed else EXIT_OK)


class Report(Protocol):
    """What a command makes of the nodes' answers once all are done."""

    def add(self, result: NodeResult, order: int) -> None: ...

    def notes(self) -> list[str]: ...

    def render(self, output: str, width: int | None, ellipsis: str = "…") -> str: ...


def run_report(
    query: Query,
    report: Report,
    path: str,
    arguments: Sequence[str],
    nodes: FleetNodes,
    options: Options,
    output: str,
) -> Summary:
    """Gather the nodes, ask them, print ``report`` (or, ``--jsonl``, each node's line as it
    answers); returns the summary the exit code is made from. As ``run_fleet_command``:
    usage errors (nodes, inventory, TLS files) raise before any node is asked; the progress
    line, on a terminal, for more than 8 nodes; the failed nodes' whole messages and the
    summary on stderr (not with ``--jsonl``, whose lines carry them)."""
    from controller.ctl.fleet import _ellipsis  # noqa: PLC0415
    from controller.fleet.output import Progress, ProgressAware  # noqa: PLC0415
    from controller.fleet.report import (  # noqa: PLC0415
        CountingSink,
        JsonLinesSink,
        OrderedWindow,
        Output,
    )
    from controller.fleet.usage_view import explain_refusal  # noqa: PLC0415

    asked = gather_nodes(arguments, nodes, options)
    tls, ssh = transports_for(asked, options)

    progress: Progress | None = None
    out: Output = sys.stdout
    if len(asked) > PROGRESS_MIN_NODES and options.progress:
        progress = Progress(query.name, len(asked))
        out = ProgressAware(sys.stdout, progress)
    sink = JsonLinesSink(out) if output == "jsonl" else CountingSink()
    # the report is printed at the end, but the failed nodes' lines are in the nodes' order
    window = None if output == "jsonl" else OrderedWindow(sink.add, max(1024, 4 * options.parallel))

    def on_result(index: int, result: NodeResult) -> None:
        result = explain_refusal(result, path)
        report.add(result, index)
        if window is None:
            sink.add(result)
        else:
            window.put(index, result)
        if progress is not None:
            progress.update(result)

    ask_each(asked, query, on_result, options, ssh=ssh, tls=tls, window=window, progress=progress)
    sink.close()
    counts = sink.summary
    if output == "jsonl":
        return counts
    out.write(report.render(output, options.table_width, _ellipsis()))
    out.flush()
    lines = list(report.notes())
    lines += [f"{name}: {message}" for name, message in counts.errors]
    if counts.errors_left_out:
        reasons = ", ".join(f"{n} {why}" for why, n in counts.reasons.most_common())
        lines.append(
            f"and {counts.errors_left_out} more failed nodes ({reasons} in all); "
            "--jsonl gives every message"
        )
    refused = f" ({counts.refused} answered with an error)" if counts.refused else ""
    lines.append(
        f"{counts.nodes} node{'s' if counts.nodes != 1 else ''}, {counts.answered} answered, "
        f"{counts.failed} failed{refused}"
    )
    for line in lines:
        click.echo(f"{PROG}: {line}", err=True)
    return counts
