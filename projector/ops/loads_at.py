"""The loads as the ledger held them at a past moment: ``seqstate loads --at WHEN``.

A look back is a replay (:func:`projector.write.log_fold.replay`: the newest valid snapshot at or
before the moment, then the log's tail through the writer's one fold), so it equals a replay to
that point and what ``seqstate loads`` printed then; the writer's history snapshots
(``snapshot_history_every``) bound the tail. This module owns what a moment may be and which
moments can be answered exactly.

WHEN is ``seq:N`` (the state after event N), an ISO 8601 instant or time of day (as ``replay
--at``), or a time relative to now (``-30s``, ``-5m``, ``-2h``, ``-1d``). A moment after the
newest event is answered: nothing changed since, so the ledger held the newest state, its decay
evaluated at the moment asked (and the answer says that no event came after). A moment in the
future is refused: it has not happened, and an answer would be a guess.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from nats.aio.client import Client

from projector.nats.retention import trimmed_below
from projector.nats.snapshots import SnapshotStore
from projector.settings.config import Config
from projector.write.log_fold import (
    LogBounds,
    Replayed,
    ReplayError,
    iso,
    log_bounds,
    parse_at,
    replay,
)

_RELATIVE = re.compile(r"-(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86_400 * 10**9}
# Log times are the server's clock, "now" the client's: a moment this close past the newest
# event counts as now, not as the future.
CLOCK_SLACK_NS = 2 * 10**9


@dataclass(frozen=True)
class When:
    """A parsed WHEN: a stream position (``seq``) or a log time (``at_ns``), and its text."""

    text: str
    seq: int | None = None
    at_ns: int | None = None


def parse_when(text: str, *, now_ns: int, newest_ns: int) -> When:
    """``seq:N``, ``-<number><ms|s|m|h|d>`` before ``now_ns``, or an ISO 8601 instant or time
    of day (a bare time of day on the day of ``newest_ns``, as ``replay --at`` reads it)."""
    said = text.strip()
    if said.lower().startswith("seq:"):
        digits = said[4:].strip()
        if not digits.isdigit() or int(digits) < 1:
            raise ReplayError(f"--at {text!r}: seq:N takes a stream position N >= 1")
        return When(said, seq=int(digits))
    relative = _RELATIVE.fullmatch(said)
    if relative is not None:
        amount, unit = relative.groups()
        return When(said, at_ns=now_ns - int(float(amount) * _UNIT_NS[unit]))
    try:
        return When(said, at_ns=parse_at(said, newest_ns))
    except ReplayError:
        raise ReplayError(
            f"--at {text!r}: not a moment (an ISO 8601 time such as 2026-12-05T12:03:07Z, a "
            "time of day 12:03:07, a time ago such as -5m, -30s or -2h, or seq:N)"
        ) from None


@dataclass(frozen=True)
class Earliest:
    """The oldest moment a look back can answer exactly, and why it is the oldest."""

    seq: int
    at_ns: int
    why: str

    def __str__(self) -> str:
        return f"the earliest answerable is seq:{self.seq} ({iso(self.at_ns)}, {self.why})"


async def earliest(nc: Client, config: Config, bounds: LogBounds) -> Earliest:
    """The first event, or, if the log was trimmed, the oldest snapshot (the state there is all
    that is left of what came before)."""
    if await trimmed_below(nc, config) > 1:
        store = await SnapshotStore(nc, config).open(create=False)
        described = [info for info in await store.list() if info.meta is not None]
        if not described:
            raise ReplayError(
                f"the log of namespace {config.namespace!r} was trimmed and no snapshot covers "
                "what was trimmed: no moment can be answered exactly"
            )
        oldest = described[0]
        assert oldest.meta is not None
        return Earliest(oldest.applied_seq, oldest.meta.as_of, "older events were trimmed")
    return Earliest(bounds.first_seq, bounds.first_ns, "the log's first event")


@dataclass
class LoadsAt:
    """A look back's answer: the replay, and the line that says which moment it reflects."""

    replayed: Replayed
    said: str


async def loads_at(nc: Client, config: Config, text: str) -> LoadsAt:
    """The state at WHEN ``text``, or :class:`ReplayError` saying why it cannot be exact."""
    bounds = await log_bounds(nc, config)
    if not bounds.last_seq:
        raise ReplayError(str(bounds))
    now_ns = time.time_ns()
    when = parse_when(text, now_ns=now_ns, newest_ns=bounds.last_ns)
    first = await earliest(nc, config, bounds)
    newest = f"seq:{bounds.last_seq} ({iso(bounds.last_ns)})"
    if when.seq is not None:
        stream_last = (await nc.jetstream().stream_info(config.events_stream)).state.last_seq
        if when.seq > stream_last:
            raise ReplayError(
                f"--at seq:{when.seq} is beyond the stream: its newest event is seq:{stream_last};"
                f" the newest of namespace {config.namespace!r} is {newest}"
            )
        if when.seq < first.seq:
            raise ReplayError(f"--at seq:{when.seq} is before what can be answered: {first}")
        done = await replay(nc, config, to_seq=min(when.seq, bounds.last_seq), bounds=bounds)
        said = f"loads as of event {done.last_seq}, log time {iso(done.as_of_ns)} (--at {text})"
        if when.seq > bounds.last_seq:
            said += f"; no event of namespace {config.namespace!r} after it"
        return LoadsAt(done, said + _folded(done))
    assert when.at_ns is not None
    at_ns = when.at_ns
    if at_ns > max(now_ns, bounds.last_ns) + CLOCK_SLACK_NS:
        raise ReplayError(
            f"--at {text}: {iso(at_ns)} is in the future (now is {iso(now_ns)}); the newest "
            f"event is {newest}"
        )
    if at_ns < first.at_ns:
        raise ReplayError(f"--at {text}: {iso(at_ns)} is before what can be answered: {first}")
    done = await replay(nc, config, at_ns=at_ns, bounds=bounds)
    said = f"loads as of log time {iso(at_ns)}, event {done.last_seq} (--at {text})"
    if at_ns >= bounds.last_ns:
        said += f"; the newest event, none after it until {iso(at_ns)}"
    return LoadsAt(done, said + _folded(done))


def _folded(done: Replayed) -> str:
    """Where the answer started, and how many events it folded from there."""
    start = f"snapshot {done.snapshot.name}" if done.snapshot else "the first event"
    return f"; {done.events} event{'' if done.events == 1 else 's'} folded from {start}"
