"""``seqstate top``: workers, their load and their add and free rates, from the bucket.

The rates are counted from what the bucket's watch delivers: a request slot that takes a
request is an add on its worker, a slot that becomes empty is a free. They are the bucket's
view: the projector writes a slot's last value per flush, so an add and its free within one
flush (tens of milliseconds) are not seen, and a slot freed and booked again in one flush
counts as one add. ``events/s`` is the change of the bucket's position (every event the writer
folded, heartbeats included) between refreshes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from projector.bucket.reader import RegistryView
from projector.wire.values import decode_request, parse_key
from seqstate import LoadRow


class CountingView(RegistryView):
    """A RegistryView that also counts, per worker, slots booked and slots freed."""

    adds: Counter[int]
    frees: Counter[int]

    def reset_counts(self) -> None:
        self.adds = Counter()
        self.frees = Counter()

    def receive(self, key: str, value: bytes | None, *, deleted: bool = False) -> None:
        if not hasattr(self, "adds"):
            self.reset_counts()
        parsed = parse_key(self.config.namespace, key)  # a head, not a long prompt's parts
        kind, rank = parsed.kind, parsed.rank
        if kind == "req" and rank is not None and not deleted:
            try:
                booked = bool(value) and not decode_request(value or b"").empty
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                booked = False
            (self.adds if booked else self.frees)[rank[0]] += 1
        super().receive(key, value, deleted=deleted)


@dataclass(frozen=True)
class Sample:
    at: float
    applied_seq: int
    adds: dict[int, int]
    frees: dict[int, int]


def sample(view: CountingView) -> Sample:
    if not hasattr(view, "adds"):
        view.reset_counts()
    return Sample(time.monotonic(), view.applied_seq, dict(view.adds), dict(view.frees))


class WorkerRow(msgspec.Struct, frozen=True):
    worker_id: int
    ranks: int
    active_requests: int
    active_blocks: int
    active_prefill_tokens: int
    modeled_remaining_prefill_ms: int | None  # the longest of its ranks'
    adds_per_s: float | None  # None: one sample only
    frees_per_s: float | None


def _rate(
    now: dict[int, int], old: dict[int, int], worker: int, span: float | None
) -> float | None:
    if span is None:
        return None
    return round((now.get(worker, 0) - old.get(worker, 0)) / span, 1)


def worker_rows(view: CountingView, before: Sample | None, now: Sample) -> list[WorkerRow]:
    """One row per worker: its ranks summed; rates over the time since ``before``."""
    span = None if before is None else max(now.at - before.at, 1e-9)
    old_adds = before.adds if before else {}
    old_frees = before.frees if before else {}
    by_worker: dict[int, list[LoadRow]] = {}
    for row in view.loads():
        by_worker.setdefault(row.worker_id, []).append(row)
    out = []
    for worker, rows in sorted(by_worker.items()):
        ms = [r.modeled_remaining_prefill_ms for r in rows]
        remaining = None if any(m is None for m in ms) else max(m or 0 for m in ms)
        out.append(
            WorkerRow(
                worker,
                len(rows),
                sum(r.active_requests for r in rows),
                sum(r.active_blocks for r in rows),
                sum(r.active_prefill_tokens for r in rows),
                remaining,
                _rate(now.adds, old_adds, worker, span),
                _rate(now.frees, old_frees, worker, span),
            )
        )
    return out


def events_per_s(before: Sample | None, now: Sample) -> float | None:
    if before is None:
        return None
    return (now.applied_seq - before.applied_seq) / max(now.at - before.at, 1e-9)


HEADERS = (
    "worker",
    "ranks",
    "requests",
    "active_blocks",
    "prefill_tokens",
    "remaining_prefill_ms",
    "adds_per_s",
    "frees_per_s",
)


def _cells(r: WorkerRow) -> tuple[str, ...]:
    def num(v: float | int | None) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    return (
        str(r.worker_id),
        str(r.ranks),
        str(r.active_requests),
        str(r.active_blocks),
        str(r.active_prefill_tokens),
        num(r.modeled_remaining_prefill_ms),
        num(r.adds_per_s),
        num(r.frees_per_s),
    )


def plain(rows: Sequence[WorkerRow], applied_seq: int, rate: float | None) -> str:
    """Aligned ASCII, as ``loads`` prints: a header, a line per worker, then the position."""
    cells = [HEADERS, *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    shown = "-" if rate is None else f"{rate:.1f}"
    lines.append(f"as of event {applied_seq}; {shown} events/s")
    return "\n".join(lines)


def render(
    rows: Sequence[WorkerRow], title: str, applied_seq: int, rate: float | None
) -> RenderableType:
    table = Table(title=title, title_justify="left")
    for name in (
        "worker",
        "ranks",
        "requests",
        "active blocks",
        "prefill tokens",
        "remaining prefill ms",
        "adds/s",
        "frees/s",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*_cells(r))
    if not rows:
        table.caption = "no workers"
    shown = "-" if rate is None else f"{rate:,.1f}"
    foot = Text(f"as of event {applied_seq:,}   {shown} events/s   Ctrl-C to quit", style="dim")
    return Group(table, foot)
