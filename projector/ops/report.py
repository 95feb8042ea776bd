"""``seqstate report``: the log of a namespace as one self-contained HTML page of charts.

The log is folded by replay's own path (:func:`projector.write.log_fold.fold_stream`, the writer's
one fold), from the newest valid snapshot before the range, and the state is sampled as the
log's time passes :data:`~projector.ops.ui.page.MAX_POINTS` evenly spaced marks of the range
(plus its end): a page of bounded size whatever the log's length, the cost of a sample paid
per mark, not per event.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client

from projector.nats.snapshots import SnapshotStore
from projector.ops.ui.page import MAX_POINTS, render
from projector.ops.ui.sample import NS_PER_S, Point, of_state
from projector.settings.config import Config
from projector.write.log_fold import (
    LogBounds,
    Progress,
    ReplayError,
    fold_stream,
    iso,
    log_bounds,
    parse_at,
    starting_state,
)
from seqstate import SequenceState

RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)(s|m|h|d)$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ReportError(ReplayError):
    """The report asked for cannot be made; the message says why."""


def parse_when(flag: str, text: str, newest_ns: int) -> int:
    """``-5m`` (before the log's newest event; s, m, h or d), an ISO 8601 instant (UTC unless
    it says), or a time of day on the log's newest day."""
    if match := RELATIVE.match(text):
        return newest_ns - round(float(match[1]) * UNIT_S[match[2]] * NS_PER_S)
    try:
        return parse_at(text, newest_ns)
    except ReplayError:
        raise ReportError(
            f"{flag} {text!r}: not an ISO 8601 time, a time of day or a time before the "
            "log's newest event such as -5m"
        ) from None


def check_writable(out: Path) -> None:
    """Refuse before folding a file that cannot be written, rather than after."""
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ReportError(f"--out {out}: is a folder")
    if not folder.is_dir():
        raise ReportError(f"--out {out}: folder {folder} does not exist")
    if not os.access(out if out.exists() else folder, os.W_OK):
        raise ReportError(f"--out {out}: not writable")


@dataclass
class _Sampler:
    """The :class:`~projector.write.log_fold.Ticks` of a report: a point at each mark passed.

    No mark within half a step of the range's end, where the last point is: two points a few
    nanoseconds apart made an events/s of millions out of a handful of events."""

    state: SequenceState
    since_ns: int
    until_ns: int
    step_ns: int = 1
    next_ns: int = 0
    points: list[Point] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.step_ns = max(1, (self.until_ns - self.since_ns) // MAX_POINTS)
        self.next_ns = self.since_ns

    def passed(self, at_ns: int, events: int, dead_letters: int) -> None:
        marks = (at_ns - self.since_ns) // self.step_ns  # the last mark at or before at_ns
        mark_ns = self.since_ns + marks * self.step_ns
        if mark_ns > self.until_ns - self.step_ns // 2:
            self.next_ns = 1 << 64  # the end's point is the last one
            return
        self.points.append(of_state(self.state, mark_ns / NS_PER_S, events, dead_letters))
        self.next_ns = mark_ns + self.step_ns


@dataclass(frozen=True)
class Report:
    points: list[Point]
    since_ns: int
    until_ns: int
    events: int
    bounds: LogBounds

    def page(self, namespace: str) -> str:
        return render(
            f"seqstate report: namespace {namespace}",
            f"log time {iso(self.since_ns)} to {iso(self.until_ns)}; {self.events:,} events "
            f"folded; {len(self.points)} points; {self.bounds}",
            points=self.points,
        )


async def report(
    nc: Client,
    config: Config,
    *,
    since: str | None = None,
    until: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Fold the log to ``until`` (default: its end), sampling from ``since`` (default: its
    first event)."""
    bounds = await log_bounds(nc, config)
    if not bounds.last_seq:
        raise ReportError(str(bounds))
    since_ns = parse_when("--since", since, bounds.last_ns) if since else bounds.first_ns
    until_ns = parse_when("--until", until, bounds.last_ns) if until else bounds.last_ns
    since_ns, until_ns = max(since_ns, bounds.first_ns), min(until_ns, bounds.last_ns)
    if since_ns > until_ns:
        raise ReportError(
            f"no event between {iso(since_ns)} and {iso(until_ns)} (--since, --until): {bounds}"
        )
    store = await SnapshotStore(nc, config).open(create=False)
    state, snapshot = await starting_state(
        nc, config, store, end_seq=bounds.last_seq, at_ns=since_ns
    )
    sampler = _Sampler(state, since_ns, until_ns)
    start = snapshot.applied_seq + 1 if snapshot else 1
    _, _, events, dead = await fold_stream(
        nc,
        config,
        state,
        start_seq=start,
        end_seq=bounds.last_seq,
        # The log's bounds are stored times to the microsecond, its events' times exact: with
        # no --until, the fold goes to the last event, whatever its nanoseconds.
        until_ns=until_ns if until else None,
        progress=progress,
        ticks=sampler,
    )
    end_ns = until_ns if until else max(until_ns, state.now_ns)
    sampler.points.append(of_state(state, end_ns / NS_PER_S, events, dead))
    for point in sampler.points[:-1]:  # the table is the end's; each point keeps its age
        del point["oldest"]
    return Report(sampler.points, since_ns, until_ns, events, bounds)
