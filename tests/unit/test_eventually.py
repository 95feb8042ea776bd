"""``eventually`` (tests/support/eventually.py), the wait every integration and fault test
relies on.

Each test drives the helper with a probe that counts its calls, so success and failure are
decided by the count, not by a clock: ``interval=0`` polls without sleeping and ``timeout=0``
gives up after the first try. No test sleeps and hopes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from eventually import eventually


def counter(answers: list[object]) -> tuple[Callable[[], object], list[int]]:
    """A sync probe giving ``answers`` in turn (the last one forever); raising the exceptions."""
    calls = [0]

    def probe() -> object:
        calls[0] += 1
        answer = answers[min(calls[0], len(answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return probe, calls


async def test_success_at_once_returns_the_value_without_waiting() -> None:
    probe, calls = counter([42])
    assert await eventually(probe, what="answer", timeout=0) == 42
    assert calls == [1]


async def test_success_after_n_tries() -> None:
    probe, calls = counter([0, 0, 0, 0, 7])
    assert await eventually(probe, what="seven", interval=0) == 7
    assert calls == [5]


async def test_returns_the_probes_value_not_oks() -> None:
    probe, _ = counter([[1], [1, 2, 3]])
    assert await eventually(probe, lambda v: len(v) == 3, what="three", interval=0) == [1, 2, 3]


async def test_async_probe_is_awaited() -> None:
    seen: list[int] = []

    async def probe() -> int:
        await asyncio.sleep(0)
        seen.append(len(seen))
        return len(seen)

    assert await eventually(probe, lambda n: n >= 3, what="three calls", interval=0) == 3
    assert seen == [0, 1, 2]


async def test_sync_probe_returning_an_awaitable_is_awaited() -> None:
    """A lambda around a coroutine function (``lambda: js.stream_info(name)``) is common."""

    async def value() -> str:
        return "ready"

    assert await eventually(lambda: value(), lambda v: v == "ready", what="ready") == "ready"


async def test_timeout_names_what_and_the_last_value() -> None:
    probe, calls = counter([1, 2, 3])
    with pytest.raises(AssertionError) as failed:
        await eventually(probe, lambda v: v > 10, what="the counter passed 10", timeout=0)
    message = str(failed.value)
    assert message.startswith("the counter passed 10: not within 0s")
    assert message.endswith("(1 tries)\nlast value seen: 1")
    assert calls == [1]


async def test_falsy_values_fail_with_the_default_ok() -> None:
    probe, _ = counter([[]])
    with pytest.raises(AssertionError, match=r"(?s)non-empty.*last value seen: \[\]"):
        await eventually(probe, what="non-empty", timeout=0)


async def test_waits_out_the_deadline_before_failing() -> None:
    """It never gives up early: the failure comes after ``timeout`` has passed, however fast
    the probe answers (the bound is one-sided, so a slow machine cannot make it fail)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    probe, calls = counter([False])
    with pytest.raises(AssertionError):
        await eventually(probe, what="never", timeout=0.05, interval=0.01)
    assert loop.time() - start >= 0.05
    assert calls[0] >= 1  # how many more is the machine's business


async def test_retry_on_is_swallowed_until_it_succeeds() -> None:
    probe, calls = counter([TimeoutError("busy"), ConnectionRefusedError(), "up"])
    got = await eventually(
        probe, what="up", interval=0, retry_on=(TimeoutError, ConnectionRefusedError)
    )
    assert got == "up"
    assert calls == [3]


async def test_retry_on_until_the_timeout_reports_the_last_error() -> None:
    probe, _ = counter([TimeoutError("server busy")])
    with pytest.raises(AssertionError) as failed:
        await eventually(probe, what="an answer", timeout=0, retry_on=(TimeoutError,))
    message = str(failed.value)
    assert "an answer: not within 0s" in message
    assert "last error: TimeoutError: server busy" in message
    assert "last value seen" not in message  # it never returned one


async def test_reports_both_the_last_value_and_a_later_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline passes during the second try, which raises: the report has the value of
    the first and the error of the second. The loop's clock is moved by the probe itself
    (``interval=0`` never schedules a timer), so the number of tries is exact."""
    loop = asyncio.get_running_loop()
    now = [0.0]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    calls = [0]

    def probe() -> str:
        calls[0] += 1
        if calls[0] == 1:
            return "half"
        now[0] += 10  # past the deadline
        raise TimeoutError("busy")

    with pytest.raises(AssertionError) as failed:
        await eventually(
            probe,
            lambda v: v == "done",
            what="done",
            timeout=5,
            interval=0,
            retry_on=(TimeoutError,),
        )
    message = str(failed.value)
    assert "done: not within 5s (2 tries)" in message
    assert "last value seen: 'half'" in message
    assert "last error: TimeoutError: busy" in message


async def test_other_exceptions_propagate_at_once() -> None:
    probe, calls = counter([KeyError("broken")])
    with pytest.raises(KeyError, match="broken"):
        await eventually(probe, what="x", retry_on=(TimeoutError,))
    assert calls == [1]


async def test_an_exception_of_ok_propagates() -> None:
    probe, _ = counter([None])
    with pytest.raises(TypeError):
        await eventually(probe, lambda v: v > 0, what="positive")  # type: ignore[operator]


async def test_watch_is_in_the_failure_and_only_there() -> None:
    watched = []

    def watch() -> str:
        watched.append(1)
        return "process log: connection refused"

    probe, _ = counter([0, 0, 1])
    assert await eventually(probe, what="one", interval=0, watch=watch) == 1
    assert watched == []  # never called on success
    probe, _ = counter([0])
    with pytest.raises(AssertionError, match="process log: connection refused"):
        await eventually(probe, what="one", timeout=0, watch=watch)
    assert watched == [1]


async def test_a_failing_watch_does_not_hide_the_timeout() -> None:
    def watch() -> str:
        raise FileNotFoundError("no log")

    probe, _ = counter([0])
    with pytest.raises(AssertionError, match=r"(?s)one: not within.*watch failed: .*no log"):
        await eventually(probe, what="one", timeout=0, watch=watch)


async def test_check_stops_the_wait_early() -> None:
    """A process that exited on its own will never make the condition true."""
    probe, calls = counter([0])
    checks = [0]

    def check() -> None:
        checks[0] += 1
        if checks[0] == 3:
            raise AssertionError("writer exited with 1")

    with pytest.raises(AssertionError, match="writer exited with 1"):
        await eventually(probe, what="progress", interval=0, check=check)
    assert calls == [3]  # checked after each try that fell short: no fourth


async def test_check_is_not_consulted_once_the_condition_holds() -> None:
    """A process that logged its line and then exited has done what was waited for."""

    def check() -> None:
        raise AssertionError("exited")

    probe, _ = counter(["logged"])
    assert await eventually(probe, what="logged", check=check) == "logged"


async def test_cancellation_is_not_swallowed() -> None:
    """A wait whose test is torn down stops there, not at its deadline."""
    started = asyncio.Event()

    async def probe() -> bool:
        started.set()
        return False

    task = asyncio.create_task(eventually(probe, what="never", interval=3600))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
