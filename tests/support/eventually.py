"""``eventually``: the suite's one way to wait for something that happens in the background.

Integration and fault tests watch real processes and a real nats-server, so some conditions
hold only after a while: a delta reaches the bucket, a process logs a line, a port answers.
Every such wait polls an observable condition against a deadline and, when the deadline
passes, fails loudly: naming what it waited for, the last value it saw (or the last exception
it swallowed) and, if given, the output of whatever it watched. A wait that runs out
silently, or a bare ``sleep`` that hopes the thing is done by then, makes a test that passes
on a fast machine and lies or flakes on a slow one; this helper is the alternative.

The deadline is generous (30 s by default) because only a hang ever reaches it: a healthy
run returns as soon as the condition holds, so the suite's speed never depends on it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

TIMEOUT_S = 30.0  # only a hang reaches it; a test that waits this long has failed
INTERVAL_S = 0.01


@overload
async def eventually(
    probe: Callable[[], Awaitable[T]],
    ok: Callable[[T], object] = ...,
    *,
    what: str,
    timeout: float = ...,
    interval: float = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
    watch: Callable[[], object] | None = ...,
    check: Callable[[], object] | None = ...,
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T],
    ok: Callable[[T], object] = ...,
    *,
    what: str,
    timeout: float = ...,
    interval: float = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
    watch: Callable[[], object] | None = ...,
    check: Callable[[], object] | None = ...,
) -> T: ...


async def eventually(
    probe: Callable[[], object],
    ok: Callable[[Any], object] = bool,
    *,
    what: str,
    timeout: float = TIMEOUT_S,
    interval: float = INTERVAL_S,
    retry_on: tuple[type[BaseException], ...] = (),
    watch: Callable[[], object] | None = None,
    check: Callable[[], object] | None = None,
) -> Any:
    """Call ``probe`` (sync or async) until ``ok(value)`` holds and return that value.

    ``what`` names the condition in the failure. ``retry_on`` are exceptions that mean "not
    yet" (a busy server timing out, a port not listening yet): swallowed and remembered until
    the deadline; any other exception of the probe, or of ``ok``, propagates at once, because
    a probe that is broken will not mend by asking again. ``watch`` renders extra context for
    the failure only (a process's log). ``check`` runs after every try that did not satisfy
    ``ok`` and may raise to stop the wait early: a process that has exited will never make the
    condition true, so waiting out the deadline for it only hides the cause (and one that did
    its work and exited is not failed for it: the condition is looked at first).

    The probe runs at least once, and the last try is after the deadline, so a condition that
    became true while the helper slept is never reported as a timeout (``timeout=0``: one try).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen = False
    value: object = None
    error: BaseException | None = None
    tries = 0
    while True:
        tries += 1
        try:
            got = probe()
            if inspect.isawaitable(got):
                got = await got
        except retry_on as exc:
            error = exc
        else:
            value, seen, error = got, True, None
            if ok(got):
                return got
        if check is not None:
            check()
        if loop.time() >= deadline:
            raise AssertionError(_failure(what, timeout, tries, seen, value, error, watch))
        await asyncio.sleep(interval)


def _failure(
    what: str,
    timeout: float,
    tries: int,
    seen: bool,
    value: object,
    error: BaseException | None,
    watch: Callable[[], object] | None,
) -> str:
    """The timeout's message: the condition, the evidence, then whatever was watched."""
    lines = [f"{what}: not within {timeout:g}s ({tries} tries)"]
    if seen:
        lines.append(f"last value seen: {value!r}")
    if error is not None:
        lines.append(f"last error: {type(error).__name__}: {error}")
    if watch is not None:
        try:
            context = watch()
        except Exception as exc:  # the report must not hide the timeout behind a second error
            context = f"(watch failed: {type(exc).__name__}: {exc})"
        lines.append(f"--- watched ---\n{context}")
    return "\n".join(lines)
