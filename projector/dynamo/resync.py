"""``seqstate dynamo resync``: the namespace's requests in flight, told to Dynamo's replicas.

Which requests: those the bucket holds (what schedulers see), each stamped with the event that
booked it; that event, read back from the log, is the request's own AddRequest as Dynamo
published it, so it is republished as it was (the endpoint it came from, its hashes, prefill
hint, LoRA and router). Whether its prefill is done: a replay of the log (from the newest
snapshot) says, and a request the replay finds ended since the bucket was read is left out.
Requests seqstate's own routers booked (not Dynamo messages) are not Dynamo's to know.

A request may still end while its Add is on its way: its router's Free, stored after the
replay, would reach the replicas before the republished Add, which then puts the request back
until the replicas' own expiry. So a resync never stops at the publish; it fences:

1. the Adds (and Marks) are sent and flushed: the server has handed each to every subscriber
   on it, the replicas and the capture stream alike;
2. then a fence, a Free of a fresh request id (which every replica ignores), is sent, and the
   replay goes on along the log up to where the capture stored it (and to the log's end then);
3. every request republished that this fold finds ended gets its Free again, after its Add,
   from the same connection: each replica sees the two in that order.

A Free stored before the fence is caught by step 3. One stored after it was published once
the server had handed the Adds to every subscriber, so each replica has the Add first and
applies the Free after it. A Free sent again for a request a replica no longer holds is
ignored (Dynamo finds a Free by request id, and ignores an unknown one), and the replica that
routed a request ignores all of this as its own echo. The fold ignores every message of the
resync publisher, so none of it changes the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.bucket.contents import read_bucket
from projector.dynamo.republish import InFlight, Republisher
from projector.nats.stream import last_seq_of, log_time_ns
from projector.settings.config import Config
from projector.write.log_fold import fold_stream, replay
from seqstate import SeqstateError, SequenceState
from seqstate.batches import items_of
from seqstate.dynamo import ADD, CAPTURED, DynamoMessage, captured_subject, decode_dynamo
from seqstate.events import EventDecodeError

# How long the fence may take to come back through the capture: the writer's forwarder stores
# a captured message in the events stream at once; only a capture that is not there, no
# writer running (or an events stream refusing messages) takes longer.
FENCE_WAIT_S = 30.0


class ResyncError(SeqstateError, RuntimeError):
    """A resync that cannot be done as asked; the message is one line."""


@dataclass(frozen=True)
class Resynced:
    requests: int  # AddRequests republished
    marked: int  # of them, with their Mark
    skipped: int  # held by the bucket, but not a Dynamo request of these endpoints, or ended
    publisher_id: int
    last_seq: int  # the log's event the fold reached (the fence, or beyond)
    freed: int = 0  # of the requests republished, those found ended after: Free sent again


@dataclass
class Found:
    """The requests in flight, and the fold that found them (to go on with)."""

    requests: list[InFlight]
    skipped: int
    state: SequenceState
    last_seq: int


def endpoint_of(namespace: str, subject: str) -> str | None:
    """The endpoint of a captured subject of ``namespace`` (``None`` for any other)."""
    prefix = f"seqstate.events.{namespace}.{CAPTURED}."
    return subject[len(prefix) :] if subject.startswith(prefix) else None


async def in_flight(
    nc: Client, config: Config, *, base: tuple[SequenceState, int] | None = None
) -> Found:
    """The Dynamo requests in flight, the bucket's entries skipped, and the replay.

    ``base``: a fold to start from instead of a replay (a copy of the running writer's, and
    the last event it folded); it is folded on, so it must be a copy."""
    if not config.dynamo_endpoints:
        raise ResyncError(
            "no Dynamo endpoint to resync: give --dynamo-endpoint NS.COMPONENT.ENDPOINT "
            "(or SEQSTATE_DYNAMO_ENDPOINT)"
        )
    wanted = set(config.dynamo_endpoints)
    bucket = await read_bucket(nc, config)
    if base is None:
        if not await last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects):
            # A namespace whose log is empty has nothing in flight (replay refuses a range
            # that cannot mean anything; here the answer is simply none).
            return Found([], 0, config.new_state(), 0)
        replayed = await replay(nc, config)
        state, last_seq = replayed.state, replayed.last_seq
    else:
        state, last_seq = base
    js = nc.jetstream()
    found: list[InFlight] = []
    skipped = 0
    for rank in sorted(bucket.slots):
        for _, value in sorted(bucket.requests(rank).items()):
            slot = state.workers.slots.get(rank)
            live = slot.requests.get(value.request_id) if slot is not None else None
            request = await _stored_add(js, config, value.applied_seq, wanted, value.request_id)
            if live is None or request is None or request[1].request_id != value.request_id:
                skipped += 1
                continue
            found.append(InFlight(request[0], request[1], live.marked))
    return Found(found, skipped, state, last_seq)


def _live(state: SequenceState, rank: tuple[int, int], request_id: str) -> bool:
    slot = state.workers.slots.get(rank)
    return slot is not None and request_id in slot.requests


async def _stored_add(
    js: JetStreamContext, config: Config, seq: int, wanted: set[str], request_id: str
) -> tuple[str, DynamoMessage] | None:
    """The endpoint and the Dynamo AddRequest of ``request_id`` stored at ``seq`` (alone, or
    in a record batch of the capture's forwarder), if that is what it is."""
    try:
        msg = await js.get_msg(config.events_stream, seq)
    except NotFoundError:
        return None  # trimmed: its request is older than the log kept
    endpoint = endpoint_of(config.namespace, msg.subject or "")
    if endpoint is None or endpoint not in wanted:
        return None
    try:
        items = items_of(msg.data or b"")
    except EventDecodeError:
        return None
    for item in items:
        try:
            message = decode_dynamo(item)
        except EventDecodeError:
            continue
        if message.op == ADD and message.request_id == request_id:
            return endpoint, message
    return None


async def stored_at(
    nc: Client, config: Config, endpoint: str, data: bytes, *, after: int, timeout: float
) -> int | None:
    """The events stream's sequence of the message ``data`` captured from ``endpoint``, the
    first after ``after``: waited for up to ``timeout`` (None if it never came)."""
    js = nc.jetstream()
    found: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def take(msg: Msg) -> None:
        if found.done():
            return
        with contextlib.suppress(EventDecodeError):
            if data in items_of(msg.data):  # alone, or in a batch of the forwarder's
                found.set_result(log_time_ns(msg)[0])

    sub = await js.subscribe(
        captured_subject(config.namespace, endpoint),
        stream=config.events_stream,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        config=api.ConsumerConfig(opt_start_seq=after + 1),
        cb=take,
    )
    try:
        return await asyncio.wait_for(found, timeout)
    except TimeoutError:
        return None
    finally:
        await sub.unsubscribe()


async def resync(
    nc: Client,
    config: Config,
    *,
    fence_wait_s: float = FENCE_WAIT_S,
    base: tuple[SequenceState, int] | None = None,
) -> Resynced:
    """Republish every Dynamo request in flight of ``config``'s endpoints, then fence and free
    again those that ended meanwhile (module docstring). ``base``: as for :func:`in_flight`."""
    found = await in_flight(nc, config, base=base)
    requests = found.requests
    republisher = Republisher(nc, config.namespace)
    await republisher.publish(requests)
    last, freed, fenced = found.last_seq, 0, True
    if requests:
        fence = republisher.fence(requests[-1])
        await republisher.send([fence])
        at = await stored_at(
            nc, config, requests[-1].endpoint, fence[1], after=found.last_seq, timeout=fence_wait_s
        )
        fenced = at is not None
        js = nc.jetstream()
        end = max(at or 0, await last_seq_of(js, config.events_stream, config.events_subjects))
        if end > found.last_seq:
            await fold_stream(nc, config, found.state, start_seq=found.last_seq + 1, end_seq=end)
            last = end
        ended = [r for r in requests if not _live(found.state, r.rank, r.add.request_id)]
        freed = await republisher.send(republisher.frees(ended))
    done = Resynced(
        requests=len(requests),
        marked=sum(r.marked for r in requests),
        skipped=found.skipped,
        publisher_id=republisher.publisher_id,
        last_seq=last,
        freed=freed,
    )
    if not fenced:
        raise ResyncError(
            f"republished {done.requests} requests in flight, but the log did not show "
            f"resync's fence within {fence_wait_s:g} s (is the namespace capturing "
            f"{', '.join(config.dynamo_endpoints)}: seqstate run --dynamo-endpoint?); "
            f"{freed} freed by event {last} were sent their Free again, a request freed "
            "after that may stay on Dynamo's replicas until their expiry"
        )
    return done
