"""RouterPublisher: how a router puts lifecycle events on the SEQSTATE_EVENTS stream.

Every event gets ``Nats-Msg-Id: <router_id>:<router_seq>`` (``router_seq`` counts from 1 per
publisher), so a publish retried after a lost ack is stored once: JetStream acknowledges the
repeat with the original sequence and flags it duplicate. Publishes are pipelined with
``publish_async``; at most ``max_pending`` of them are unacknowledged at once, and each call
awaits its own ack, so callers can fire many events concurrently with ``asyncio.gather``.

A publish is never dropped silently: an ack that times out, finds no stream or carries an error
is retried (same msg-id) up to ``retries`` times, then the call raises :class:`PublishError`.

``router_id`` must be unique per publisher *incarnation* within the stream's duplicate window
(120 s): a restarted router that reuses its id would repeat msg-ids ``<id>:1, <id>:2, ...``,
which JetStream would silently discard as duplicates. Include something per-process in it
(host, pid, a random suffix). As a guard, a duplicate ack on a *first* attempt (which only a
msg-id collision can cause) raises :class:`PublishError` instead of passing as success.

Order: events published one after another (each awaited) are stored in that order. Events
fired concurrently are stored in some order, and a retried one may land after events published
later; the writer tolerates that (a Free before its Add leaves a tombstone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.api import PubAck

from projector.config import Config
from projector.stream import MSG_ID as MSG_ID_HEADER
from seqstate import (
    AddOutputBlock,
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    decode_event,
    encode_event,
)
from seqstate.errors import SeqstateError

# An event's delta is about its size plus headers; both must fit under the server's limit.
EVENT_HEADROOM = 8 * 1024
# Pause before retry n (1-based): BACKOFF_S * 2**(n-1), capped; gives a stream leader election
# or a brief disconnect a moment, without slowing a clean failure much.
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

_WORKER_EVENTS = (AddRequest, MarkPrefillCompleted, Free, AddOutputBlock)
_ROUTER_EVENTS = (AddRequest, MarkPrefillCompleted, Free)


class EventTooLarge(SeqstateError, ValueError):
    """An event too large for the server to store, or for the writer to store its delta."""


class PublishError(SeqstateError, RuntimeError):
    """An event could not be stored on the stream; the message names the request and msg-id."""

    def __init__(self, message: str, *, msg_id: str, request_id: str | None) -> None:
        super().__init__(message)
        self.msg_id = msg_id
        self.request_id = request_id


class RouterPublisher:
    """Publishes one router's lifecycle events, pipelined, deduplicated, never dropped."""

    def __init__(
        self,
        nc: Client,
        *,
        namespace: str | None = None,
        router_id: str,
        config: Config | None = None,
        max_pending: int = 256,
        retries: int = 3,
        timeout: float = 5.0,
    ) -> None:
        if not router_id:
            raise ValueError("router_id must not be empty")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: must be at least 1")
        if retries < 0:
            raise ValueError(f"retries={retries}: must not be negative")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be positive")
        # One rule, as in RegistryView: ``namespace``, when given, wins over ``config``'s.
        self.config = (config or Config()).with_namespace(namespace)
        self._nc = nc
        self.router_id = router_id
        self.max_pending = max_pending
        self.retries = retries
        self.timeout = timeout
        # Our own semaphore bounds unacknowledged publishes (held across retries too); the
        # client's internal one gets the same size and so never stalls on its own.
        self._js = nc.jetstream(timeout=timeout, publish_async_max_pending=max_pending)
        self._slots = asyncio.Semaphore(max_pending)
        self._router_seq = 0
        self._last_seq: int | None = None
        # One future per call in progress (resolved with None however the call ends): flush
        # waits for those in progress when it is called, so steady traffic cannot starve it.
        self._in_progress: set[asyncio.Future[None]] = set()

    @property
    def router_seq(self) -> int:
        """The router_seq of the last event handed to :meth:`publish` (0 before any)."""
        return self._router_seq

    @property
    def last_sequence(self) -> int | None:
        """The highest stream sequence acknowledged so far (None if none)."""
        return self._last_seq

    @property
    def pending(self) -> int:
        """Calls that have not finished yet (waiting for a slot, an ack or a retry)."""
        return len(self._in_progress)

    async def add(
        self,
        request_id: str,
        worker_id: int,
        dp_rank: int = 0,
        block_hashes: Iterable[int] = (),
        prefill_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        expected_output_tokens: int | None = None,
        track_prefill_tokens: bool = True,
        lora_name: str | None = None,
    ) -> int:
        """Publish an AddRequest; returns its stream sequence."""
        return await self.publish(
            AddRequest(
                request_id=request_id,
                worker_id=worker_id,
                dp_rank=dp_rank,
                block_hashes=list(block_hashes),
                prefill_tokens=prefill_tokens,
                expected_prefill_ms=expected_prefill_ms,
                expected_output_tokens=expected_output_tokens,
                track_prefill_tokens=track_prefill_tokens,
                router_id=self.router_id,
                lora_name=lora_name,
            )
        )

    async def mark_prefill_completed(
        self, request_id: str, worker_id: int, dp_rank: int = 0
    ) -> int:
        """Publish a MarkPrefillCompleted; returns its stream sequence."""
        return await self.publish(
            MarkPrefillCompleted(
                request_id=request_id,
                worker_id=worker_id,
                dp_rank=dp_rank,
                router_id=self.router_id,
            )
        )

    async def free(self, request_id: str, worker_id: int, dp_rank: int = 0) -> int:
        """Publish a Free; returns its stream sequence."""
        return await self.publish(
            Free(
                request_id=request_id,
                worker_id=worker_id,
                dp_rank=dp_rank,
                router_id=self.router_id,
            )
        )

    def subject_for(self, event: Event) -> str:
        """Worker events go to ``<ns>.<worker_id>.<dp_rank>``; Tick and topology to control."""
        if isinstance(event, _WORKER_EVENTS):
            return self.config.event_subject(event.worker_id, event.dp_rank)
        return self.config.control_subject

    async def publish(self, event: Event) -> int:
        """Publish any seqstate event; returns its stream sequence.

        An AddRequest, MarkPrefillCompleted or Free with an empty ``router_id`` gets this
        publisher's. The event is validated as the writer will decode it, so a bad field
        raises :class:`seqstate.EventDecodeError` here (and consumes no router_seq) instead of
        being dead-lettered downstream.
        """
        event, payload = self.check(event)
        subject = self.subject_for(event)
        request_id: str | None = getattr(event, "request_id", None)

        self._router_seq += 1
        msg_id = f"{self.router_id}:{self._router_seq}"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_progress.add(done)
        try:
            async with self._slots:
                ack = await self._publish_with_retries(subject, payload, msg_id, request_id, event)
        finally:
            self._in_progress.discard(done)
            done.set_result(None)
        if self._last_seq is None or ack.seq > self._last_seq:
            self._last_seq = ack.seq
        return ack.seq

    def check(self, event: Event) -> tuple[Event, bytes]:
        """The event as it will be sent (with this router's id) and its bytes, or the error
        :meth:`publish` would raise for it: :class:`seqstate.EventDecodeError` for a bad
        field, :class:`EventTooLarge` for one the server could not store."""
        if isinstance(event, _ROUTER_EVENTS) and not event.router_id:
            event = msgspec.structs.replace(event, router_id=self.router_id)
        payload = encode_event(event)
        decode_event(payload)  # constructors skip Meta bounds; the writer will not
        limit = self._nc.max_payload - EVENT_HEADROOM
        if len(payload) > limit:
            raise EventTooLarge(
                f"{_what(event, getattr(event, 'request_id', None))}: {len(payload):,} bytes "
                f"encoded, over the {limit:,} bytes one event may take (the server's "
                f"max_payload of {self._nc.max_payload:,} less room for its delta's headers); "
                "it was not sent"
            )
        return event, payload

    async def _publish_with_retries(
        self, subject: str, payload: bytes, msg_id: str, request_id: str | None, event: Event
    ) -> PubAck:
        errors: list[str] = []
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                future = await self._js.publish_async(
                    subject, payload, headers={MSG_ID_HEADER: msg_id}
                )
                # publish_async never times out by itself; wait_for cancels the future on
                # timeout, which frees the client's slot and ignores a late ack.
                ack = await asyncio.wait_for(future, self.timeout)
            except (TimeoutError, nats.errors.Error) as exc:
                errors.append(_describe(exc))
                continue
            if ack.duplicate and attempt == 0:
                raise PublishError(
                    f"{_what(event, request_id)}: msg-id {msg_id} was already used (stream "
                    f"sequence {ack.seq}), so the event was not stored; another publisher or "
                    f"an earlier run uses router_id {self.router_id!r}",
                    msg_id=msg_id,
                    request_id=request_id,
                )
            return ack
        raise PublishError(
            f"{_what(event, request_id)}: msg-id {msg_id} not acknowledged after "
            f"{self.retries + 1} attempt(s) to {subject}: {'; '.join(errors)}",
            msg_id=msg_id,
            request_id=request_id,
        )

    async def flush(self) -> int | None:
        """Wait for every publish in progress to finish; the highest sequence acknowledged.

        A publish that ends in :class:`PublishError` raises to its own caller, not here.
        """
        if self._in_progress:
            await asyncio.wait(list(self._in_progress))
        return self._last_seq


def _what(event: Event, request_id: str | None) -> str:
    name = type(event).__name__
    return f"{name} for request {request_id!r}" if request_id is not None else name


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "ack timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
