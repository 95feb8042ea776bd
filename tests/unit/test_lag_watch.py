"""LagWatch: when a consumer's lag is worth a line, and how few lines it makes (no server)."""

from __future__ import annotations

import logging

import pytest

from projector.nats.lag import CAUGHT_UP, REPEAT_S, Lag, LagWatch, describe, over, thresholds
from projector.settings.config import Config, ConfigError

NS = 1_000_000_000


def lag(events: int, age_s: float = 0.0) -> Lag:
    now = 1_700_000_000 * NS
    oldest = now - int(age_s * NS) if events else None
    return Lag(events, events, 100, 100 + events, oldest, now)


def watch(config: Config) -> LagWatch:
    async def never() -> Lag:
        raise AssertionError("not measured here")

    return LagWatch("writer", never, config, logging.getLogger("test.lag"))


def test_one_line_when_behind_one_per_repeat_and_one_when_caught_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Broke: a lag over the event threshold for many checks, hovering around it, then gone.
    Expected: one "falling behind" line, one "still behind" line per REPEAT_S (not one per
    check), and one "caught up" line only once under a tenth of the threshold."""
    w = watch(Config(behind_warn_events=1000, behind_warn_s=None))
    caplog.set_level(logging.WARNING, "test.lag")
    w._judge(lag(999), 0.0)
    assert not caplog.records and not w.behind
    for t, events in enumerate([1000, 5000, 800, 1200, 400, 101]):  # over, then hovering
        w._judge(lag(events), float(t))
    assert w.behind and [r.getMessage().split(":")[0] for r in caplog.records] == [
        "writer falling behind"
    ]
    w._judge(lag(900), REPEAT_S + 1)
    w._judge(lag(900), REPEAT_S + 2)
    assert [r.getMessage().split(":")[0] for r in caplog.records][1:] == [
        "writer still behind after 61s"
    ]
    w._judge(lag(int(1000 * CAUGHT_UP) - 1), REPEAT_S + 3)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and not w.behind and w.warnings == 2
    assert messages[2].startswith("writer caught up: 99 events stored but not folded yet")
    assert "after 63.0s behind (at most 5,000 events)" in messages[2]


def test_the_age_of_the_oldest_waiting_event_alone_can_make_it_behind() -> None:
    """Broke: a billion events waiting, the count threshold off. Expected: behind only once
    the oldest has waited behind_warn_s; the thresholds said in words, 'off' ones left out."""
    config = Config(behind_warn_events=None, behind_warn_s=10.0)
    assert not over(config, lag(10**9, age_s=9.9))
    assert over(config, lag(1, age_s=10.0))
    assert not over(config, lag(0))  # nothing waits: no age
    assert thresholds(config) == "10s"
    assert thresholds(Config(behind_warn_events=None, behind_warn_s=None)) == "never"
    assert thresholds(Config()) == "50,000 events or 10s"


def test_the_lag_in_words() -> None:
    """Broke: nothing. Expected: the words the log and ``seqstate status`` use for each lag."""
    assert describe("writer", lag(0)) == "nothing to fold (folded up to event 100)"
    assert describe("writer", lag(20_000, 4.25)) == (
        "20,000 events stored but not folded yet (folded up to event 100, the log at 20100), "
        "the oldest logged 4.2s ago"
    )
    assert describe("projector", lag(0)) == "every delta is in the bucket (up to event 100)"
    assert describe("projector", Lag(300, 2, 100, 400, 0, 1_500_000_000)) == (
        "300 events in 2 delta messages not in the bucket yet (the bucket at event 100, the "
        "deltas at 400), the oldest stored 1.5s ago"
    )


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("behind_warn_events", 0, "must be at least 1, or 'off'"),
        ("behind_warn_s", 0.0, "must be positive, or 'off'"),
        ("lag_check_s", 0.0, "must be positive"),
    ],
)
def test_bad_lag_settings_are_named(setting: str, value: float, said: str) -> None:
    """Broke: a zero threshold or check interval; 'off' for each. Expected: the setting named
    with what is wrong; 'off' turns a threshold off, and is no interval."""
    with pytest.raises(ConfigError, match=f"^{setting}={value!r}: {said}$"):
        Config(**{setting: value})  # type: ignore[arg-type]
    env = {f"SEQSTATE_{setting.upper()}": "off"}
    if setting == "lag_check_s":
        with pytest.raises(ConfigError, match="not a number"):
            Config.from_env(env)
    else:
        assert getattr(Config.from_env(env), setting) is None
