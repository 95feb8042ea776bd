"""The fast replay path: a reader process speaking the NATS protocol directly, feeding the fold.

nats-py turns each delivered message into a ``Msg`` with parsed headers and runs a callback
through a queue: 50-55k messages/s on these machines, the ceiling of any replay through it.
A replay needs none of that: it reads one push consumer's deliveries in order and needs, per
message, the stream sequence and nanosecond log time (both in the ``$JS.ACK`` reply subject)
and the payload. So a child process opens its own connection, subscribes to the consumer's
deliver subject, slices frames out of the socket buffer, answers flow control, and writes the
triples to a pipe in batches; the parent, on the other core, decodes and folds. The parent owns
the consumer (created once the child's subscription is in place, deleted at the end) and falls
back to the nats-py path when the child cannot be used (TLS, a gap, an early exit).

Pipe format: ``RDY\\n`` once subscribed, then frames of a 4-byte big-endian length and a
msgpack list of ``(seq, log_time_ns, payload)``; a zero length ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec
from nats.aio.client import Client
from nats.js import api

from projector.config import Config
from projector.frames import DONE, ERROR, GAP, Parser
from seqstate.errors import SeqstateError

READY = b"RDY\n"
_LENGTH = struct.Struct(">I")
Batch = list[tuple[int, int, bytes]]
_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)


class ReaderUnavailable(SeqstateError, RuntimeError):
    """The fast path cannot serve this replay; the caller folds through nats-py instead."""


# ---- the child ------------------------------------------------------------------------------


async def _read(url: str, inbox: str, end_seq: int, out: Callable[[bytes], None]) -> None:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname or "127.0.0.1",
                                                   parts.port or 4222, limit=1 << 22)  # fmt: skip
    await reader.readline()  # INFO
    connect: dict[str, object] = {"verbose": False, "pedantic": False, "headers": True,
                                  "no_responders": True, "protocol": 1,
                                  "name": "seqstate-replay"}  # fmt: skip
    if parts.username and parts.password is not None:
        connect.update(user=parts.username, **{"pass": parts.password})
    elif parts.username:
        connect["auth_token"] = parts.username
    writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
    writer.write(f"SUB {inbox} 1\r\n".encode() + b"PING\r\n")
    await writer.drain()
    pongs = 0
    while pongs < 2:  # the server has processed CONNECT and SUB
        line = await reader.readline()
        if line.startswith(b"-ERR"):
            raise ReaderUnavailable(line.decode().strip())
        pongs += line.startswith(b"PONG")
    out(READY)
    parser = Parser(end_seq)
    buf = b""
    while True:
        chunk = await reader.read(1 << 20)
        if not chunk:
            raise ReaderUnavailable("the server closed the connection")
        buf = buf + chunk if buf else chunk
        batch: Batch = []
        replies: list[bytes] = []
        status, pos = parser.parse(buf, 0, batch, replies)
        if status == ERROR:
            raise ReaderUnavailable(replies[-1].decode(errors="replace"))
        if replies:
            writer.write(b"".join(replies))
        if batch:
            payload = _batch_encoder.encode(batch)
            out(_LENGTH.pack(len(payload)) + payload)
        if status == GAP:
            raise ReaderUnavailable(f"delivery gap after consumer sequence {parser.last_cseq}")
        if status == DONE:
            out(_LENGTH.pack(0))
            writer.close()
            return
        buf = buf[pos:]


def main(argv: list[str] | None = None) -> int:
    url, inbox, end_seq = (argv or sys.argv[1:])[:3]
    stdout = sys.stdout.buffer

    def out(data: bytes) -> None:
        stdout.write(data)
        stdout.flush()

    try:
        asyncio.run(_read(url, inbox, int(end_seq), out))
    except (ReaderUnavailable, OSError) as exc:
        print(f"stream reader: {exc}", file=sys.stderr)
        return 3
    return 0


# ---- the parent -----------------------------------------------------------------------------


async def fast_fold(
    nc: Client,
    config: Config,
    fold: Callable[[Batch], bool],
    *,
    start_seq: int,
    end_seq: int,
) -> tuple[int, str | None]:
    """Feed ``fold`` batches of ``(seq, log_time_ns, payload)``, ``start_seq..end_seq`` in order.

    ``fold`` returns False to stop early. Returns the last sequence fed and, if the fast path
    gave up before the end, why: the events fed stand, and the caller continues after them.
    """
    url = nc.connected_url
    if url is None or url.scheme not in ("nats", ""):
        return start_seq - 1, "the fast path speaks plain nats:// only"
    inbox = f"_INBOX.seqstate-replay.{os.getpid()}.{id(fold)}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projector.stream_reader", url.geturl(), inbox, str(end_seq),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=1 << 22,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    js = nc.jetstream()
    consumer: str | None = None
    last = start_seq - 1
    try:
        if await proc.stdout.readexactly(len(READY)) != READY:
            raise ReaderUnavailable("the reader did not start")
        info = await js.add_consumer(config.events_stream, api.ConsumerConfig(
            deliver_subject=inbox, filter_subject=config.events_subjects,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            ack_policy=api.AckPolicy.NONE, flow_control=True, idle_heartbeat=1.0,
            mem_storage=True, max_deliver=1, num_replicas=1, inactive_threshold=30.0,
        ))  # fmt: skip
        consumer = info.name
        while True:
            (length,) = _LENGTH.unpack(await proc.stdout.readexactly(4))
            if length == 0:
                return last, None
            batch = _batch_decoder.decode(await proc.stdout.readexactly(length))
            if batch:
                last = batch[-1][0]
                if not fold(batch):
                    return last, None
    except (asyncio.IncompleteReadError, ReaderUnavailable) as exc:
        err = (await proc.stderr.read()).decode().strip()
        return last, err or str(exc) or "the reader stopped early"
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()
        if consumer is not None:
            with contextlib.suppress(Exception):
                await js.delete_consumer(config.events_stream, consumer)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
