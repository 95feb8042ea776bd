"""``seqstate loads --at WHEN``: what a WHEN means, as typed; and which snapshots a prune keeps
so that any past moment is near one, and which a fold starts from."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable

import pytest

from projector.nats.snapshots import SnapshotInfo, SnapshotMeta, kept, starting_points
from projector.ops.cli import build_parser
from projector.ops.loads_at import When, parse_when
from projector.write.log_fold import ReplayError

S = 1_000_000_000
NOW = 1_764_936_000 * S  # 2025-12-05T12:00:00Z
NEWEST = NOW - 90 * S  # the log's newest event, a minute and a half ago


def ns(text: str) -> int:
    moment = dt.datetime.fromisoformat(text)
    return int(moment.timestamp()) * S + moment.microsecond * 1000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("seq:1", When("seq:1", seq=1)),
        ("seq:1000000", When("seq:1000000", seq=1_000_000)),
        ("SEQ:42", When("SEQ:42", seq=42)),
        ("-30s", When("-30s", at_ns=NOW - 30 * S)),
        ("-5m", When("-5m", at_ns=NOW - 300 * S)),
        ("-2h", When("-2h", at_ns=NOW - 7200 * S)),
        ("-1d", When("-1d", at_ns=NOW - 86_400 * S)),
        ("-250ms", When("-250ms", at_ns=NOW - 250_000_000)),
        ("-1.5s", When("-1.5s", at_ns=NOW - 1_500_000_000)),
        ("-0s", When("-0s", at_ns=NOW)),
        ("2025-12-05T11:03:07Z", When("2025-12-05T11:03:07Z", at_ns=ns("2025-12-05T11:03:07Z"))),
        (
            "2025-12-05T12:03:07.000250+01:00",
            When("2025-12-05T12:03:07.000250+01:00", at_ns=ns("2025-12-05T11:03:07.000250Z")),
        ),
        ("2025-12-05T11:03:07", When("2025-12-05T11:03:07", at_ns=ns("2025-12-05T11:03:07Z"))),
        ("11:03:07", When("11:03:07", at_ns=ns("2025-12-05T11:03:07Z"))),  # the log's day
        ("11:59", When("11:59", at_ns=ns("2025-12-04T11:59:00Z"))),  # after NEWEST: the day before
    ],
)
def test_a_when_is_a_position_or_a_log_time(text: str, expected: When) -> None:
    assert parse_when(text, now_ns=NOW, newest_ns=NEWEST) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("seq:0", "seq:N takes a stream position N >= 1"),
        ("seq:-3", "seq:N takes a stream position N >= 1"),
        ("seq:abc", "seq:N takes a stream position N >= 1"),
        ("seq:", "seq:N takes a stream position N >= 1"),
        ("-5x", "not a moment"),
        ("-m", "not a moment"),
        ("5m", "not a moment"),
        ("+5m", "not a moment"),
        ("yesterday", "not a moment"),
        ("2025-13-01T00:00:00", "not a moment"),
        ("", "not a moment"),
    ],
)
def test_a_malformed_when_is_one_clear_error(text: str, why: str) -> None:
    with pytest.raises(ReplayError, match="^" + re.escape(f"--at {text!r}: {why}")):
        parse_when(text, now_ns=NOW, newest_ns=NEWEST)


@pytest.mark.parametrize("when", ["-5m", "-30s", "-2h", "-1.5h", "-250ms", "seq:7", "12:03"])
def test_the_command_line_takes_a_time_ago_as_typed(when: str) -> None:
    """``--at -5m``, not only ``--at=-5m``: argparse would read "-5m" as an unknown flag."""
    args = build_parser().parse_args(["loads", "--at", when, "--json"])
    assert (args.at, args.json) == (when, True)


def snap(seq: int) -> SnapshotInfo:
    meta = SnapshotMeta("ns", seq, seq * S, 1, 1, 10)
    return SnapshotInfo(f"ns.{seq:020d}", meta, 10, "")


def seqs(infos: Iterable[SnapshotInfo]) -> list[int]:
    return [info.applied_seq for info in infos]


def test_a_prune_keeps_the_newest_and_the_first_past_each_multiple_of_history_every() -> None:
    every_10k = [snap(s) for s in range(10_000, 1_000_001, 10_000)]
    newest = [980_000, 990_000, 1_000_000]
    assert seqs(kept(every_10k, 3, None, 40)) == newest
    assert seqs(kept(every_10k, 3, 50_000, 0)) == newest
    assert seqs(kept(every_10k, 3, 50_000, 40)) == [*range(50_000, 950_001, 50_000), *newest]
    assert seqs(kept(every_10k, 3, 50_000, 4)) == [850_000, 900_000, 950_000, *newest]


def test_history_snapshots_stay_as_the_writer_goes_on() -> None:
    """Irregular positions (a snapshot is taken when the last one is stored): the first past
    each multiple, none before the first multiple (the log's start needs none), and a prune
    of what a prune kept, with one more snapshot, drops only what is no longer newest."""
    infos = [snap(s) for s in (7, 26, 49, 51, 74, 77, 102, 130, 131)]
    first = kept(infos, 2, 25, 10)
    assert seqs(first) == [26, 51, 77, 102, 130, 131]
    assert seqs(kept([*first, snap(140)], 2, 25, 10)) == [26, 51, 77, 102, 130, 131, 140]
    assert seqs(kept([*first, snap(140), snap(160)], 2, 25, 10)) == [26, 51, 77, 102, 130, 140, 160]
    assert seqs(kept([*first, snap(140)], 2, 25, 3)) == [77, 102, 130, 131, 140]


def test_a_fold_starts_from_the_newest_snapshot_taken_before_both_its_bounds() -> None:
    """The one rule the fold's plan (whether to start a reader process) and the restore share.
    A snapshot whose description is unreadable has no known time: it serves a position only."""
    unreadable = SnapshotInfo(f"ns.{60:020d}", None, 10, "")
    infos = [snap(10), snap(30), snap(50), unreadable, snap(70)]
    assert seqs(starting_points(infos, None, None)) == [70, 60, 50, 30, 10]
    assert seqs(starting_points(infos, 69, None)) == [60, 50, 30, 10]
    assert seqs(starting_points(infos, 70, 65 * S)) == [50, 30, 10]
    assert seqs(starting_points(infos, 40, 70 * S)) == [30, 10]
    assert seqs(starting_points(infos, None, 30 * S)) == [30, 10]
    assert seqs(starting_points(infos, 9, None)) == []
