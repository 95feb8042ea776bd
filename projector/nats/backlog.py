"""What waits where: a namespace's messages not handled yet, counted exactly, and how full the
streams that hold them are.

Three places can hold a namespace's backlog, and each is counted in its own messages:

- the events stream, shared by namespaces: the namespace's events after a position. A sequence
  difference would count every namespace's events in between (323 "not folded" for a
  namespace with one event), so the server counts them: a batched direct get of the first
  message after the position, filtered on the namespace's subjects, answers with that
  message (its log time: how long the oldest has waited) and ``Nats-Num-Pending``, the
  messages on those subjects after it. One small request whatever the stream's size (about
  2 ms on 600,000 events of 4,000 subjects, far less near the end of the stream, where a
  consumer's position is). A server without batched gets (before 2.11), or a stream without
  direct gets, is counted by sequence difference instead, and said to be inexact;
- the capture stream of the namespace's Dynamo endpoints (:mod:`projector.wire.capture`):
  messages captured that are not in the events stream yet, because no writer forwards them,
  it refuses them (full), or the forwarder has not got to them. The events stream's newest
  message on the namespace's Dynamo subjects names the last capture sequence it holds (in its
  ``Seqstate-Capture`` header, as the forwarder stores a burst; in ``Nats-Stream-Source`` on a
  log sourced before the forwarder): every captured message after it waits, and any the
  capture stream no longer holds between the two was dropped before it was taken (its byte
  limit, or its age limit, while nothing took it). None there: none was taken yet, unless the
  namespace's events were trimmed past the last one; then the capture's first sequence (the
  forwarder purges what it stored), or on a stream that still sources it the server's own
  count for the source (its ``lag``, which leaves out the few messages in flight), is used;
- the JetStream storage of the streams: messages and bytes against their limits, and the
  account's storage against its own.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.nats.client_internals import api_prefix, client_of
from projector.wire.headers import CAPTURE, STREAM_SOURCE

NUM_PENDING = "Nats-Num-Pending"
TIME_STAMP = "Nats-Time-Stamp"
ASK_S = 5.0  # one read's answer, at most
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Waiting:
    """Messages on some subjects of a stream after a sequence."""

    count: int = 0
    oldest_ns: int | None = None  # log time of the first of them (None: none waits)
    exact: bool = True  # False: a sequence difference (other subjects' messages included)


@dataclass(frozen=True)
class Captured:
    """A namespace's capture stream against what its events stream has sourced of it."""

    stream: str
    last: int = 0  # the capture stream's newest sequence
    sourced: int = 0  # the newest capture sequence in the events stream (0: none found)
    waiting: int = 0  # captured, not in the events stream yet
    oldest_ns: int | None = None  # log time of the oldest of those (None: none, or unknown)
    dropped: int = 0  # captured, then dropped by the capture stream before they were sourced
    error: str = ""  # what the events stream says of the source, if it reports a problem


@dataclass(frozen=True)
class StreamUse:
    """How full a stream is, against its own limits (None: no such limit)."""

    name: str
    messages: int
    bytes: int
    max_messages: int | None
    max_bytes: int | None
    discard: str  # "new": refuses at a limit; "old": drops its oldest

    @property
    def share(self) -> float:
        """The larger share of a limit in use (0.0 without limits)."""
        shares = [
            used / limit
            for used, limit in ((self.messages, self.max_messages), (self.bytes, self.max_bytes))
            if limit
        ]
        return max(shares, default=0.0)

    @property
    def said(self) -> str:
        """``12 of 5,000 messages (0%), 1.2 MiB of no byte limit``."""
        return (
            f"{self.messages:,} of {_limit(self.max_messages, 'messages')}, "
            f"{size(self.bytes)} of {_limit(self.max_bytes, 'bytes')}"
            + (f" ({self.share:.0%} full)" if self.max_messages or self.max_bytes else "")
        )


@dataclass(frozen=True)
class StorageUse:
    """The account's JetStream file storage (what the server lets a client see)."""

    bytes: int
    max_bytes: int | None  # None: no account limit (the server's disk may still run out)


def size(n: int) -> str:
    """Bytes as an operator reads them: ``850 B``, ``1.2 KiB``, ``85.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _limit(value: int | None, unit: str) -> str:
    if value is None:
        return f"no {'byte' if unit == 'bytes' else 'message'} limit"
    return size(value) if unit == "bytes" else f"{value:,}"


def stamp_ns(text: str) -> int | None:
    """``2026-01-05T09:12:03.418942547Z`` (RFC 3339, nanoseconds) to ns since the epoch."""
    try:
        whole, _, fraction = text.rstrip("Z").partition(".")
        seconds = dt.datetime.fromisoformat(whole).replace(tzinfo=dt.UTC).timestamp()
        return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])
    except ValueError:
        return None


def datetime_ns(when: dt.datetime) -> int:
    """An aware time (as nats-py gives a stored message's) in ns since the epoch."""
    return (when - _EPOCH) // dt.timedelta(microseconds=1) * 1000


def time_ns(msg: api.RawStreamMsg) -> int | None:
    """A stored message's log time in ns (None: the server gave none)."""
    return None if msg.time is None else datetime_ns(msg.time)


async def waiting_after(js: JetStreamContext, stream: str, subjects: str, seq: int) -> Waiting:
    """The messages on ``subjects`` of ``stream`` after sequence ``seq``, counted by the server."""
    ask = json.dumps({"seq": seq + 1, "next_by_subj": subjects, "batch": 1}).encode()
    try:
        nc, prefix = client_of(js), api_prefix(js)
        reply = await nc.request(f"{prefix}.DIRECT.GET.{stream}", ask, timeout=ASK_S)
    except nats.errors.NoRespondersError:  # no direct gets on this stream
        return await _span_after(js, stream, subjects, seq)
    headers = reply.headers or {}
    status = headers.get("Status")
    if status == "404":
        return Waiting()
    pending = headers.get(NUM_PENDING, "")
    if status or not pending.isdigit():  # an older server: one message, no count
        return await _span_after(js, stream, subjects, seq)
    return Waiting(1 + int(pending), stamp_ns(headers.get(TIME_STAMP, "")))


async def _span_after(js: JetStreamContext, stream: str, subjects: str, seq: int) -> Waiting:
    """The sequence difference up to the newest message on ``subjects`` (inexact on a stream
    that other subjects share), and the log time of the first after ``seq``."""
    try:
        newest = (await js.get_last_msg(stream, subjects)).seq or 0
    except NotFoundError:
        return Waiting()
    if newest <= seq:
        return Waiting()
    try:
        first = await js.get_msg(stream, seq=seq + 1, subject=subjects, next=True)
    except NotFoundError:
        return Waiting()
    return Waiting(newest - seq, time_ns(first), exact=False)


def sourced_seq(headers: dict[str, str] | None, capture: str) -> int:
    """The capture sequence a sourced message came from (0: not one of ``capture``'s).
    ``Nats-Stream-Source``: ``<stream> <seq> ...`` (the rest names the subjects)."""
    tokens = (headers or {}).get(STREAM_SOURCE, "").split()
    if len(tokens) >= 2 and tokens[0] == capture and tokens[1].isdigit():
        return int(tokens[1])
    return 0


def covered_seq(headers: dict[str, str] | None, capture: str) -> int:
    """The last capture sequence a message of the events stream holds (0: none of
    ``capture``'s): a message the forwarder stored names its range in ``Seqstate-Capture``
    (``<stream> <first> <last> <count>``), one the events stream sourced (a log written before
    the forwarder) its sequence in ``Nats-Stream-Source``."""
    tokens = (headers or {}).get(CAPTURE, "").split()
    if len(tokens) >= 3 and tokens[0] == capture and tokens[2].isdigit():
        return int(tokens[2])
    return sourced_seq(headers, capture)


def events_held(headers: dict[str, str] | None) -> int:
    """The Dynamo messages a message on a captured subject holds: a batch of the forwarder's
    names their count in ``Seqstate-Capture``; any other holds one."""
    tokens = (headers or {}).get(CAPTURE, "").split()
    return int(tokens[3]) if len(tokens) >= 4 and tokens[3].isdigit() else 1


async def captured(
    js: JetStreamContext,
    events: api.StreamInfo,
    capture: str,
    subjects: str,
    trimmed: Callable[[], Awaitable[bool]],
) -> Captured | None:
    """What ``capture`` holds that the stream of ``events`` (its info, which lists its
    sources) has not sourced yet; ``subjects``: what the events stream rewrites the captured
    messages to; ``trimmed``: whether the namespace's events were ever trimmed (asked only
    when none of them is a captured one). None: no such capture stream."""
    try:
        state = (await js.stream_info(capture)).state
    except NotFoundError:
        return None
    try:
        newest = await js.get_last_msg(events.config.name or "", subjects)
    except NotFoundError:
        sourced = 0
    else:
        sourced = covered_seq(newest.headers, capture)
    error, lag = "", None
    for source in events.sources or []:
        if source.name == capture:
            lag = source.lag
            if source.error:
                error = str(source.error.get("description") or source.error)
    last, first = state.last_seq, state.first_seq
    dropped = max(0, first - 1 - sourced)
    if not sourced and first > 1 and await trimmed():  # taken, then trimmed from the log
        if lag is not None:  # still sourced: the server's count (in flight left out)
            sourced, dropped = max(0, last - lag), 0
        else:  # the forwarder purges what it stored: the capture holds what waits
            sourced, dropped = first - 1, 0
    waiting = max(0, last - max(sourced, first - 1))
    oldest = None
    if waiting:
        try:
            oldest = time_ns(await js.get_msg(capture, seq=max(sourced + 1, first)))
        except NotFoundError:
            oldest = None
    return Captured(capture, last, sourced, waiting, oldest, dropped, error)


def use_of(info: api.StreamInfo) -> StreamUse:
    config, state = info.config, info.state
    discard = str(getattr(config.discard, "value", config.discard) or "old")  # str from the server
    return StreamUse(
        config.name or "",
        state.messages,
        state.bytes,
        config.max_msgs if config.max_msgs and config.max_msgs > 0 else None,
        config.max_bytes if config.max_bytes and config.max_bytes > 0 else None,
        discard,
    )


async def storage_use(js: JetStreamContext) -> StorageUse:
    info = await js.account_info()
    limit = info.limits.max_storage
    return StorageUse(info.storage, limit if limit and limit > 0 else None)
