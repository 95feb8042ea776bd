"""``seqstate replay --at``: which instant a time means, relative to the log."""

from __future__ import annotations

import datetime as dt

import pytest

from projector.write.log_fold import ReplayError, parse_at


def ns(text: str) -> int:
    moment = dt.datetime.fromisoformat(text)
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


NEWEST = ns("2026-11-30T14:00:00+00:00")  # the log's newest event


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-29T12:03:07+00:00", "2026-11-29T12:03:07+00:00"),
        ("2026-11-29T12:03:07", "2026-11-29T12:03:07+00:00"),  # naive means UTC
        ("2026-11-29T13:03:07+01:00", "2026-11-29T12:03:07+00:00"),
        ("12:03:07", "2026-11-30T12:03:07+00:00"),  # the log's day
        ("12:03:07.250", "2026-11-30T12:03:07.250000+00:00"),
        ("15:00", "2026-11-29T15:00:00+00:00"),  # later than the newest event: the day before
    ],
)
def test_times_resolve_against_the_log(text: str, expected: str) -> None:
    assert parse_at(text, NEWEST) == ns(expected)


def test_nanoseconds_are_exact() -> None:
    assert parse_at("1970-01-01T00:00:01.000001", NEWEST) == 1_000_001_000


@pytest.mark.parametrize("text", ["yesterday", "25:00", "2026-13-01T00:00:00"])
def test_nonsense_is_one_clear_error(text: str) -> None:
    with pytest.raises(ReplayError, match=f"--at {text!r}"):
        parse_at(text, NEWEST)
