"""``seqstate dynamo resync``: the namespace's requests in flight, told to Dynamo's replicas.

Which requests: those the bucket holds (what schedulers see), each stamped with the event that
booked it; that event, read back from the log, is the request's own AddRequest as Dynamo
published it, so it is republished as it was (the endpoint it came from, its hashes, prefill
hint, LoRA and router). Whether its prefill is done: a replay of the log (from the newest
snapshot) says, and a request the replay finds ended since the bucket was read is left out.
Requests seqstate's own routers booked (not Dynamo messages) are not Dynamo's to know.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from projector.dynamo.republish import InFlight, Republisher
from projector.ops.replay import replay
from projector.read.bucket import read_bucket
from projector.wire.config import Config
from seqstate import SeqstateError
from seqstate.dynamo import ADD, CAPTURED, DynamoMessage, decode_dynamo
from seqstate.events import EventDecodeError


class ResyncError(SeqstateError, RuntimeError):
    """A resync that cannot be done as asked; the message is one line."""


@dataclass(frozen=True)
class Resynced:
    requests: int  # AddRequests republished
    marked: int  # of them, with their Mark
    skipped: int  # held by the bucket, but not a Dynamo request of these endpoints, or ended
    publisher_id: int
    last_seq: int  # the log's event the replay reached


def endpoint_of(namespace: str, subject: str) -> str | None:
    """The endpoint of a captured subject of ``namespace`` (``None`` for any other)."""
    prefix = f"seqstate.events.{namespace}.{CAPTURED}."
    return subject[len(prefix) :] if subject.startswith(prefix) else None


async def in_flight(nc: Client, config: Config) -> tuple[list[InFlight], int, int]:
    """The Dynamo requests in flight, the bucket's entries skipped, and the replay's last event."""
    if not config.dynamo_endpoints:
        raise ResyncError(
            "no Dynamo endpoint to resync: give --dynamo-endpoint NS.COMPONENT.ENDPOINT "
            "(or SEQSTATE_DYNAMO_ENDPOINT)"
        )
    wanted = set(config.dynamo_endpoints)
    bucket = await read_bucket(nc, config)
    replayed = await replay(nc, config)
    state = replayed.state
    js = nc.jetstream()
    found: list[InFlight] = []
    skipped = 0
    for rank in sorted(bucket.slots):
        for _, value in sorted(bucket.requests(rank).items()):
            slot = state.workers.slots.get(rank)
            live = slot.requests.get(value.request_id) if slot is not None else None
            request = await _stored_add(js, config, value.applied_seq, wanted)
            if live is None or request is None or request[1].request_id != value.request_id:
                skipped += 1
                continue
            found.append(InFlight(request[0], request[1], live.marked))
    return found, skipped, replayed.last_seq


async def _stored_add(
    js: JetStreamContext, config: Config, seq: int, wanted: set[str]
) -> tuple[str, DynamoMessage] | None:
    """The endpoint and the Dynamo AddRequest stored at ``seq``, if that is what it is."""
    try:
        msg = await js.get_msg(config.events_stream, seq)
    except NotFoundError:
        return None  # trimmed: its request is older than the log kept
    endpoint = endpoint_of(config.namespace, msg.subject or "")
    if endpoint is None or endpoint not in wanted:
        return None
    try:
        message = decode_dynamo(msg.data or b"")
    except EventDecodeError:
        return None
    return (endpoint, message) if message.op == ADD else None


async def resync(nc: Client, config: Config) -> Resynced:
    """Republish every Dynamo request in flight of ``config``'s endpoints (module docstring)."""
    requests, skipped, last = await in_flight(nc, config)
    republisher = Republisher(nc, config.namespace)
    await republisher.publish(requests)
    return Resynced(
        requests=len(requests),
        marked=sum(r.marked for r in requests),
        skipped=skipped,
        publisher_id=republisher.publisher_id,
        last_seq=last,
    )
