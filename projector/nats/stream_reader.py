"""The fast replay path: a reader process speaking the NATS protocol directly, feeding the fold.

nats-py turns each delivered message into a ``Msg`` with parsed headers and runs a callback
through a queue: 50-55k messages/s on these machines, the ceiling of any replay through it.
A replay needs none of that: it reads one push consumer's deliveries in order and needs, per
message, the stream sequence and nanosecond log time (both in the ``$JS.ACK`` reply subject),
the subject (the fold checks it against the event) and the payload. So a child process opens
its own connection, subscribes to the consumer's deliver subject, slices frames out of the
socket buffer, answers flow control, and writes those to a pipe in batches; the parent, on
the other core, decodes and folds. The parent owns the consumer (created once the child's
subscription is in place, deleted at the end) and falls back to the nats-py path when the
child cannot be used (an NKEY seed or a credentials file: signing the server's nonce is
nats-py's; a gap, an early exit).

The child connects as the client did: the same server, credentials (user and password, or a
token, from the URL or the ``nats_*`` settings) and TLS (whenever the client's connection is
TLS or TLS settings are given, with the same CA, client certificate and host name check). It
gets them on its stdin, never in its argv, which ``ps`` shows to every user. Every way its
connection can fail (-ERR, end of file, a handshake error, silence) ends it with a reason on
stderr: it never waits or spins.

Pipe format: ``RDY\\n`` once subscribed, then frames of a 4-byte big-endian length and a
msgpack list of ``(seq, log_time_ns, subject, payload)``; a zero length ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js import api

from projector.nats.client_internals import server_info, signs_with_keys
from projector.nats.frames import DONE, ERROR, GAP, Parser
from projector.nats.security import config_secrets, tls_context
from projector.settings.config import Config
from projector.settings.redaction import scrub
from seqstate.errors import SeqstateError

READY = b"RDY\n"
_LENGTH = struct.Struct(">I")
Batch = list[tuple[int, int, str, bytes]]  # (stream_seq, log_time_ns, subject, payload)
_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)

HANDSHAKE_S = 10.0  # connection, TLS, CONNECT and SUB: a live server answers in milliseconds
QUIET_S = 30.0  # no byte for this long, with heartbeats every second: the connection is dead
# What nats-py signs in with that the reader cannot do (nkeys, a JWT from a creds file).


class ReaderUnavailable(SeqstateError, RuntimeError):
    """The fast path cannot serve this replay; the caller folds through nats-py instead."""


class ReaderParams(msgspec.Struct, frozen=True):
    """How the child connects and what it reads; sent over its stdin, secrets included."""

    host: str
    port: int
    inbox: str
    end_seq: int
    tls: bool = False  # the client's connection is TLS (or TLS settings are given)
    handshake_first: bool = False  # TLS before the server's INFO (nats-py tls_handshake_first)
    hostname: str | None = None  # the name the server's certificate must carry
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None


# ---- the child ------------------------------------------------------------------------------


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readline()
    if not line.endswith(b"\n"):
        raise ReaderUnavailable("the server closed the connection")
    return line


def _info(line: bytes) -> dict[str, Any]:
    if not line.startswith(b"INFO "):
        raise ReaderUnavailable(f"the server sent {line[:40]!r} instead of INFO")
    info: dict[str, Any] = json.loads(line[5:])
    return info


def _connect_line(p: ReaderParams) -> bytes:
    connect: dict[str, object] = {
        "verbose": False,
        "pedantic": False,
        "headers": True,
        "no_responders": True,
        "protocol": 1,
        "name": "seqstate-replay",
    }
    if p.user is not None and p.password is not None:
        connect.update(user=p.user, **{"pass": p.password})
    elif p.token is not None:
        connect["auth_token"] = p.token
    return b"CONNECT " + json.dumps(connect).encode() + b"\r\n"


async def _handshake(p: ReaderParams) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection subscribed to ``p.inbox``, over TLS whenever the client's is."""
    hostname = p.hostname or p.host
    if p.handshake_first:
        reader, writer = await asyncio.open_connection(
            p.host,
            p.port,
            limit=1 << 22,
            ssl=tls_context(p.ca, p.cert, p.key),
            server_hostname=hostname,
        )
    else:
        reader, writer = await asyncio.open_connection(p.host, p.port, limit=1 << 22)
    info = _info(await _line(reader))
    if not p.handshake_first and (p.tls or info.get("tls_required")):
        if not (info.get("tls_required") or info.get("tls_available")):
            raise ReaderUnavailable("the client speaks TLS but the server offers none")
        await writer.start_tls(tls_context(p.ca, p.cert, p.key), server_hostname=hostname)
    writer.write(_connect_line(p) + b"PING\r\n" + f"SUB {p.inbox} 1\r\n".encode() + b"PING\r\n")
    await writer.drain()
    pongs = 0
    while pongs < 2:  # the server has processed CONNECT and SUB
        line = await _line(reader)
        if line.startswith(b"-ERR"):
            raise ReaderUnavailable(f"the server refused the reader: {line.decode().strip()}")
        pongs += line.startswith(b"PONG")
    return reader, writer


async def _read(p: ReaderParams, out: Callable[[bytes], None]) -> None:
    async with asyncio.timeout(HANDSHAKE_S):
        reader, writer = await _handshake(p)
    out(READY)
    parser = Parser(p.end_seq)
    buf = b""
    async with asyncio.timeout(QUIET_S) as quiet:
        while True:
            chunk = await reader.read(1 << 20)
            if not chunk:
                raise ReaderUnavailable("the server closed the connection")
            quiet.reschedule(asyncio.get_running_loop().time() + QUIET_S)
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


def main() -> int:
    """Read :class:`ReaderParams` from stdin, then stream; any failure is one line on stderr."""
    stdout = sys.stdout.buffer

    def out(data: bytes) -> None:
        stdout.write(data)
        stdout.flush()

    try:
        params = msgspec.json.decode(sys.stdin.buffer.readline(), type=ReaderParams)
        asyncio.run(_read(params, out))
    except msgspec.DecodeError as exc:
        print(f"stream reader: no settings on stdin ({exc})", file=sys.stderr)
        return 3
    except TimeoutError:
        print("stream reader: the server did not answer in time", file=sys.stderr)
        return 3
    except (SeqstateError, OSError) as exc:
        print(f"stream reader: {exc or type(exc).__name__}", file=sys.stderr)
        return 3
    return 0


# ---- the parent -----------------------------------------------------------------------------


def _credentials(nc: Client) -> tuple[str | None, str | None, str | None]:
    """``(user, password, token)`` as nats-py sends them: its options first, then the URL."""
    options = nc.options
    user, password, token = (options.get(k) for k in ("user", "password", "token"))
    user, password, token = (v() if callable(v) else v for v in (user, password, token))
    if user is not None and password is not None:
        return user, password, None
    if token is not None:
        return None, None, token
    url = nc.connected_url
    if url is None or url.username is None:
        return None, None, None
    if url.password is None:
        return None, None, url.username
    return url.username, url.password, None


def reader_params(nc: Client, config: Config, inbox: str, end_seq: int) -> ReaderParams | str:
    """How the child connects as ``nc`` did, or why it cannot."""
    url = nc.connected_url
    if url is None:
        return "the client is not connected"
    if url.scheme not in ("nats", "tls", ""):
        return f"the fast path speaks nats:// and tls://, not {url.scheme}://"
    if signs_with_keys(nc):
        return "the client signs in with nkeys or a credentials file; the reader cannot"
    user, password, token = _credentials(nc)
    info = server_info(nc)
    tls = (
        url.scheme == "tls"
        or bool(info.get("tls_required"))
        or config.tls_ca is not None
        or config.tls_cert is not None
    )
    return ReaderParams(
        host=url.hostname or "127.0.0.1",
        port=url.port or 4222,
        inbox=inbox,
        end_seq=end_seq,
        tls=tls,
        handshake_first=bool(nc.options.get("tls_handshake_first")),
        hostname=nc.options.get("tls_hostname") or url.hostname,
        ca=config.tls_ca,
        cert=config.tls_cert,
        key=config.tls_key,
        user=user,
        password=password,
        token=token,
    )


def reader_argv() -> list[str]:
    """The child's command line: no URL and no secret, since ``ps`` shows it to everyone."""
    return [sys.executable, "-m", "projector.nats.stream_reader"]


@dataclass
class Reader:
    """A reader process started ahead of its fold: its interpreter starts (a tenth of a second
    and more) while the caller does other work, such as restoring the snapshot the fold goes
    on from. It waits for its settings on stdin, which :func:`fast_fold` sends."""

    proc: asyncio.subprocess.Process
    params: ReaderParams

    async def discard(self) -> None:
        """End it unused."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


async def start_reader(nc: Client, config: Config, end_seq: int) -> Reader | str:
    """A reader process for events up to ``end_seq``, or why the fast path cannot be used."""
    inbox = nc.new_inbox()  # under the client's own prefix: its role may read only there
    params = reader_params(nc, config, inbox, end_seq)
    if isinstance(params, str):
        return params
    proc = await asyncio.create_subprocess_exec(
        *reader_argv(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=1 << 22,
    )
    return Reader(proc, params)


async def fast_fold(
    nc: Client,
    config: Config,
    fold: Callable[[Batch], bool],
    *,
    start_seq: int,
    end_seq: int,
    reader: Reader | str | None = None,
) -> tuple[int, str | None]:
    """Feed ``fold`` batches of ``(seq, log_time_ns, subject, payload)``, ``start_seq..end_seq``
    in order, through ``reader`` (:func:`start_reader`'s, for ``end_seq``; None: one started
    now). It ends the reader.

    ``fold`` returns False to stop early. Returns the last sequence fed and, if the fast path
    gave up before the end, why: the events fed stand, and the caller continues after them.
    """
    if reader is None:
        reader = await start_reader(nc, config, end_seq)
    if isinstance(reader, str):
        return start_seq - 1, reader
    proc, params, inbox = reader.proc, reader.params, reader.params.inbox
    if params.end_seq != end_seq:
        await reader.discard()
        raise ValueError(f"a reader started for event {params.end_seq}, not {end_seq}")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    js = nc.jetstream()
    consumer: str | None = None
    last = start_seq - 1
    # The child bounds its own waits; this bounds the parent's should the child misbehave.
    bound = asyncio.timeout(2 * HANDSHAKE_S)
    try:
        async with bound:
            proc.stdin.write(msgspec.json.encode(params) + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
            if await proc.stdout.readexactly(len(READY)) != READY:
                raise ReaderUnavailable("the reader did not start")
            info = await js.add_consumer(
                config.events_stream,
                api.ConsumerConfig(
                    deliver_subject=inbox,
                    filter_subject=config.events_subjects,
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=start_seq,
                    ack_policy=api.AckPolicy.NONE,
                    flow_control=True,
                    idle_heartbeat=1.0,
                    mem_storage=True,
                    max_deliver=1,
                    num_replicas=1,
                    inactive_threshold=30.0,
                ),
            )
            consumer = info.name
            while True:
                bound.reschedule(asyncio.get_running_loop().time() + 2 * QUIET_S)
                (length,) = _LENGTH.unpack(await proc.stdout.readexactly(4))
                if length == 0:
                    return last, None
                batch = _batch_decoder.decode(await proc.stdout.readexactly(length))
                if batch:
                    last = batch[-1][0]
                    if not fold(batch):
                        return last, None
    except TimeoutError:
        if not bound.expired():
            raise  # the client's own timeout (add_consumer): not the reader's to hide
        return last, "the reader went silent"
    except (asyncio.IncompleteReadError, ConnectionError, ReaderUnavailable) as exc:
        err = (await proc.stderr.read()).decode(errors="replace").strip()
        why = err or str(exc) or "the reader stopped early"
        url = nc.connected_url.geturl() if nc.connected_url else ""
        return last, scrub(why, url, config_secrets(config))
    finally:
        await reader.discard()
        if consumer is not None:
            with contextlib.suppress(Exception):
                await js.delete_consumer(config.events_stream, consumer)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
