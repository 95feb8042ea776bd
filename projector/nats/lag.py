"""Lag: how far the writer and the projector are behind their input, and saying so.

A consumer's lag is what its input holds that it has not handled yet:

- the writer's: events stored on the events stream but not folded yet (the newest event of the
  namespace minus the last one folded), and how long ago the oldest of them was logged;
- the projector's: deltas stored on the deltas stream but not yet in the bucket (in events, the
  newest event with a stored delta minus the bucket's position; in delta messages too), and
  how long ago the oldest of those messages was stored. Its ``upstream`` part: events logged
  that the writer has not handled visibly yet (no delta, no dead letter), and how long ago the
  oldest was logged. A paused writer stores no delta, so the projector alone is never behind
  then, while its bucket grows stale: :attr:`Lag.behind_events` and :attr:`Lag.behind_s`
  count both, and ``/readyz`` judges by them.

Each measurement is a few small reads of the server (the newest message on the namespace's
subjects; when something waits, the oldest such message, for its log time; the projector's
also the newest event and, when the writer is behind, the newest dead letter), made every
``lag_check_s``, never per message. ``seqstate status`` measures the same from outside,
with the positions the consumers leave on the streams and in the bucket. The counts are
sequence differences: exact for a namespace alone on its streams; when namespaces share a
stream, the other namespaces' messages in between count too.

:class:`LagWatch` keeps a consumer's last measurement (``lag``) and tells the log when it falls
behind: one warning when the lag reaches ``behind_warn_events`` events or the oldest waiting
event has waited ``behind_warn_s``; another every ``REPEAT_S`` while it stays behind; and one
line (a warning too, so that whoever saw the first sees it) once it has caught up, which is
when it is back under a tenth of each threshold: under steady load a few events always wait,
and a lag hovering at a threshold must not make a line per check.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from projector.nats.resources import dead_letter_stream
from projector.nats.retry import ATTEMPT_TIMEOUT_S
from projector.nats.stream import last_seq_of
from projector.wire.chain import covered_source
from projector.wire.config import Config
from projector.wire.headers import SOURCE_SEQ, SOURCE_STREAM

REPEAT_S = 60.0  # while behind, the warning is repeated this often
CAUGHT_UP = 0.1  # caught up again: under this share of each threshold
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Lag:
    """One measurement of a consumer's lag (all zero: never measured, or nothing waits)."""

    events: int = 0  # events not yet reflected by the consumer's output
    messages: int = 0  # messages of its input stream not handled yet
    position: int = 0  # the last event it has handled (the projector: that is in the bucket)
    newest: int = 0  # the newest event it could have handled (the projector: with a delta)
    oldest_ns: int | None = None  # log time of the oldest message waiting (None: none waits)
    measured_ns: int = 0  # wall-clock time of the measurement
    # The projector's: events logged that the writer has not handled visibly (no delta and no
    # dead letter yet), and the log time of the oldest of them (None: none).
    upstream: int = 0
    upstream_oldest_ns: int | None = None

    @property
    def oldest_age_s(self) -> float:
        """How long the oldest waiting message had waited when measured (0.0: none waits)."""
        if self.oldest_ns is None:
            return 0.0
        return max(0.0, (self.measured_ns - self.oldest_ns) / 1e9)

    @property
    def behind_events(self) -> int:
        """Events logged that the consumer's output does not reflect yet, upstream included
        (the projector's bucket: neither the writer's deltas nor the bucket have them)."""
        return self.events + self.upstream

    @property
    def behind_s(self) -> float:
        """How long the oldest event the output does not reflect yet had waited (0.0: none)."""
        oldest = [ns for ns in (self.oldest_ns, self.upstream_oldest_ns) if ns is not None]
        if not oldest:
            return 0.0
        return max(0.0, (self.measured_ns - min(oldest)) / 1e9)


def describe(who: str, lag: Lag) -> str:
    """The lag in words, as the log and ``seqstate status`` say it."""
    if who == "writer":
        if not lag.events:
            return f"nothing to fold (folded up to event {lag.position})"
        return (
            f"{lag.events:,} events stored but not folded yet (folded up to event "
            f"{lag.position}, the log at {lag.newest}), the oldest logged "
            f"{lag.oldest_age_s:.1f}s ago"
        )
    if not lag.messages:
        return f"every delta is in the bucket (up to event {lag.position})"
    return (
        f"{lag.events:,} events in {lag.messages:,} delta messages not in the bucket yet "
        f"(the bucket at event {lag.position}, the deltas at {lag.newest}), the oldest "
        f"stored {lag.oldest_age_s:.1f}s ago"
    )


class LagLimits(Protocol):
    """When a consumer counts as behind; a :class:`LagSettings` or a whole ``Config``."""

    @property
    def behind_warn_events(self) -> int | None: ...
    @property
    def behind_warn_s(self) -> float | None: ...


class WatchSettings(LagLimits, Protocol):
    """What a :class:`LagWatch` reads: its limits, how often it looks, and whose lag it is."""

    @property
    def namespace(self) -> str: ...
    @property
    def lag_check_s(self) -> float: ...


@dataclass(frozen=True)
class LagSettings:
    """A :class:`LagWatch`'s settings, and no others (built by :mod:`projector.run.assemble`)."""

    namespace: str
    behind_warn_events: int | None
    behind_warn_s: float | None
    lag_check_s: float


def thresholds(config: LagLimits) -> str:
    """The warning thresholds in words: ``50,000 events or 10s``."""
    said = []
    if config.behind_warn_events is not None:
        said.append(f"{config.behind_warn_events:,} events")
    if config.behind_warn_s is not None:
        said.append(f"{config.behind_warn_s:g}s")
    return " or ".join(said) or "never"


def over(config: LagLimits, lag: Lag, share: float = 1.0) -> bool:
    """Whether ``lag`` reaches ``share`` of either threshold (a threshold 'off' never does)."""
    events, seconds = config.behind_warn_events, config.behind_warn_s
    return (events is not None and lag.events >= events * share) or (
        seconds is not None and lag.oldest_age_s >= seconds * share
    )


# ---- measuring ----------------------------------------------------------------------------


async def _log_time_after(js: JetStreamContext, stream: str, subjects: str, seq: int) -> int | None:
    """Log time (ns) of the first message on ``subjects`` after sequence ``seq``; None if none."""
    try:
        msg = await js.get_msg(stream, seq=seq + 1, subject=subjects, next=True)
    except NotFoundError:
        return None
    if msg.time is None:
        return None
    return (msg.time - _EPOCH) // dt.timedelta(microseconds=1) * 1000


async def writer_lag(js: JetStreamContext, config: Config, folded: int) -> Lag:
    """The writer's lag, for a writer that has handled every event up to ``folded``."""
    newest = await last_seq_of(js, config.events_stream, config.events_subjects)
    behind = max(0, newest - folded)
    oldest = None
    if behind:
        oldest = await _log_time_after(js, config.events_stream, config.events_subjects, folded)
    return Lag(behind, behind, folded, newest, oldest, time.time_ns())


async def projector_lag(js: JetStreamContext, config: Config, applied: int, delta_seq: int) -> Lag:
    """The projector's lag, for a bucket whose position is event ``applied``, delta message
    ``delta_seq``; with what the writer has not handled yet (``upstream``)."""
    try:
        raw = await js.get_last_msg(config.deltas_stream, config.deltas_subject)
    except NotFoundError:
        messages, newest, oldest = 0, applied, None
    else:
        messages = max(0, (raw.seq or 0) - delta_seq)
        covered = covered_source(raw.headers, raw.data)
        newest = applied if covered is None else covered  # not a writer's: skipped
        oldest = None
        if messages:
            oldest = await _log_time_after(
                js, config.deltas_stream, config.deltas_subject, delta_seq
            )
    upstream, upstream_oldest = await _upstream(js, config, max(newest, applied))
    return Lag(
        max(0, newest - applied),
        messages,
        applied,
        newest,
        oldest,
        time.time_ns(),
        upstream,
        upstream_oldest,
    )


async def _upstream(js: JetStreamContext, config: Config, handled: int) -> tuple[int, int | None]:
    """Events logged after ``handled`` (the newest with a delta) that the writer has not
    dead-lettered either: ``(count, log time of the oldest)``. An event the writer refused
    has no delta but is handled: the newest dead letter of the writer says how far it got."""
    logged = await last_seq_of(js, config.events_stream, config.events_subjects)
    if logged <= handled:
        return 0, None
    try:
        raw = await js.get_last_msg(dead_letter_stream(config), config.dead_letter_subject)
    except NotFoundError:
        pass
    else:
        headers = raw.headers or {}
        seq = headers.get(SOURCE_SEQ, "")
        if headers.get(SOURCE_STREAM) == config.events_stream and seq.isdigit():
            handled = max(handled, int(seq))
    if logged <= handled:
        return 0, None
    oldest = await _log_time_after(js, config.events_stream, config.events_subjects, handled)
    return logged - handled, oldest


# ---- watching -----------------------------------------------------------------------------


class LagWatched:
    """What a consumer with a :class:`LagWatch` (the writer, the projector) offers its user."""

    lag_watch: LagWatch

    @property
    def lag(self) -> Lag:
        """The last measurement of its lag (taken every ``lag_check_s`` while it runs)."""
        return self.lag_watch.lag

    async def measure_lag(self) -> Lag:
        """Its lag now (:func:`writer_lag`, :func:`projector_lag`), judged as the watch does."""
        return await self.lag_watch.check()


class LagWatch:
    """Measures a consumer's lag every ``lag_check_s`` and says when it falls behind."""

    def __init__(
        self,
        who: str,
        measure: Callable[[], Awaitable[Lag]],
        config: WatchSettings,
        log: logging.Logger,
    ) -> None:
        self.who = who
        self.config = config
        self.lag = Lag()  # the last measurement
        self.behind = False  # warned, and not caught up since
        self.warnings = 0  # lines said about falling or staying behind
        self.failures = 0  # measurements that failed (the server away)
        self._measure = measure
        self._log = log
        self._context = {"namespace": config.namespace}  # the log lines' context
        self._since = 0.0
        self._said = 0.0
        self._worst = 0

    async def check(self) -> Lag:
        """Measure now (within a bounded time), judge, and return the measurement."""
        lag = await asyncio.wait_for(self._measure(), ATTEMPT_TIMEOUT_S)
        self.lag = lag
        self._judge(lag, asyncio.get_running_loop().time())
        return lag

    async def run(self) -> None:
        """Check at once, then every ``lag_check_s``, until cancelled; a failed measurement
        (the server away) is counted and tried again at the next check."""
        while True:
            try:
                await self.check()
            except (TimeoutError, nats.errors.Error) as exc:
                self.failures += 1
                self._log.debug("%s lag not measured: %r", self.who, exc, extra=self._context)
            await asyncio.sleep(self.config.lag_check_s)

    def _judge(self, lag: Lag, now: float) -> None:
        if not self.behind:
            if over(self.config, lag):
                self.behind = True
                self._since = self._said = now
                self._worst = lag.events
                self.warnings += 1
                self._log.warning(
                    "%s falling behind: %s (it warns at %s)",
                    self.who,
                    describe(self.who, lag),
                    thresholds(self.config),
                    extra=self._context,
                )
            return
        self._worst = max(self._worst, lag.events)
        if not over(self.config, lag, share=CAUGHT_UP):
            self.behind = False
            self._log.warning(
                "%s caught up: %s, after %.1fs behind (at most %s events)",
                self.who,
                describe(self.who, lag),
                now - self._since,
                f"{self._worst:,}",
                extra=self._context,
            )
        elif now - self._said >= REPEAT_S:
            self._said = now
            self.warnings += 1
            self._log.warning(
                "%s still behind after %.0fs: %s",
                self.who,
                now - self._since,
                describe(self.who, lag),
                extra=self._context,
            )
