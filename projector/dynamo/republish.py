"""Requests in flight, published again in Dynamo's wire format, for a router replica that
started after they were routed.

Dynamo's replicas have no catch-up: a frontend started later knows nothing of the requests
its peers routed, until they end. Each replica applies a peer's AddRequest and
MarkPrefillCompleted as they arrive, whoever sent them, unless the event names the replica
itself as its router (its own echo). So the ledger republishes each request's own AddRequest,
and its Mark if its prefill is done, unchanged but for the envelope: seqstate's publisher id
(:func:`seqstate.dynamo.resync_publisher_id`, which the fold ignores), sequences from 0, the
time of the republish. A replica that already has a request takes the Add as a duplicate;
the replica that routed it ignores its own echo.

A Free is republished the same way (the request's own router and worker), for a request the
ledger freed while its Add was being sent again: Dynamo 1.6.1's replicas find a Free by
request id, and ignore one for an id they do not hold, so it only ever removes a request that
a republished Add put back. The fence (:meth:`Republisher.fence`) is a Free of a fresh id, that
no replica holds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from seqstate.dynamo import (
    FREE,
    MARK,
    DynamoMessage,
    Operation,
    dynamo_subject,
    encode_dynamo,
    resync_publisher_id,
)


@dataclass(frozen=True)
class InFlight:
    """A request to republish: its endpoint, its AddRequest as stored, and whether its prefill
    is done (a Mark follows the Add)."""

    endpoint: str
    add: DynamoMessage
    marked: bool

    @property
    def rank(self) -> tuple[int, int]:
        return (self.add.worker_id, self.add.dp_rank)


def _as(add: DynamoMessage, op: Operation) -> DynamoMessage:
    """The request's Mark or Free: its id, worker, router and LoRA, no AddRequest fields."""
    return msgspec.structs.replace(
        add,
        op=op,
        token_sequence=None,
        track_prefill_tokens=True,
        expected_output_tokens=None,
        prefill_tokens=None,
        expected_prefill_duration=None,
    )


class Republisher:
    """Numbers and sends the republished messages of one namespace, on NATS Core as Dynamo
    does (no ack: a flush after each call says the server has them all, and has handed each
    to every subscriber on it)."""

    def __init__(
        self, nc: Client, namespace: str, *, clock_ms: Callable[[], int] | None = None
    ) -> None:
        self.nc = nc
        self.publisher_id = resync_publisher_id(namespace)
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self.sequence = 0

    def messages(self, requests: Iterable[InFlight]) -> list[tuple[str, bytes]]:
        """``(subject, bytes)`` of each message, in order: an Add, then its Mark if any."""
        out = []
        for request in requests:
            subject = dynamo_subject(request.endpoint)
            out.append((subject, self._encode(request.add)))
            if request.marked:
                out.append((subject, self._encode(_as(request.add, MARK))))
        return out

    def frees(self, requests: Iterable[InFlight]) -> list[tuple[str, bytes]]:
        """``(subject, bytes)`` of each request's Free."""
        return [(dynamo_subject(r.endpoint), self._encode(_as(r.add, FREE))) for r in requests]

    def fence(self, like: InFlight) -> tuple[str, bytes]:
        """A Free of a fresh request id on ``like``'s endpoint, under seqstate's own router
        id: no replica holds it, and its bytes are found again in the log (the fence)."""
        fresh = msgspec.structs.replace(
            _as(like.add, FREE), request_id=str(uuid.uuid4()), router_id=self.publisher_id
        )
        return dynamo_subject(like.endpoint), self._encode(fresh)

    def _encode(self, message: DynamoMessage) -> bytes:
        ours = msgspec.structs.replace(
            message,
            publisher_id=self.publisher_id,
            sequence=self.sequence,
            published_at_ms=self._clock_ms(),
        )
        self.sequence += 1
        return encode_dynamo(ours)

    async def send(self, messages: list[tuple[str, bytes]]) -> int:
        """Send ``messages`` in order, then flush; returns how many. Raises the client's error
        if the connection fails before the flush."""
        for subject, data in messages:
            await self.nc.publish(subject, data)
        await self.nc.flush()
        return len(messages)

    async def publish(self, requests: Iterable[InFlight]) -> int:
        """Send every request's Add (and Mark); returns how many messages."""
        return await self.send(self.messages(requests))
