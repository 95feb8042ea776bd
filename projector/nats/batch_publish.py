"""JetStream atomic batch publish (nats-server 2.12+): several messages stored as one, or none.

Why: a call to serve-http must be durable before it is answered, and one JetStream publish per
call, each with its own ack, is what its CPU went to (issue 23). Calls that arrive together
are stored together: every message of a batch goes out without a reply subject, and only the
last one, which commits the batch, asks for an acknowledgement. The server stores the
batch's messages contiguously, after everything before the commit and before anything after
it, or none of them.

The protocol (ADR-50): each message carries ``Nats-Batch-Id`` (at most 64 characters) and its
1-based ``Nats-Batch-Sequence``; the last one also ``Nats-Batch-Commit: 1``. The stream must
allow it (``allow_atomic``); a ``Nats-Msg-Id`` is not allowed in a batch, so a retry cannot be
deduplicated: a batch whose ack is lost is not sent again (its messages carry their batch id
and sequence in their headers, so the reader of the stream can tell whether it was stored).

One subscription per publisher receives every batch's ack, on ``<inbox>.<batch id>``: one
future per batch, nothing per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Sequence

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from seqstate.errors import SeqstateError

BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
MAX_BATCH = 1000  # messages: the server's limit per batch
MIN_SERVER = (2, 12, 0)  # atomic batch publish; older servers accept the headers and ignore them


class BatchFailed(SeqstateError, RuntimeError):
    """The server refused the batch: none of its messages is stored."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class BatchUnconfirmed(SeqstateError, TimeoutError):
    """No ack in time: the batch may or may not be stored (its headers say, in the stream)."""


class _Ack(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    batch: str = ""
    count: int = 0
    error: dict[str, object] | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


def supported(nc: Client) -> bool:
    """Whether the connected server stores batches atomically (older ones ignore the headers:
    each message would be stored alone, and the commit's ack would name no batch)."""
    version = nc.connected_server_version
    return (version.major, version.minor, version.patch) >= MIN_SERVER


class BatchPublisher:
    """``publisher = await BatchPublisher(nc).start()``; ``seq = await publisher.publish(msgs)``
    stores ``msgs`` (``(subject, payload)`` pairs) as one batch and returns the stream sequence
    of the last one (the batch occupies the ``len(msgs)`` sequences up to it)."""

    def __init__(self, nc: Client, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._prefix = f"{nc.new_inbox()}."
        self._ids = itertools.count(1)
        self._run = uuid.uuid4().hex[:20]
        self._waiting: dict[str, asyncio.Future[_Ack]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> BatchPublisher:
        self._sub = await self.nc.subscribe(f"{self._prefix}*", cb=self._on_ack)
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.cancel()
        self._waiting.clear()

    def next_id(self) -> str:
        """A batch id no other publisher uses: this publisher's run, then a counter."""
        return f"{self._run}-{next(self._ids)}"

    async def publish(self, messages: Sequence[tuple[str, bytes]], batch_id: str) -> int:
        """Store ``messages`` as batch ``batch_id`` (from :meth:`next_id`); the stream sequence
        of its last message. :class:`BatchFailed` if refused (nothing stored),
        :class:`BatchUnconfirmed` if no ack came in time (perhaps stored)."""
        count = len(messages)
        if not 0 < count <= MAX_BATCH:
            raise ValueError(f"a batch holds 1 to {MAX_BATCH} messages, not {count}")
        reply = self._prefix + batch_id
        answered: asyncio.Future[_Ack] = asyncio.get_running_loop().create_future()
        self._waiting[batch_id] = answered
        publish = self.nc.publish
        try:
            for number, (subject, payload) in enumerate(messages, 1):
                headers = {BATCH_ID: batch_id, BATCH_SEQUENCE: str(number)}
                if number == count:
                    headers[BATCH_COMMIT] = "1"
                    await publish(subject, payload, reply=reply, headers=headers)
                else:
                    await publish(subject, payload, headers=headers)
            try:
                ack = await asyncio.wait_for(answered, self.timeout_s)
            except TimeoutError:
                raise BatchUnconfirmed(
                    f"batch {batch_id} of {count} messages: no ack within {self.timeout_s:g}s"
                ) from None
        finally:
            self._waiting.pop(batch_id, None)
        if ack.error is not None:
            code = ack.error.get("err_code", 0)
            raise BatchFailed(
                f"batch {batch_id} refused: {ack.error.get('description', ack.error)}",
                code if isinstance(code, int) else 0,
            )
        if ack.batch != batch_id or ack.count != count or not ack.seq:
            # A server that ignored the headers stored the messages one by one.
            raise BatchFailed(
                f"batch {batch_id}: the server did not store it as a batch "
                f"(ack {ack.batch!r}, {ack.count} messages); nats-server 2.12+ and a stream "
                "with allow_atomic are needed"
            )
        return ack.seq

    async def _on_ack(self, msg: Msg) -> None:
        batch_id = msg.subject[len(self._prefix) :]
        waiting = self._waiting.get(batch_id)
        if waiting is None or waiting.done():
            return
        if not msg.data:  # a no-responders status: the subject has no stream
            waiting.set_exception(BatchFailed(f"batch {batch_id}: no stream took it"))
            return
        try:
            waiting.set_result(_ack_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            waiting.set_exception(BatchFailed(f"batch {batch_id}: unreadable ack ({exc})"))
