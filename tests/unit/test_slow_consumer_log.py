"""A slow consumer is said once per interval with a count, never once per message.

nats-py calls the error callback once for every message a subscription drops; a writer far
behind made 1.1 million lines of them in 57 s. The hook counts them and says one line per
interval (its clock is the test's own, so no test waits for time to pass).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import nats.errors
import pytest

from projector.nats.connection import SlowConsumerLog, _Callbacks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dropped(subject: str = "seqstate.events.default.2.0") -> nats.errors.SlowConsumerError:
    return nats.errors.SlowConsumerError(subject=subject, reply="", sid=7, sub=cast(Any, None))


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slow consumer" in r.getMessage()]


def test_a_flood_of_drops_is_one_line_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    slow = SlowConsumerLog(logging.getLogger("seqstate.test"), every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="seqstate.test"):
        slow.dropped_one("a.1")  # the first is said at once
        for _ in range(100_000):
            slow.dropped_one("a.1")
            clock.now += 0.00005  # 100,000 drops in 5 s: still inside the interval
        assert len(lines(caplog)) == 1
        clock.now += 5.2
        slow.dropped_one("a.2")  # the interval has passed: one line with the count since
        said = lines(caplog)
        assert len(said) == 2
        assert "1 message(s) dropped" in said[0]
        assert "100001 message(s) dropped in the last 10s" in said[1]
        assert "a.1, a.2" in said[1] and "100002 in all" in said[1]
        slow.dropped_one("a.3")
        slow.flush()  # at close: what is left is said
        assert len(lines(caplog)) == 3 and "1 message(s) dropped" in lines(caplog)[2]
        slow.flush()  # nothing since: nothing said
    assert (slow.dropped, slow.lines) == (100_003, 3)


async def test_the_connections_error_callback_routes_slow_consumers_to_the_counter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    callbacks = _Callbacks("nats://127.0.0.1:4222", service=True)
    callbacks.dialing = False
    with caplog.at_level(logging.WARNING, logger="seqstate"):
        for _ in range(50_000):
            await callbacks.on_error(dropped())
    assert len(lines(caplog)) == 1, lines(caplog)[:3]
    assert callbacks.slow.dropped == 50_000
    assert len(caplog.records) == 1  # and no line per message of any other kind either
