"""The capture's forwarder: Dynamo's captured messages into the events stream, a burst per
stored message, exactly once and in order.

Dynamo's fleet sends about four replica-sync messages per request. Sourced server-side, each
became one stored message of the events stream, and the writer paid its per-message cost for
each. The forwarder, which runs in every writer, reads the namespace's capture stream and
stores what it finds waiting as record batches (:mod:`seqstate.batches`) on the captured
subject: each bin is one Dynamo message, exactly the bytes Dynamo published, and the one fold
decides each of them as it decides one alone. It never waits to fill a batch: a lone message
goes at once, as a plain message with the bytes a sourced one had (a batch of one if its
bytes start as a batch would); a burst is what the capture holds when the previous publish
is acknowledged, cut to :data:`seqstate.batches.MAX_EVENTS` events and the server's payload
limit (:func:`projector.wire.sizes.batch_limit`), one endpoint's messages per batch (the
fold checks a message against its subject).

Exactly once, across crashes and a second forwarder:

- **Resume.** Each stored message names the capture sequences it holds in its
  ``Seqstate-Capture`` header (``<capture stream> <first> <last> <count>``), so the newest
  message on the namespace's captured subjects says where the log stands; a log written by
  sourcing says it in ``Nats-Stream-Source``. The forwarder starts just after it, and reads
  it again after anything it cannot account for (an error, a timeout, a refusal).
- **Compare-and-set.** Each publish expects its subject's last stream sequence
  (``Nats-Expected-Last-Subject-Sequence``): a second forwarder, or a late publish of this
  one, that stored anything on the subject of the next message meanwhile makes it refused,
  and the forwarder reads the log again. The first message after any position goes on its
  own endpoint's subject, so two forwarders at one position always collide on one subject.
- **Msg-id.** ``capture:<stream>:<created>:<first>``: a publish retried after a lost ack is
  stored once. A duplicate is read as another's publish: read the log again.
- **Take-over.** An events stream that still sources the capture (provisioned before the
  forwarder) loses that source when a forwarder starts (idempotently), and the forwarder
  resumes after the last message sourced.
- **Purge.** What is stored is purged from the capture stream (at most once a second, and
  whenever it runs dry), so the capture holds what waits, and its first sequence says where
  to resume if retention trimmed every captured message from the log. A log message older
  than the capture stream itself (an earlier capture, deleted by ``uncapture``) says nothing
  of this one.

The capture stream goes on storing Dynamo's messages while no writer runs; the next one
forwards them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from projector.nats.backlog import covered_seq, datetime_ns
from projector.nats.lag import captured_subjects
from projector.nats.resources import dynamo_capture
from projector.settings.config import Config
from projector.wire.capture import captured_subject, endpoint_of
from projector.wire.headers import CAPTURE, EXPECTED_LAST_SUBJECT_SEQ, MSG_ID, TRUNCATED
from projector.wire.sizes import DELTA_HEADROOM, batch_limit
from seqstate.batches import HEAD, MAX_EVENTS, batch_size, encode_batch_of
from seqstate.dynamo import decode_dynamo, encode_dynamo
from seqstate.errors import SeqstateError
from seqstate.events import EventDecodeError

log = logging.getLogger("seqstate.forward")

WRONG_LAST_SEQUENCE: Final = 10071  # "wrong last sequence": another stored first
IDLE_S: Final = 1.0  # one wait for the next captured message
PURGE_EVERY_S: Final = 1.0
ABSENT_S: Final = 2.0  # how often a namespace without a capture stream is looked at again
RETRY_S: Final = (0.1, 0.25, 0.5, 1.0, 2.0)  # after an error, before reading the log again
ASK_S: Final = 5.0
LOST_SAID: Final = 100  # stores in a row refused as another's: said, and a pause
FETCH_BYTES: Final = 64 * 1024 * 1024  # what one fetch may hold, at most (its messages' bound)


class ForwardError(SeqstateError, RuntimeError):
    """The forwarder cannot go on (the server refuses it what it needs)."""


class _Lost(SeqstateError):
    """Another publish took the place of this one: read the log again."""


@dataclass(frozen=True)
class Captured:
    """One captured message: its capture sequence, Dynamo's subject, its bytes."""

    seq: int
    subject: str
    data: bytes


def forwarded_msg_id(capture: str, created_ns: int, first: int) -> str:
    return f"capture:{capture}:{created_ns}:{first}"


def _runs(items: list[Captured], limit: int) -> Iterator[list[Captured]]:
    """``items`` cut into what one stored message holds: one subject's consecutive messages,
    at most :data:`MAX_EVENTS` and ``limit`` bytes as a batch."""
    run: list[Captured] = []
    size = 0
    for item in items:
        if run and (
            item.subject != run[0].subject
            or len(run) >= MAX_EVENTS
            or batch_size(len(run) + 1, size + len(item.data)) > limit
        ):
            yield run
            run, size = [], 0
        run.append(item)
        size += len(item.data)
    if run:
        yield run


class CaptureForwarder:
    """Forwards ``config``'s capture stream into its events stream; ``await run()`` until
    cancelled. ``until``: stop once the capture's messages up to that sequence are stored
    (``uncapture`` forwards what waits so)."""

    def __init__(self, nc: Client, config: Config) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._config = config
        self.capture = dynamo_capture(config)
        self.forwarded = 0  # Dynamo messages this forwarder stored
        self.stored = 0  # messages of the events stream it stored them in
        self.through = 0  # the last capture sequence the log holds, as last known
        self._last: dict[str, int] = {}  # subject -> its last stream sequence, as last known
        self._purged = 0
        self._purged_at = 0.0
        self._created_ns = 0

    async def run(self) -> None:
        failures, lost = 0, 0
        while True:
            stored = self.stored
            try:
                await self._session(None)
                return
            except _Lost:
                failures, lost = 0, (lost if self.stored == stored else 0) + 1
                if lost % LOST_SAID == 0:  # another forwarder, or a log that says no position
                    log.warning(
                        "capture forwarder of %s: %d stores in a row taken by another",
                        self.capture,
                        lost,
                    )
                    await asyncio.sleep(RETRY_S[-1])
                continue
            except NotFoundError:
                await asyncio.sleep(ABSENT_S)  # no capture stream (yet, or any more)
            except ForwardError:
                raise
            except (TimeoutError, APIError, nats.errors.Error, OSError) as exc:
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.log(
                    logging.WARNING if failures >= len(RETRY_S) else logging.INFO,
                    "capture forwarder of %s: %s; reading the log again in %gs",
                    self.capture,
                    exc or type(exc).__name__,
                    delay,
                )
                await asyncio.sleep(delay)

    async def forward_waiting(self, timeout: float) -> int:
        """Store everything the capture holds now (within ``timeout``); the last capture
        sequence the log then holds. Raises what the server says, or TimeoutError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        until = (await self._js.stream_info(self.capture)).state.last_seq
        while True:
            try:
                await asyncio.wait_for(self._session(until), max(0.0, deadline - loop.time()))
                return self.through
            except _Lost:
                continue

    async def _session(self, until: int | None) -> None:
        """From the log's position on, until ``until`` (None: for good) or a :class:`_Lost`."""
        js = self._js
        info = await js.stream_info(self.capture)
        self._created_ns = datetime_ns(info.created) if info.created is not None else 0
        await self._take_over()
        self.through = await self._position(info)
        self._last.clear()
        if until is not None and self.through >= until:
            return
        fetch = max(1, min(MAX_EVENTS, FETCH_BYTES // max(1, self._nc.max_payload)))
        # No filter: the capture stream holds Dynamo's subjects alone (or, once uncaptured,
        # listens on none: a filter would then be refused).
        consumer = await js.add_consumer(
            self.capture,
            api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self.through + 1,
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=30.0,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        sub = await js.pull_subscribe_bind(consumer=consumer.name, stream=self.capture)
        try:
            while until is None or self.through < until:
                try:
                    msgs = await sub.fetch(fetch, timeout=IDLE_S)
                except TimeoutError:
                    await self._purge(dry=True)
                    await sub.consumer_info()  # NotFoundError: gone (a server restarted)
                    continue
                await self._store([_captured(msg) for msg in msgs if msg.reply])
                await self._purge(dry=False)
        finally:
            with contextlib.suppress(Exception):  # gone, or no connection: it expires
                await sub.unsubscribe()
                await js.delete_consumer(self.capture, consumer.name or "")

    async def _take_over(self) -> None:
        """An events stream that still sources the capture stops (the forwarder takes on)."""
        js = self._js
        try:
            events = await js.stream_info(self._config.events_stream)
        except NotFoundError:
            raise ForwardError(f"no stream {self._config.events_stream} to forward into") from None
        have = events.config.sources or []
        kept = [s for s in have if s.name != self.capture]
        if len(kept) == len(have):
            return
        updated = api.StreamConfig.from_response(events.config.as_dict())
        updated.sources = kept
        await js.update_stream(updated)
        log.info(
            "stream %s no longer sources %s: the writer's forwarder stores its messages now",
            self._config.events_stream,
            self.capture,
        )

    async def _position(self, info: api.StreamInfo) -> int:
        """The last capture sequence the log holds (or the capture no longer does)."""
        try:
            newest = await self._js.get_last_msg(
                self._config.events_stream, captured_subjects(self._config.namespace)
            )
        except NotFoundError:
            through = 0
        else:
            logged = datetime_ns(newest.time) if newest.time is not None else 0
            # a message stored before this capture stream existed is an earlier capture's
            through = covered_seq(newest.headers, self.capture) if logged >= self._created_ns else 0
        first = info.state.first_seq
        return max(through, first - 1 if first else 0)

    async def _store(self, items: list[Captured]) -> None:
        limit = batch_limit(self._nc.max_payload)
        for run in _runs([i for i in items if i.seq > self.through], limit):
            await self._publish(run)
            self.through = run[-1].seq

    async def _publish(self, run: list[Captured]) -> None:
        endpoint = endpoint_of(run[0].subject)
        if endpoint is None:  # the capture stream listens on Dynamo's subjects alone
            raise ForwardError(f"{self.capture} holds a message on {run[0].subject!r}")
        subject = captured_subject(self._config.namespace, endpoint)
        first, last = run[0].seq, run[-1].seq
        if len(run) == 1 and run[0].data[:1] != HEAD:
            payload = run[0].data  # as the events stream sourced it, byte for byte
        else:
            payload = encode_batch_of([item.data for item in run])
        expected = await self._last_on(subject)
        headers = {
            MSG_ID: forwarded_msg_id(self.capture, self._created_ns, first),
            EXPECTED_LAST_SUBJECT_SEQ: str(expected),
            CAPTURE: f"{self.capture} {first} {last} {len(run)}",
        }
        room = self._nc.max_payload - DELTA_HEADROOM
        if len(payload) > room:  # a lone message at the server's limit, too large to fold
            headers[TRUNCATED] = str(len(payload))
            payload = fitted(payload, room)
        try:
            ack = await self._js.publish(subject, payload, headers=headers, timeout=ASK_S)
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise _Lost() from None
            raise
        if ack.duplicate:
            raise _Lost()
        self._last[subject] = ack.seq
        self.forwarded += len(run)
        self.stored += 1

    async def _last_on(self, subject: str) -> int:
        found = self._last.get(subject)
        if found is None:
            try:
                found = (await self._js.get_last_msg(self._config.events_stream, subject)).seq or 0
            except NotFoundError:
                found = 0
            self._last[subject] = found
        return found

    async def _purge(self, *, dry: bool) -> None:
        """Drop what is stored from the capture stream: at most once a second, and when it
        runs dry."""
        now = asyncio.get_running_loop().time()
        if self.through <= self._purged or (not dry and now - self._purged_at < PURGE_EVERY_S):
            return
        await self._js.purge_stream(self.capture, seq=self.through + 1)
        self._purged, self._purged_at = self.through, now


def fitted(data: bytes, room: int) -> bytes:
    """A message too large to store with the forwarder's headers (within ``room`` bytes),
    made to fit and still be refused as it would be: any such message is over the largest
    event a writer takes (:func:`projector.wire.sizes.largest_event`), so the fold refuses it
    for its size whatever it holds, and only counts it in its Dynamo publisher's sequence,
    which a Dynamo message keeps with the tail of its hashes cut. Other bytes keep their
    head."""
    try:
        message = decode_dynamo(data)
    except EventDecodeError:
        return data[:room]
    tokens = message.token_sequence or []
    while tokens:
        encoded = encode_dynamo(message)
        over = len(encoded) - room
        if over <= 0:
            return encoded
        tokens = tokens[: len(tokens) - max(1, over // 9)]  # a u64 takes 1 to 9 bytes
        message = msgspec.structs.replace(message, token_sequence=tokens)
    return data[:room]


def _captured(msg: Msg) -> Captured:
    return Captured(msg.metadata.sequence.stream, msg.subject, msg.data)


async def forward_waiting(nc: Client, config: Config, timeout: float) -> int:
    """Store what ``config``'s capture stream holds now: the last capture sequence the log
    then holds."""
    return await CaptureForwarder(nc, config).forward_waiting(timeout)
