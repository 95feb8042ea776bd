"""RouterPublisher: how a router puts lifecycle events on the SEQSTATE_EVENTS stream.

Every event gets ``Nats-Msg-Id: <router_id>:<router_seq>:<tag>`` (``router_seq`` counts from
1 per publisher), so a publish retried after a lost ack is stored once: JetStream acknowledges
the repeat with the original sequence and flags it duplicate. A router id may hold any
characters (1 to 256 of them); in the msg-id, those a header line cannot carry as they are
(spaces, controls, non-ASCII, and ``%``) are percent-encoded, so no two router ids share
msg-ids. The tag (:mod:`projector.wire.msg_ids`) is 64 random bits per publisher, or derived
from ``msg_id_key`` when given: without it, a client that may publish on Dynamo's subjects
could take a router's next msg-id first (the events stream stores what the Dynamo capture
copies in, headers included) and have the router's event dropped as a duplicate.

Publishes are pipelined on the one connection, their acks collected on a reply subscription of
the publisher's own, and each call awaits its own acks, so callers can fire many events
concurrently with ``asyncio.gather``.

A publish is never dropped silently: an ack that times out, finds no stream or carries an error
is retried (same msg-id), then the call raises :class:`PublishError`. How long: a stream leader
election (4-9 s on an R3 cluster, measured) answers "no responders" or nothing at all, and a
restarting server takes seconds, so an event that failed that way is retried for
``retry_for_s`` (15 s) after the call's first attempt, with a pause doubling from 0.05 s to 1 s
between attempts: a call fails at most ``retry_for_s`` + ``timeout`` after its first attempt
(20 s with the defaults), and rides out an election. An error ack (the stream answered, and
said no) is not a moment's trouble: it is retried ``REFUSED_RETRIES`` (3) times, so a stream
that is full (its ``max_msgs``/``max_bytes``, or the server's JetStream storage) makes the call
raise :class:`PublishError` saying so within a second, never blocking. ``retries`` caps the
attempts after the first whatever the failure (None, the default: the time decides).
(``ensure`` gives the events stream the discard policy ``new``:
with the default ``old``, a limit would make the server drop the *oldest* events, unfolded
ones included, without a word.)
PublishError is the one exception a send that failed raises, whatever failed (an error ack,
nats-py's errors, a closed connection, the socket): a router whose server dies handles it and
nothing else. A bad event raises before anything is sent (:class:`seqstate.EventDecodeError`,
:class:`EventTooLarge`).

Backpressure: at most ``max_pending`` events, of every call together, are on the wire
unacknowledged (a retried event takes a slot again for each attempt); a caller beyond that
waits for a slot, in call order, and is never dropped nor failed for it. So what the publisher
holds for the server is bounded, however many calls are made or however large a batch is;
what waits beyond the window belongs to the callers (each waiting :meth:`publish` holds its
event and its encoded bytes, a :meth:`publish_many` its batch). :attr:`in_flight`,
:attr:`peak_in_flight`, :attr:`waiting` and :attr:`pending` show where a publisher stands.
The writer being slow does not slow a publisher: the stream takes the events, and the writer's
lag shows in ``seqstate status`` and in its log.

A restarted router may reuse its ``router_id``: each publisher draws its own tag, so its
msg-ids are its own. With ``msg_id_key`` (``seqstate publish``) they are the same for every
publisher of a router id, so a second run meets the first one's ids. As a guard, a duplicate
ack on a *first* attempt (which only a msg-id collision can cause) raises
:class:`PublishError` instead of passing as success; when the message stored under that id
came in through the Dynamo capture (it carries ``Nats-Stream-Source``) and this client may
read it, the error says so: a forged id, not an earlier run.

Order: events published one after another (each awaited) are stored in that order. Events
fired concurrently are stored in some order, and a retried one may land after events published
later; the writer tolerates that (a Free before its Add leaves a tombstone).

:meth:`RouterPublisher.publish_many` is the batch path, with the same guarantees at a fraction
of the per-event cost: it checks every event before it sends any, sends them all pipelined in
the given order with their own msg-ids and collects the acks on one reply subscription of its
own (no task, future or timer per event). Its order guarantee is in its docstring.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from projector.aio.tasks import cancel_all
from projector.nats.connection import PermissionRefused, refused_or, was_refused
from projector.nats.failures import JETSTREAM_OFF, refusal, unstored
from projector.nats.pub_ack import ACK_DECODER
from projector.route.publish_calls import (
    NO_STREAM,
    TIMED_OUT,
    EventTooLarge,
    PublishCall,
    PublishError,
    Round,
    attempts_said,
    describe_attempt,
    event_named,
    not_stored,
    quoted_router_id,
    refused_by_permissions,
)
from projector.settings.config import Config
from projector.wire import msg_ids
from projector.wire.headers import MSG_ID as MSG_ID_HEADER
from projector.wire.headers import STREAM_SOURCE
from projector.wire.sizes import batch_limit, oversize
from seqstate import (
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    decode_event,
    encode_event,
)
from seqstate.batches import MAX_EVENTS as MAX_BATCH_EVENTS
from seqstate.batches import batch_size, encode_batch_of

log = logging.getLogger("seqstate.publisher")

# Pause before retry n (1-based): BACKOFF_S * 2**(n-1), capped; gives a stream leader election
# or a brief disconnect a moment, without slowing a clean failure much.
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
# How long an event that failed for want of a stream leader or a server is retried, after the
# call's first attempt: an R3 stream leader election stalls publishing 4-9 s.
RETRY_FOR_S = 15.0
# An error ack is the stream's answer (full, or another refusal): retried this often, no more.
REFUSED_RETRIES = 3
# Error acks that only say "not now" (JetStream temporarily unavailable): retried like a
# timeout, for as long as ``retry_for_s`` allows.
TRANSIENT_ERRORS = frozenset({10008})

_ROUTER_EVENTS = (AddRequest, MarkPrefillCompleted, Free)


_CONNECTION_ERRORS = (nats.errors.Error, OSError)

_NO_RESPONDERS = "503"


class RouterPublisher:
    """Publishes one router's lifecycle events, pipelined, deduplicated, never dropped.

    ``max_pending`` (256): events unacknowledged at once, of every call together; callers
    beyond it wait for a slot (in order), never dropped or failed for it. 256 keeps the
    client's pipeline full (a round trip on loopback takes a fraction of a millisecond) while
    bounding what is buffered for the server to 256 events (about 0.6 MB of large
    AddRequests). ``timeout``: the seconds each attempt waits for its ack; ``retry_for_s``:
    how long after a call's first attempt an event that failed is retried (15 s: longer than
    a stream leader election); ``retries``: at most this many attempts after the first (None:
    as many as ``retry_for_s`` allows). An error ack is retried ``REFUSED_RETRIES`` times at
    most. ``heartbeat_every_s``: see :meth:`start`. ``batch_events``: the most events
    :meth:`publish_many` puts in one record batch (1, the default: one event per message, as
    logs written before batches hold; 64 pays one message per 64 events of a rank).
    """

    def __init__(
        self,
        nc: Client,
        *,
        namespace: str | None = None,
        router_id: str,
        config: Config | None = None,
        max_pending: int = 256,
        retries: int | None = None,
        timeout: float = 5.0,
        retry_for_s: float = RETRY_FOR_S,
        heartbeat_every_s: float = 5.0,
        msg_id_key: str | None = None,
        router_seq: int = 0,
        batch_events: int = 1,
    ) -> None:
        quoted = quoted_router_id(router_id)
        self._msg_id_prefix = quoted + ":"
        self._msg_id_suffix = ":" + msg_ids.tag(msg_id_key, quoted)
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: must be at least 1")
        if not 1 <= batch_events <= MAX_BATCH_EVENTS:
            raise ValueError(f"batch_events={batch_events}: must be 1 to {MAX_BATCH_EVENTS}")
        self.batch_events = batch_events
        if retries is not None and retries < 0:
            raise ValueError(f"retries={retries}: must not be negative")
        if retry_for_s < 0:
            raise ValueError(f"retry_for_s={retry_for_s}: must not be negative")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be positive")
        if heartbeat_every_s <= 0:
            raise ValueError(f"heartbeat_every_s={heartbeat_every_s}: must be positive")
        # One rule, as in RegistryView: ``namespace``, when given, wins over ``config``'s.
        self.config = (config or Config()).with_namespace(namespace)
        self._nc = nc
        self.router_id = router_id
        self.max_pending = max_pending
        self.retries = retries
        self.timeout = timeout
        self.retry_for_s = retry_for_s
        # One slot per event on the wire; nats-py's publish_async is not used: it leaves its
        # future pending forever when the ack carries an error (nats-io/nats.py#985), so a
        # full stream looked like an ack timeout.
        self._slots = asyncio.Semaphore(max_pending)
        self._in_flight = 0
        self._peak_in_flight = 0
        self._waiting = 0
        if router_seq < 0:
            raise ValueError(f"router_seq={router_seq}: must not be negative")
        self._router_seq = router_seq  # the last one used: a resumed publisher goes on after it
        self._last_seq: int | None = None
        # One future per call in progress (resolved with None however the call ends): flush
        # waits for those in progress when it is called, so steady traffic cannot starve it.
        self._in_progress: set[asyncio.Future[None]] = set()
        # The reply subscription (made at the first call): ``<inbox>.<token>``,
        # one token per event sent; ``_awaiting`` maps the unsettled ones to their round.
        self._inbox: str | None = None
        self._inbox_lock = asyncio.Lock()
        self._token = 0
        self._awaiting: dict[int, tuple[Round, int]] = {}
        self.heartbeat_every_s = heartbeat_every_s
        self._heartbeats: asyncio.Task[None] | None = None
        self._closing = False
        self.heartbeat_failures = 0
        # Attempts the server refused (error acks, permission refusals), by a word for why
        # (projector.nats.failures.refusal): a router's own count, for its metrics.
        self.refused: dict[str, int] = {}

    # ---- lifecycle: heartbeats and goodbye -------------------------------------------------

    async def start(self) -> RouterPublisher:
        """Heartbeat now and every ``heartbeat_every_s`` until :meth:`close`.

        From its first heartbeat on, the writer holds this router to its word: once it has
        been silent past the orphan timeout (``orphan_after_s``, 30 s by default), every
        request it added is freed (outcome ``orphaned``), so a router that crashes leaks no
        load; and while it beats, the blind age limit never expires its long requests.
        """
        if self._heartbeats is None:
            await self.publish(RouterHeartbeat(router_id=self.router_id))
            self._heartbeats = asyncio.create_task(self._beat(), name="seqstate-heartbeat")
        return self

    async def close(self, *, goodbye: bool = True) -> None:
        """Stop heartbeating; with ``goodbye``, free at once every request still held."""
        task, self._heartbeats = self._heartbeats, None
        if task is not None:
            # Python 3.11's wait_for can swallow a cancellation that races a publish's ack,
            # and the loop would beat on: the flag ends it, and the cancel is repeated.
            self._closing = True
            await cancel_all([task], None, again_after_s=0.05)
            self._closing = False
        if goodbye:
            await self.publish(RouterGoodbye(router_id=self.router_id))

    async def __aenter__(self) -> RouterPublisher:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _beat(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.heartbeat_every_s)
            try:
                await self.publish(RouterHeartbeat(router_id=self.router_id))
            except PublishError as exc:  # the next beat tries again; the timeout is generous
                self.heartbeat_failures += 1
                log.warning("router %s: heartbeat not stored: %s", self.router_id, exc)

    def msg_id(self, router_seq: int) -> str:
        """The msg-id of this publisher's event number ``router_seq``."""
        return f"{self._msg_id_prefix}{router_seq}{self._msg_id_suffix}"

    @property
    def router_seq(self) -> int:
        """The router_seq of the last event handed to :meth:`publish` or :meth:`publish_many`
        (0 before any)."""
        return self._router_seq

    @property
    def last_sequence(self) -> int | None:
        """The highest stream sequence acknowledged so far (None if none)."""
        return self._last_seq

    @property
    def pending(self) -> int:
        """Calls that have not finished yet (waiting for a slot, an ack or a retry)."""
        return len(self._in_progress)

    @property
    def in_flight(self) -> int:
        """Events sent and not yet acknowledged (or failed); never more than ``max_pending``."""
        return self._in_flight

    @property
    def peak_in_flight(self) -> int:
        """The most events ever in flight at once (at most ``max_pending``)."""
        return self._peak_in_flight

    @property
    def waiting(self) -> int:
        """Events handed to :meth:`publish` or :meth:`publish_many` that wait for a slot."""
        return self._waiting

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
        """Worker events go to ``<ns>.<worker_id>.<dp_rank>``, a router's heartbeat and
        goodbye to ``<ns>.routers``, Tick and topology to ``<ns>.control`` (the operator's:
        the router role may publish only the first two): the subject the fold (seqstate.fold)
        checks the event against, from the same rule."""
        return self.config.subject_of(event)

    async def publish(self, event: Event) -> int:
        """Publish any seqstate event; returns its stream sequence.

        An AddRequest, MarkPrefillCompleted or Free with an empty ``router_id`` gets this
        publisher's. The event is validated as the writer will decode it, so a bad field
        raises :class:`seqstate.EventDecodeError` here (and consumes no router_seq) instead of
        being dead-lettered downstream.
        """
        event, payload = self.check(event)
        self._router_seq += 1
        call = PublishCall(
            [event],
            [self.subject_for(event)],
            [payload],
            [self.msg_id(self._router_seq)],
        )
        try:
            return (await self._run(call))[0]
        except PublishError as exc:
            exc.sequences = None  # one event: the error names it
            raise

    async def publish_many(self, events: Iterable[Event]) -> list[int]:
        """Publish many events, in record batches when ``batch_events`` > 1; returns each
        event's stream sequence, in the given order (the events of one batch share its
        message's).

        With 1 (the default) every event is a message of its own, in the given order. With
        ``batch_events`` > 1 the events are grouped by subject (a rank's request events, the
        routers' lifecycle, control), keeping their order within each, and each group goes
        out in record batches (:mod:`seqstate.batches`) of at most ``batch_events`` events
        and the server's payload limit: one message, one msg-id and one ack per batch. A
        batch holds only events of its own subject, which the fold checks event by event, so
        a batch books nothing its publisher could not publish one by one. A group of one
        event goes out as that event alone, as :meth:`publish` sends it. The guarantees of
        :meth:`publish`, per message:

        - Every event is checked (:meth:`check`: its fields, and the one size rule for each
          event, :class:`EventTooLarge`) before any is sent: a bad or too large one raises
          and nothing of the call is published or takes a router_seq.
        - Each message gets ``Nats-Msg-Id: <router_id>:<router_seq>:<tag>``: every event
          takes a ``router_seq``, consecutive in the given order, and a batch's msg-id has its
          first event's, so a retried batch is stored once, whole.
        - A message whose ack times out, finds no stream or carries an error is sent again
          with its msg-id (for ``retry_for_s``; an error ack ``REFUSED_RETRIES`` times; at
          most ``retries`` times when set); one that still fails, or whose first attempt is
          acknowledged as a duplicate (a msg-id collision), makes the call raise
          :class:`PublishError` naming the first event of the first such message, once every
          other message of the call is settled. The error's ``sequences`` tell, per event,
          which were stored (those stay stored: their msg-ids are spent).
        - The writer decides each event of a batch alone: one it refuses is dead-lettered
          with its index in the batch, and its neighbours apply.

        Order: within a subject (a rank's events), the given order, whether the events share
        a batch or not; across subjects, each subject's batches in turn, the subjects in the
        order of their first events. The messages are pipelined on the one connection and
        stored in the order received when none needs a retry. A retried message lands after
        those of the call already sent; none is lost or stored twice, and the sequences
        returned say where each event landed (they increase if and only if the call was
        stored in order). Calls awaited one after another are stored in call order; a router
        that must have an event stored after another awaits the call with the first before
        it publishes the second (the writer tolerates a Free before its Add anyway: it
        leaves a tombstone).

        At most ``max_pending`` events, of this and every other call, are unacknowledged at
        once (a batch takes a slot per event); a call larger than that is sent as acks free
        room.
        """
        checked = [self.check(event) for event in events]
        if not checked:
            return []
        subjects = [self.subject_for(event) for event, _ in checked]
        prefix, suffix = self._msg_id_prefix, self._msg_id_suffix
        first = self._router_seq + 1
        self._router_seq += len(checked)
        if min(self.batch_events, self.max_pending) == 1:  # a message per event, in order
            call = PublishCall(
                [event for event, _ in checked],
                subjects,
                [payload for _, payload in checked],
                [f"{prefix}{n}{suffix}" for n in range(first, first + len(checked))],
            )
            del checked
            return await self._run(call)
        members = self._batched(checked, subjects)
        call = PublishCall(
            [checked[m[0]][0] for m in members],
            [subjects[m[0]] for m in members],
            [
                checked[m[0]][1] if len(m) == 1 else encode_batch_of([checked[n][1] for n in m])
                for m in members
            ],
            [f"{prefix}{first + m[0]}{suffix}" for m in members],
            members,
        )
        del checked  # the call holds what it needs
        return await self._run(call)

    def _batched(self, checked: list[tuple[Event, bytes]], subjects: list[str]) -> list[list[int]]:
        """The call's events (indices) by message: grouped by subject in the given order,
        cut at ``batch_events`` (and ``max_pending``) events and the payload limit."""
        groups: dict[str, list[int]] = {}
        for n, subject in enumerate(subjects):
            groups.setdefault(subject, []).append(n)
        cap = min(self.batch_events, self.max_pending, MAX_BATCH_EVENTS)
        limit = batch_limit(self._nc.max_payload)
        members: list[list[int]] = []
        for indices in groups.values():
            chunk: list[int] = []
            size = 0
            for n in indices:
                grown = size + len(checked[n][1])
                if chunk and (len(chunk) >= cap or batch_size(len(chunk) + 1, grown) > limit):
                    members.append(chunk)
                    chunk, grown = [], len(checked[n][1])
                chunk.append(n)
                size = grown
            members.append(chunk)
        return members

    async def _run(self, call: PublishCall) -> list[int]:
        """Send every event of ``call``, retrying those not stored; their sequences, in order."""
        if self._inbox is None:
            try:
                await self._open_inbox()
            except _CONNECTION_ERRORS as exc:  # e.g. a client that gave up on a dead server
                raise PublishError(
                    f"{event_named(call.events[0], call.request_id(0))}: msg-id {call.msg_ids[0]} "
                    f"{'and the rest of the call ' if len(call.events) > 1 else ''}not sent, "
                    f"no subscription for acks: {describe_attempt(exc)}",
                    msg_id=call.msg_ids[0],
                    request_id=call.request_id(0),
                    sequences=[None] * len(call.events),
                ) from exc
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._in_progress.add(done)
        try:
            todo: Sequence[int] = range(len(call.events))
            await self._send_round(call, todo, first=True)
            # The budget starts once every event has had its first attempt: a large batch
            # waiting for slots (backpressure) is not failing.
            deadline = loop.time() + self.retry_for_s
            attempt = 0
            asked = False  # whether JetStream was asked why no stream answered
            while True:
                if not asked and any(call.errors.get(i, [""])[-1] == NO_STREAM for i in todo):
                    asked = True  # no retry can store anything while JetStream is off
                    if await unstored(self._nc, self.config.events_stream) == JETSTREAM_OFF:
                        for i in todo:
                            if call.seqs[i] is None:
                                call.fatal.setdefault(i, not_stored(call, i, JETSTREAM_OFF))
                refusals = call.refusals
                todo = [
                    i
                    for i in todo
                    if call.seqs[i] is None
                    and i not in call.fatal
                    and refusals.get(i, 0) <= REFUSED_RETRIES
                ]
                attempt += 1
                if not todo or (self.retries is not None and attempt > self.retries):
                    break
                pause = min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S)
                if loop.time() + pause > deadline:
                    break
                await asyncio.sleep(pause)
                await self._send_round(call, todo, first=False)
        finally:
            self._in_progress.discard(done)
            done.set_result(None)
        seqs = call.seqs
        stored = [seq for seq in seqs if seq is not None]
        if stored and (self._last_seq is None or max(stored) > self._last_seq):
            self._last_seq = max(stored)
        if len(stored) == len(seqs):
            return stored if call.members is None else call.per_event(stored)  # type: ignore[return-value]
        raise await self._failure(call)

    async def _failure(self, call: PublishCall) -> PublishError:
        """The error of a call some event of which was not stored: the first such event's,
        named as precisely as the stream lets us (a squatted msg-id, a full disk, JetStream
        off), with the sequences of those that were."""
        seqs = call.seqs
        failed = next(i for i, seq in enumerate(seqs) if seq is None)
        error = call.fatal.get(failed)
        if failed in call.taken:
            squat = await self._squatted(call.taken[failed])
            if squat is not None:
                error = PublishError(
                    f"{event_named(call.events[failed], call.request_id(failed))}: msg-id "
                    f"{call.msg_ids[failed]} is taken by {squat}, so the event was not stored",
                    msg_id=call.msg_ids[failed],
                    request_id=call.request_id(failed),
                )
                error.squatted = True
            assert error is not None
            error.taken_at = call.taken[failed]
        if error is None:
            errors = call.errors.get(failed, [])
            why = attempts_said(errors)
            if errors and errors[-1] in (TIMED_OUT, NO_STREAM):  # what the stream says
                timed_out = errors[-1] == TIMED_OUT
                if timed_out and (deaf := self._inbox_refused()):
                    why += f"; {deaf}"
                elif said := await unstored(
                    self._nc, self.config.events_stream, timed_out=timed_out
                ):
                    why += f"; {said}"
            error = PublishError(
                f"{event_named(call.events[failed], call.request_id(failed))}: msg-id "
                f"{call.msg_ids[failed]} not stored after {len(errors)} attempt(s) to "
                f"{call.subjects[failed]}: {why}",
                msg_id=call.msg_ids[failed],
                request_id=call.request_id(failed),
            )
        error.sequences = call.per_event(list(seqs))
        return error

    async def _squatted(self, seq: int) -> str | None:
        """What stream sequence ``seq`` holds, said, if it came in through the Dynamo capture
        (a forged msg-id, not an earlier run); None if not, or if this client may not read it
        (the router role may not: then the error names the msg-id only)."""
        js = self._nc.jetstream()
        try:
            msg = await refused_or(
                self._nc,
                asyncio.wait_for(js.get_msg(self.config.events_stream, seq), self.timeout),
            )
        except (PermissionRefused, TimeoutError, *_CONNECTION_ERRORS):
            return None
        source = (msg.headers or {}).get(STREAM_SOURCE)
        if source is None:
            return None
        return (
            f"stream sequence {seq}, a message copied in from {source.split(' ', 1)[0]} (the "
            f"Dynamo capture, subject {msg.subject!r}) whose publisher forged this msg-id in "
            "its Nats-Msg-Id header"
        )

    def _inbox_refused(self) -> str | None:
        """Why no ack came, if the server refused this client its inbox: a plain
        ``nats.connect`` keeps nats' ``_INBOX`` prefix, which deploy/nats-roles.conf leaves to
        Dynamo's processes (the violation reaches only the client's error callback)."""
        error, inbox = self._nc.last_error, self._inbox
        if error is None or inbox is None:
            return None
        said = str(error).lower()
        if "permissions violation for subscription" not in said or inbox.lower() not in said:
            return None
        return (
            f"NATS refused this client the subscription to its inbox {inbox}* (permissions "
            'violation), where the acks come: connect with inbox_prefix="_SEQSTATE_INBOX.<user>" '
            "(projector.connect does)"
        )

    async def _open_inbox(self) -> None:
        async with self._inbox_lock:
            if self._inbox is None:
                inbox = f"{self._nc.new_inbox()}."
                await self._nc.subscribe(f"{inbox}*", cb=self._on_ack)
                self._inbox = inbox

    async def _send_round(self, call: PublishCall, todo: Sequence[int], *, first: bool) -> None:
        """Send the events ``todo`` (indices, in order) once; return when each is settled."""
        loop = asyncio.get_running_loop()
        rnd = Round(call, first, loop.create_future())
        publish = self._nc.publish
        acquire = self._slots.acquire
        awaiting = self._awaiting
        sent = rnd.sent
        inbox = self._inbox
        subjects, payloads, msg_ids = call.subjects, call.payloads, call.msg_ids
        timeout = self.timeout
        now = loop.time
        weight = call.weight
        unsent = sum(weight(i) for i in todo)
        self._waiting += unsent
        held = 0  # slots taken for the message being sent (a batch takes one per event)
        try:
            for i in todo:
                for _ in range(weight(i)):
                    await acquire()
                    held += 1
                    self._waiting -= 1
                    unsent -= 1
                self._in_flight += held
                held = 0
                if self._in_flight > self._peak_in_flight:
                    self._peak_in_flight = self._in_flight
                self._token = token = self._token + 1
                awaiting[token] = (rnd, i)
                rnd.open += 1
                deadline = now() + timeout
                sent.append((deadline, token, i))
                if rnd.timer is None:
                    rnd.timer = loop.call_at(deadline, self._expire, rnd)
                try:
                    await publish(
                        subjects[i],
                        payloads[i],
                        reply=f"{inbox}{token}",
                        headers={MSG_ID_HEADER: msg_ids[i]},
                    )
                except _CONNECTION_ERRORS as exc:  # e.g. the connection is closed
                    if awaiting.pop(token, None) is not None:
                        self._settle(rnd, i, None, describe_attempt(exc))
            rnd.sending = False
            if rnd.open:
                await rnd.done
        finally:
            self._waiting -= unsent  # only if cancelled: these were never sent
            for _ in range(held):  # only if cancelled amid a batch's slots
                self._slots.release()
            rnd.sending = False
            if rnd.timer is not None:
                rnd.timer.cancel()
            for _, token, i in sent[rnd.cursor :]:  # only if cancelled: give back their slots
                if awaiting.pop(token, None) is not None:
                    self._release(weight(i))

    async def _on_ack(self, msg: Msg) -> None:
        """The reply subscription's callback: settle the event the ack's token names."""
        assert self._inbox is not None
        try:
            token = int(msg.subject[len(self._inbox) :])
        except ValueError:
            return
        entry = self._awaiting.pop(token, None)
        if entry is None:  # a late ack, after the event timed out: its retry settles it
            return
        rnd, i = entry
        try:
            ack = ACK_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            status = (msg.headers or {}).get("Status")
            if status == _NO_RESPONDERS:
                problem = NO_STREAM
            else:
                problem = f"unreadable ack (status {status}): {msg.data[:200]!r}"
            self._settle(rnd, i, None, problem)
            return
        if ack.error is not None:
            err = ack.error
            api_error = nats.js.errors.APIError(
                code=err.code, err_code=err.err_code, description=err.description
            )
            if err.err_code not in TRANSIENT_ERRORS:
                calls = rnd.call.refusals
                calls[i] = calls.get(i, 0) + 1
                self._count_refusal(refusal(api_error))
            self._settle(rnd, i, None, describe_attempt(api_error))
        elif ack.duplicate and rnd.first:
            call = rnd.call
            request_id = call.request_id(i)
            call.taken[i] = ack.seq
            call.fatal[i] = PublishError(
                f"{event_named(call.events[i], request_id)}: msg-id {call.msg_ids[i]} was already "
                f"used (stream sequence {ack.seq}), so the event was not stored; another "
                f"publisher or an earlier run uses router_id {self.router_id!r}",
                msg_id=call.msg_ids[i],
                request_id=request_id,
            )
            self._settle(rnd, i, None, None)
        else:
            self._settle(rnd, i, ack.seq, None)

    def _count_refusal(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    def _release(self, weight: int = 1) -> None:
        self._in_flight -= weight
        for _ in range(weight):
            self._slots.release()

    def _settle(self, rnd: Round, i: int, seq: int | None, problem: str | None) -> None:
        """Message ``i`` of ``rnd`` is acknowledged (``seq``) or failed (``problem``)."""
        self._release(rnd.call.weight(i))
        if seq is not None:
            rnd.call.seqs[i] = seq
        elif problem is not None:
            rnd.call.errors.setdefault(i, []).append(problem)
        rnd.open -= 1
        if not rnd.open and not rnd.sending and not rnd.done.done():
            rnd.done.set_result(None)

    def _expire(self, rnd: Round) -> None:
        """The timer: fail the events of ``rnd`` whose ack is overdue, then re-arm."""
        rnd.timer = None
        awaiting = self._awaiting
        sent = rnd.sent
        now = asyncio.get_running_loop().time()
        while rnd.cursor < len(sent):
            deadline, token, i = sent[rnd.cursor]
            if token in awaiting:
                if deadline > now:
                    rnd.timer = asyncio.get_running_loop().call_at(deadline, self._expire, rnd)
                    return
                del awaiting[token]
                subject = rnd.call.subjects[i]
                if was_refused(self._nc, subject):  # no retry can change the server's mind
                    rnd.call.fatal.setdefault(i, refused_by_permissions(rnd.call, i))
                    self._count_refusal("permission")
                self._settle(rnd, i, None, describe_attempt(TimeoutError()))
            rnd.cursor += 1

    def check(self, event: Event) -> tuple[Event, bytes]:
        """The event as it will be sent (with this router's id) and its bytes, or the error
        :meth:`publish` would raise for it: :class:`seqstate.EventDecodeError` for a bad
        field, :class:`EventTooLarge` for one the server could not store."""
        if isinstance(event, _ROUTER_EVENTS) and not event.router_id:
            event = msgspec.structs.replace(event, router_id=self.router_id)
        payload = encode_event(event)
        decode_event(payload)  # constructors skip Meta bounds; the writer will not
        why = oversize(len(payload), self._nc.max_payload, self.config.max_event_bytes)
        if why:  # the one size rule (projector.wire.sizes): the fold would refuse it too
            raise EventTooLarge(
                f"{event_named(event, getattr(event, 'request_id', None))}: {why}; it was not sent"
            )
        return event, payload

    async def flush(self) -> int | None:
        """Wait for every publish in progress to finish; the highest sequence acknowledged.

        A publish that ends in :class:`PublishError` raises to its own caller, not here.
        """
        if self._in_progress:
            await asyncio.wait(list(self._in_progress))
        return self._last_seq
