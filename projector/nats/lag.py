"""Lag: how far the writer and the projector are behind their input, and saying so.

A consumer's lag is what its input holds that it has not handled yet:

- the writer's: the namespace's events stored on the events stream but not folded yet, and how
  long ago the oldest of them was logged; and the namespace's Dynamo messages captured but not
  in the events stream yet (:mod:`projector.nats.backlog`: the events stream refuses them,
  full, or has not sourced them yet), with those the capture stream dropped before they were
  taken;
- the projector's: deltas stored on the deltas stream but not yet in the bucket (in events, the
  namespace's events up to the newest with a stored delta that the bucket does not have; in
  delta messages too), and how long ago the oldest of those messages was stored. Its
  ``upstream`` part: events logged that the writer has not handled visibly yet (no delta, no
  dead letter), and Dynamo messages captured and not in the events stream yet, and how long
  ago the oldest was logged. A paused writer stores no delta, so the projector alone is never
  behind then, while its bucket grows stale: :attr:`Lag.behind_events` and
  :attr:`Lag.behind_s` count both, and ``/readyz`` judges by them. The projector's lease
  renewals carry its last measurement to the bucket's readers (:meth:`Lag.heartbeat`).

Events are counted by the server, the namespace's own (:func:`~projector.nats.backlog.
waiting_after`), never as a sequence difference, which counted every namespace's events on a
shared stream. Each measurement is a few small reads of the server, made every
``lag_check_s``, never per message; the writer's also reads how full its streams are against
their limits, and the account's storage. ``seqstate status`` measures the same from outside,
with the positions the consumers leave on the streams and in the bucket.

:class:`LagWatch` keeps a consumer's last measurement (``lag``) and tells the log when it falls
behind: one warning when the lag reaches ``behind_warn_events`` events or the oldest waiting
event has waited ``behind_warn_s``; another every ``REPEAT_S`` while it stays behind; and one
line (a warning too, so that whoever saw the first sees it) once it has caught up, which is
when it is back under a tenth of each threshold: under steady load a few events always wait,
and a lag hovering at a threshold must not make a line per check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.nats.backlog import (
    Captured,
    StorageUse,
    StreamUse,
    Waiting,
    captured,
    storage_use,
    use_of,
    waiting_after,
)
from projector.nats.client_internals import client_of
from projector.nats.failures import ATTEMPT_TIMEOUT_S
from projector.nats.resources import dead_letter_stream, dynamo_capture
from projector.nats.retention import trimmed_below
from projector.nats.stream import last_seq_of
from projector.settings.config import Config
from projector.wire.capture import captured_subjects
from projector.wire.chain import covered_source
from projector.wire.headers import SOURCE_SEQ, SOURCE_STREAM
from projector.wire.values import Heartbeat

REPEAT_S = 60.0  # while behind, the warning is repeated this often
CAUGHT_UP = 0.1  # caught up again: under this share of each threshold
# While a consumer is further behind than /readyz allows (a start folding a backlog), its lag
# is looked up this often instead of every lag_check_s: it is seen ready once it is, not up to
# lag_check_s (2 s) later. A few small reads per look, only until it has caught up.
CATCHING_UP_CHECK_S = 0.05


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
    # The writer's: the namespace's capture stream against what the events stream has taken
    # of it (None: no capture stream); its streams' use, and the account's storage.
    capture: Captured | None = None
    streams: tuple[StreamUse, ...] = ()
    storage: StorageUse | None = None
    exact: bool = True  # False: counted by sequence difference (an older server)
    # Captured messages waited at this measurement and the one before, and the events stream
    # took none of them in between: it refuses them (full), it is not slow (set by the watch).
    stalled: bool = False
    # The namespace's newest logged event, read after the counts (so the events counted are at
    # or below it): a reader whose position reaches it lacks none of them.
    head: int = 0

    def _age(self, *stamps: int | None) -> float:
        known = [ns for ns in stamps if ns is not None]
        return max(0.0, (self.measured_ns - min(known)) / 1e9) if known else 0.0

    @property
    def oldest_age_s(self) -> float:
        """How long the oldest waiting message had waited when measured (0.0: none waits)."""
        return self._age(self.oldest_ns)

    @property
    def captured(self) -> int:
        """Dynamo messages captured and not in the events stream yet."""
        return self.capture.waiting if self.capture is not None else 0

    @property
    def waiting(self) -> int:
        """What the consumer's input holds that it has not handled: its events, and the
        messages captured for it that wait outside the events stream."""
        return self.events + self.captured

    @property
    def waiting_s(self) -> float:
        """How long the oldest of :attr:`waiting` had waited (0.0: none)."""
        return self._age(self.oldest_ns, self.capture.oldest_ns if self.capture else None)

    @property
    def behind_events(self) -> int:
        """Events logged (or captured) that the consumer's output does not reflect yet,
        upstream included (the projector's bucket: neither the writer's deltas nor the bucket
        have them)."""
        return self.waiting + self.upstream

    @property
    def behind_oldest_ns(self) -> int | None:
        """Log time of the oldest event the output does not reflect yet (None: none)."""
        capture = self.capture.oldest_ns if self.capture else None
        known = [ns for ns in (self.oldest_ns, self.upstream_oldest_ns, capture) if ns is not None]
        return min(known, default=None)

    @property
    def behind_s(self) -> float:
        """How long the oldest event the output does not reflect yet had waited (0.0: none)."""
        return self._age(self.behind_oldest_ns)

    def heartbeat(self, ago_s: float) -> Heartbeat:
        """This measurement as the projector's lease renewals carry it to readers of the
        bucket, taken ``ago_s`` seconds before the renewal."""
        return Heartbeat(
            self.head, self.behind_events, self.captured, self.behind_oldest_ns, round(ago_s, 3)
        )


def describe(who: str, lag: Lag) -> str:
    """The lag in words, as the log and ``seqstate status`` say it."""
    if who == "writer" and not lag.events:
        said = f"nothing to fold (folded up to event {lag.position})"
    elif who == "writer":
        said = (
            f"{lag.events:,} events stored but not folded yet (folded up to event "
            f"{lag.position}, the log at {lag.newest}), the oldest logged "
            f"{lag.oldest_age_s:.1f}s ago"
        )
    elif not lag.messages:
        said = f"every delta is in the bucket (up to event {lag.position})"
    else:
        said = (
            f"{lag.events:,} events in {lag.messages:,} delta messages not in the bucket yet "
            f"(the bucket at event {lag.position}, the deltas at {lag.newest}), the oldest "
            f"stored {lag.oldest_age_s:.1f}s ago"
        )
    return said + "".join(f"; {line}" for line in captured_lines(lag.capture, lag.measured_ns))


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
    @property
    def ready_lag_events(self) -> int | None: ...


@dataclass(frozen=True)
class LagSettings:
    """A :class:`LagWatch`'s settings, and no others (built by :mod:`projector.run.assemble`)."""

    namespace: str
    behind_warn_events: int | None
    behind_warn_s: float | None
    lag_check_s: float
    # How far behind /readyz allows (Config.ready_lag_events): while further behind, the lag is
    # looked up every CATCHING_UP_CHECK_S. None: every lag_check_s, whatever it finds.
    ready_lag_events: int | None = None


def thresholds(config: LagLimits) -> str:
    """The warning thresholds in words: ``50,000 events or 10s``."""
    said = []
    if config.behind_warn_events is not None:
        said.append(f"{config.behind_warn_events:,} events")
    if config.behind_warn_s is not None:
        said.append(f"{config.behind_warn_s:g}s")
    return " or ".join(said) or "never"


def captured_lines(capture: Captured | None, measured_ns: int) -> list[str]:
    """What waits in (or was dropped from) a capture stream, as measured at ``measured_ns``,
    in words; nothing if nothing."""
    if capture is None:
        return []
    lines = []
    if capture.waiting:
        age = ""
        if capture.oldest_ns is not None:
            waited = max(0.0, (measured_ns - capture.oldest_ns) / 1e9)
            age = f", the oldest captured {waited:.1f}s ago"
        lines.append(
            f"{capture.waiting:,} Dynamo messages captured but not in the events stream yet "
            f"(captured up to {capture.last}, taken up to {capture.sourced}){age}"
            + (f": {capture.error}" if capture.error else "")
        )
    if capture.dropped:
        lines.append(
            f"{capture.dropped:,} captured Dynamo messages dropped by {capture.stream} before "
            "the events stream took them (lost: raise its byte limit, lift the events "
            "stream's)"
        )
    return lines


def over(config: LagLimits, lag: Lag, share: float = 1.0) -> bool:
    """Whether ``lag`` reaches ``share`` of either threshold (a threshold 'off' never does)."""
    events, seconds = config.behind_warn_events, config.behind_warn_s
    return (events is not None and lag.waiting >= events * share) or (
        seconds is not None and lag.waiting_s >= seconds * share
    )


# ---- measuring ----------------------------------------------------------------------------


async def capture_of(
    js: JetStreamContext, config: Config, events: api.StreamInfo | None = None
) -> Captured | None:
    """The namespace's capture stream against what its events stream (``events``: its info,
    if read already) has taken of it; None: no capture stream, or no events stream."""
    if events is None:
        try:
            events = await js.stream_info(config.events_stream)
        except NotFoundError:
            return None

    async def trimmed() -> bool:
        return bool(await trimmed_below(client_of(js), config))

    subjects = captured_subjects(config.namespace)
    return await captured(js, events, dynamo_capture(config), subjects, trimmed)


async def writer_lag(
    js: JetStreamContext, config: Config, folded: int, *, capture: bool | None = None
) -> Lag:
    """The writer's lag, for a writer that has handled every event up to ``folded``; with
    what waits in the capture stream (``capture``: whether to look; by default when the
    configuration names Dynamo endpoints: a role may read only its own), and how full the
    streams are."""
    newest = await last_seq_of(js, config.events_stream, config.events_subjects)
    waiting = await waiting_after(js, config.events_stream, config.events_subjects, folded)
    events = await js.stream_info(config.events_stream)
    captures = bool(config.dynamo_endpoints) if capture is None else capture
    names = [dynamo_capture(config)] if captures else []
    streams = [use_of(events)]
    for name in [*names, dead_letter_stream(config)]:
        try:
            streams.append(use_of(await js.stream_info(name)))
        except NotFoundError:
            continue
    return Lag(
        waiting.count,
        waiting.count,
        folded,
        max(newest, folded),
        waiting.oldest_ns,
        time.time_ns(),
        capture=await capture_of(js, config, events) if captures else None,
        streams=tuple(streams),
        storage=await storage_use(js),
        exact=waiting.exact,
        head=max(newest, folded),
    )


async def projector_lag(js: JetStreamContext, config: Config, applied: int, delta_seq: int) -> Lag:
    """The projector's lag, for a bucket whose position is event ``applied``, delta message
    ``delta_seq``; with what the writer has not handled yet (``upstream``)."""
    try:
        raw = await js.get_last_msg(config.deltas_stream, config.deltas_subject)
    except NotFoundError:
        messages, newest, oldest = Waiting(), applied, None
    else:
        covered = covered_source(raw.headers, raw.data)
        newest = applied if covered is None else covered  # not a writer's: skipped
        messages = await waiting_after(js, config.deltas_stream, config.deltas_subject, delta_seq)
        oldest = messages.oldest_ns
    unhandled = await _upstream(js, config, max(newest, applied))
    # The bucket lacks the namespace's events after its position: those the writer has
    # handled are the projector's to bring in, the rest are upstream.
    missing = await waiting_after(js, config.events_stream, config.events_subjects, applied)
    head = await last_seq_of(js, config.events_stream, config.events_subjects)
    return Lag(
        max(0, missing.count - unhandled.count) if newest > applied else 0,
        messages.count,
        applied,
        newest,
        oldest,
        time.time_ns(),
        unhandled.count,
        unhandled.oldest_ns,
        capture=await capture_of(js, config) if config.dynamo_endpoints else None,
        exact=missing.exact and messages.exact,
        head=max(head, applied),
    )


async def _upstream(js: JetStreamContext, config: Config, handled: int) -> Waiting:
    """The namespace's events logged after ``handled`` (the newest with a delta) that the
    writer has not dead-lettered either. An event the writer refused has no delta but is
    handled: the newest dead letter of the writer says how far it got."""
    try:
        raw = await js.get_last_msg(dead_letter_stream(config), config.dead_letter_subject)
    except NotFoundError:
        pass
    else:
        headers = raw.headers or {}
        seq = headers.get(SOURCE_SEQ, "")
        if headers.get(SOURCE_STREAM) == config.events_stream and seq.isdigit():
            handled = max(handled, int(seq))
    return await waiting_after(js, config.events_stream, config.events_subjects, handled)


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
        before, now = self.lag.capture, lag.capture
        if now and now.waiting and before and before.waiting and now.sourced <= before.sourced:
            lag = replace(lag, stalled=True)
        self.lag = lag
        self._judge(lag, asyncio.get_running_loop().time())
        return lag

    async def run(self) -> None:
        """Check at once, then every ``lag_check_s`` (sooner while catching up), until
        cancelled; a failed measurement (the server away) is counted and tried again at the
        next check."""
        while True:
            try:
                await self.check()
            except (TimeoutError, nats.errors.Error) as exc:
                self.failures += 1
                self._log.debug("%s lag not measured: %r", self.who, exc, extra=self._context)
            await asyncio.sleep(self._next_check_s())

    def _next_check_s(self) -> float:
        """``lag_check_s``; sooner while the last measurement found the consumer further
        behind than ``/readyz`` allows (see CATCHING_UP_CHECK_S)."""
        every, ready = self.config.lag_check_s, self.config.ready_lag_events
        if ready is not None and self.lag.measured_ns and self.lag.behind_events > ready:
            return min(every, CATCHING_UP_CHECK_S)
        return every

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
