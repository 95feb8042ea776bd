"""A publish without a coroutine, on nats-py's own connection: serve-http's hot path.

Why: ``await nc.publish(...)`` needs a task to await it; the slot tracker's hot path answers a
call from a protocol callback, where making a task per call is most of what a call costs
(BENCHMARKS.md). And nats-py encodes a header dict per message (a regular expression per key).
This appends the ``HPUB`` command nats-py would write to the same pending buffer nats-py's
flusher writes, and kicks the flusher as nats-py does. So it keeps everything the client
gives: the connection's TLS and credentials, its reconnect buffer (a publish while
reconnecting is sent after the reconnect, up to the client's ``pending_size``), its
statistics. Acks, msg-ids and what to do without them are the caller's
(:mod:`projector.http.own_fold`). Measured against ``nc.publish`` in
``benchmarks/hot_publish.py``.

The buffer is nats-py's private state, touched only in
:mod:`projector.nats.client_internals`: :func:`usable` says whether this client keeps it, and
the caller falls back to ``nc.publish`` if not.
"""

from __future__ import annotations

import re

import nats.errors
from nats.aio.client import Client

from projector.nats.client_internals import queue_command, queues_commands

_BAD = re.compile(r"[\s]")  # what would break the HPUB line: whitespace of any kind


def usable(nc: Client) -> bool:
    """Whether ``nc`` keeps the pending buffer this publishes into (nats-py 2.x)."""
    return queues_commands(nc)


def publish(nc: Client, subject: str, payload: bytes, reply: str, msg_id: str) -> None:
    """Queue ``payload`` on ``subject`` with ``Nats-Msg-Id: msg_id``, replies to ``reply``;
    written by the client's flusher on its next turn, with every other queued command. Raises
    what ``nc.publish`` raises for a closed or draining connection, a payload over the
    server's limit, or a full reconnect buffer."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not subject or _BAD.search(subject) or _BAD.search(reply):
        raise nats.errors.BadSubjectError
    if "\r" in msg_id or "\n" in msg_id:
        raise ValueError(f"a msg-id holds no line break: {msg_id!r}")
    header = b"NATS/1.0\r\nNats-Msg-Id: %b\r\n\r\n" % msg_id.encode()
    if len(header) + len(payload) > nc.max_payload:  # the server counts both
        raise nats.errors.MaxPayloadError
    command = b"HPUB %b %b %d %d\r\n%b%b\r\n" % (
        subject.encode(),
        reply.encode(),
        len(header),
        len(header) + len(payload),
        header,
        payload,
    )
    queue_command(nc, command, len(payload))
