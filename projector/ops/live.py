"""What an operator watches: per-worker load as the registry sees it, in a terminal or a log.

The functions here only format: they take rows already read from the registry (or its KV
replica) and return a renderable or a string. The refresh loop, the clock and the reads live
with the caller, so the view can be tested by rendering to a string, and the same rows can be
shown live (:func:`render`) or written where there is no terminal (:func:`plain_table`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from seqstate import LoadRow

if TYPE_CHECKING:
    from projector.bucket.reader import Staleness
    from projector.nats.lag import Lag

BAR_WIDTH: Final = 24
# Eighth blocks, so a bar moves visibly before a whole cell fills.
_EIGHTHS: Final = " ▏▎▍▌▋▊▉"
_FULL: Final = "█"
MISSING: Final = "—"

PLAIN_HEADERS: Final = (
    "worker",
    "rank",
    "requests",
    "active_blocks",
    "prefill_tokens",
    "remaining_prefill_ms",
)


def render(
    rows: Sequence[LoadRow],
    *,
    title: str,
    stats: Mapping[str, object] | None = None,
    max_blocks: int | None = None,
) -> RenderableType:
    """A table of per-rank load, in the order given, with pipeline stats beneath it.

    Bars are relative to ``max_blocks`` when given (a fixed capacity keeps bars comparable
    from one refresh to the next), otherwise to the busiest row shown (so an idle cluster
    still shows who is least idle). A rank above ``max_blocks`` gets a full red bar.
    A modeled remaining prefill of None (some prefill has no expected duration) shows "—",
    which is not the same as 0.
    """
    scale = (
        max_blocks if max_blocks is not None else max((r.active_blocks for r in rows), default=0)
    )
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("worker", justify="right", style="bold")
    table.add_column("rank", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("active blocks", justify="right")
    table.add_column("", justify="left", min_width=BAR_WIDTH, no_wrap=True)
    table.add_column("prefill tokens", justify="right")
    table.add_column("remaining prefill ms", justify="right")
    for row in rows:
        ms = row.modeled_remaining_prefill_ms
        table.add_row(
            str(row.worker_id),
            str(row.dp_rank),
            f"{row.active_requests:,}",
            f"{row.active_blocks:,}",
            _bar(row.active_blocks, scale),
            f"{row.active_prefill_tokens:,}",
            Text(MISSING, style="dim") if ms is None else f"{ms:,}",
        )
    if not rows:
        table.caption = "no workers"
    if not stats:
        return table
    return Group(table, _stats_line(stats))


def backlog_fields(lag: Lag | None, refused: int) -> dict[str, object]:
    """What waits beside the table: the writer's events stored but not folded, the Dynamo
    messages captured and not in the events stream yet (and any dropped before it took them),
    how full each stream is that refuses at its limit (or drops beyond it, once half full), and
    the publishes refused. No lag measured yet: the refusals alone."""
    out: dict[str, object] = {}
    if lag is not None and lag.measured_ns:
        out["unfolded"] = lag.events
        if lag.capture is not None:
            out["captured waiting"] = lag.capture.waiting
            if lag.capture.dropped:
                out["captured dropped"] = lag.capture.dropped
        for use in lag.streams:  # one that refuses at its limit; one that drops, once half full
            if (use.max_messages or use.max_bytes) and (use.discard == "new" or use.share >= 0.5):
                out[use.name] = f"{use.share:.0%} full"
    out["refused"] = refused
    return out


def staleness_said(s: Staleness) -> str:
    """How far the view may be behind the log, in a few words: current, behind by so many
    events for so long, or the projector silent (then behind by whatever was logged since)."""
    if s.silent:
        return "no projector heard" if math.isinf(s.age_s) else f"projector silent {s.age_s:.0f}s"
    if math.isinf(s.measured_s):
        return "log head not heard yet"
    if not s.behind_events:
        return f"current (log at {s.head})"
    return f"{s.behind_events:,} events, {s.behind_s:.1f}s behind (log at {s.head})"


def plain_table(rows: Sequence[LoadRow]) -> str:
    """The rows as aligned plain text: one header line, then one line per row.

    For pipes and logs, so it is built to be parsed as well as read: ASCII only, header names
    without spaces and numbers without thousands separators (``awk`` and ``sort -n`` work),
    columns separated by two spaces and right-aligned, no trailing whitespace and no final
    newline. An unmodeled remaining prefill is ``-``.
    """
    cells = [PLAIN_HEADERS] + [
        (
            str(r.worker_id),
            str(r.dp_rank),
            str(r.active_requests),
            str(r.active_blocks),
            str(r.active_prefill_tokens),
            "-" if r.modeled_remaining_prefill_ms is None else str(r.modeled_remaining_prefill_ms),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(PLAIN_HEADERS))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
        for line in cells
    )


def _bar(value: int, scale: int) -> Text:
    if scale <= 0 or value <= 0:
        return Text(" " * BAR_WIDTH)
    fraction = value / scale
    style = "green" if fraction < 0.6 else "yellow" if fraction < 0.85 else "red"
    eighths = min(BAR_WIDTH * 8, max(1, round(fraction * BAR_WIDTH * 8)))  # busy is never blank
    full, part = divmod(eighths, 8)
    bar = _FULL * full + (_EIGHTHS[part] if part else "")
    return Text(bar.ljust(BAR_WIDTH), style=style)


def _stats_line(stats: Mapping[str, object]) -> Text:
    """``key value`` pairs on one line (wrapped by rich when too wide), keys dimmed."""
    line = Text()
    for i, (key, value) in enumerate(stats.items()):
        if i:
            line.append("   ")
        line.append(f"{key} ", style="dim")
        line.append(_format(value), style="bold")
    return line


def _format(value: object) -> str:
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)
