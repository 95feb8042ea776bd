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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from seqstate.dynamo import MARK, DynamoMessage, dynamo_subject, encode_dynamo, resync_publisher_id


@dataclass(frozen=True)
class InFlight:
    """A request to republish: its endpoint, its AddRequest as stored, and whether its prefill
    is done (a Mark follows the Add)."""

    endpoint: str
    add: DynamoMessage
    marked: bool


class Republisher:
    """Numbers and sends the republished messages of one namespace, on NATS Core as Dynamo
    does (no ack: a flush at the end says the server has them all)."""

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
                mark = msgspec.structs.replace(
                    request.add,
                    op=MARK,
                    token_sequence=None,
                    track_prefill_tokens=True,
                    expected_output_tokens=None,
                    prefill_tokens=None,
                    expected_prefill_duration=None,
                )
                out.append((subject, self._encode(mark)))
        return out

    def _encode(self, message: DynamoMessage) -> bytes:
        ours = msgspec.structs.replace(
            message,
            publisher_id=self.publisher_id,
            sequence=self.sequence,
            published_at_ms=self._clock_ms(),
        )
        self.sequence += 1
        return encode_dynamo(ours)

    async def publish(self, requests: Iterable[InFlight]) -> int:
        """Send every message; returns how many. Raises the client's error if the connection
        fails before the flush."""
        sent = 0
        for subject, data in self.messages(requests):
            await self.nc.publish(subject, data)
            sent += 1
        await self.nc.flush()
        return sent
