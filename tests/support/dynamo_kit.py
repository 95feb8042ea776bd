"""Talking to a live Dynamo fleet the way its users do: HTTP streams in, gauges and NATS out.

- :class:`Stream`: one streaming ``POST /v1/completions`` on a raw asyncio connection, with the
  request id chosen by the test (``x-dynamo-request-id``, a UUID: anything else is ignored and
  Dynamo draws its own; with it, Dynamo uses it as the
  ``request_id`` of every event it publishes about the request, so a stream and its events are
  matched exactly). Closing the connection cancels the request, which Dynamo frees.
- :func:`scrape`: a frontend's ``/metrics``, parsed by prometheus_client's own parser, into the
  per-(worker, dp_rank) gauges ``dynamo_frontend_worker_active_decode_blocks`` and
  ``..._prefill_tokens``.
- :class:`Capture`: a plain NATS subscriber on the endpoint's ``active_sequences_events``
  subject, decoding every message with msgspec into the structs below. The structs forbid
  unknown fields: if a Dynamo release changes the wire, these facts fail instead of drifting.
  They are written from Dynamo's Rust sources, independently of seqstate's own decoder, so the live
  suite checks that decoder against Dynamo rather than against itself.

Prompts are made of digits only: the tiny tokenizer (projector/dynamo/tiny_model.py) learnt no
merge for a digit, so one digit is one token and a prompt of ``n`` digits is ``n`` tokens
exactly (the completions endpoint adds no BOS). :func:`block` is one 16-token block of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
from fleet import BLOCK_SIZE, EVENTS_SUBJECT, MODEL
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client.parser import text_string_to_metric_families

Rank = tuple[int, int]  # (worker_id, dp_rank)
DECODE = "dynamo_frontend_worker_active_decode_blocks"
PREFILL = "dynamo_frontend_worker_active_prefill_tokens"
# 1 for each (worker, dp_rank) the frontend's router has registered; its worker id is the label
# ``router_worker_id`` (``worker_id`` there is the frontend's own id, in hex).
REGISTERED = "dynamo_component_router_worker_registered"


def block(tag: int) -> str:
    """A 16-token block: ``tag`` as 16 decimal digits (one token each)."""
    text = f"{tag:0{BLOCK_SIZE}d}"
    assert len(text) == BLOCK_SIZE, tag
    return text


# ---- HTTP -----------------------------------------------------------------------------------


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """``GET path`` on loopback (HTTP/1.0, so the body ends with the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    return status, body


def _unchunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


async def models(port: int) -> list[str]:
    """The model ids a frontend serves (``GET /v1/models``)."""
    status, body = await http_get(port, "/v1/models")
    assert status == 200, (status, body[:200])
    return [entry["id"] for entry in json.loads(body)["data"]]


@dataclass(frozen=True)
class Gauges:
    """One frontend's view, per (worker_id, dp_rank): what its router believes is in flight.

    A rank's decode and prefill series appear only once the router has had a request on it
    (its own or a peer's): a missing series means zero. ``registered`` lists every rank the
    router knows, routed to or not."""

    decode: dict[Rank, int]
    prefill: dict[Rank, int]
    registered: frozenset[Rank]


async def scrape(port: int) -> Gauges:
    status, body = await http_get(port, "/metrics")
    assert status == 200, (status, body[:200])
    decode: dict[Rank, int] = {}
    prefill: dict[Rank, int] = {}
    registered: set[Rank] = set()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == REGISTERED and sample.value == 1:
                registered.add((int(labels["router_worker_id"]), int(labels["dp_rank"])))
            if sample.name not in (DECODE, PREFILL):
                continue
            rank = (int(labels["worker_id"]), int(labels["dp_rank"]))
            value = int(sample.value)
            assert value == sample.value, sample  # block and token counts are whole
            (decode if sample.name == DECODE else prefill)[rank] = value
    return Gauges(decode, prefill, frozenset(registered))


def nonzero(gauges: dict[Rank, int]) -> dict[Rank, int]:
    return {rank: value for rank, value in gauges.items() if value}


# ---- streams --------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streaming completion, held open until it ends or the test cuts it.

    ``finished`` is set at ``[DONE]`` or when the server closes the connection (the request
    says ``Connection: close``, so an error response without an event stream ends it too)."""

    request_id: str
    port: int
    prompt: str
    max_tokens: int
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    received: bytearray = field(default_factory=bytearray)
    cut_by_us: bool = False
    _writer: asyncio.StreamWriter | None = None
    _reader_task: asyncio.Task[None] | None = None

    @property
    def tokens(self) -> int:
        return len(self.prompt)

    async def open(self) -> Stream:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        body = json.dumps(
            {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}
        ).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            f"x-dynamo-request-id: {self.request_id}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read(reader))
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while chunk := await reader.read(65536):
                self.received += chunk
                if b"data: [DONE]" in self.received:
                    break
        except OSError:
            pass
        finally:
            self.finished.set()

    @property
    def status(self) -> int | None:
        """The response's HTTP status, once its head has arrived."""
        head, sep, _ = bytes(self.received).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]) if sep else None

    @property
    def completed(self) -> bool:
        """Did Dynamo finish the stream itself (``[DONE]``), rather than the test cutting it?"""
        return b"data: [DONE]" in self.received

    async def cut(self) -> None:
        """Close the connection mid-stream: the frontend cancels the request and frees it."""
        self.cut_by_us = True
        await self.close()

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task


async def open_streams(specs: Iterable[tuple[str, int, str, int]]) -> list[Stream]:
    """Open (request_id, port, prompt, max_tokens) streams concurrently."""
    streams = [Stream(rid, port, prompt, max_tokens) for rid, port, prompt, max_tokens in specs]
    await asyncio.gather(*(s.open() for s in streams))
    return streams


async def close_all(streams: Iterable[Stream]) -> None:
    await asyncio.gather(*(s.close() for s in streams))


# ---- the wire, decoded independently of seqstate ---------------------------------------------


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    publisher_id: int
    sequence: int
    published_at: int
    topic: str
    payload: bytes


class WorkerRef(msgspec.Struct, forbid_unknown_fields=True):
    worker_id: int
    dp_rank: int


class PrefillLoadHint(msgspec.Struct, forbid_unknown_fields=True):
    initial_effective_prefill_tokens: int
    expected_prefill_duration: object | None


class AddRequest(msgspec.Struct, forbid_unknown_fields=True):
    token_sequence: list[int] | None
    track_prefill_tokens: bool
    expected_output_tokens: int | None
    prefill_load_hint: PrefillLoadHint | None


class ActiveSequenceEvent(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    worker: WorkerRef
    data: str | dict[str, AddRequest]
    router_id: int
    lora_name: str | None


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_EVENT = msgspec.msgpack.Decoder(ActiveSequenceEvent)


@dataclass(frozen=True)
class Seen:
    """One captured message: the envelope, the event in it, its bytes as they travelled."""

    envelope: Envelope
    event: ActiveSequenceEvent
    raw: bytes

    @property
    def kind(self) -> str:
        data = self.event.data
        if isinstance(data, dict):
            (name,) = data
            return name
        return data

    @property
    def add(self) -> AddRequest:
        data = self.event.data
        assert isinstance(data, dict), self.event
        return data["AddRequest"]

    @property
    def rank(self) -> Rank:
        return (self.event.worker.worker_id, self.event.worker.dp_rank)


@dataclass
class Capture:
    """Every ``active_sequences_events`` message since :meth:`start`, decoded, in arrival order.

    A message that does not decode fails the test that reads it (``errors``): the structs above
    are the claim being checked.
    """

    nc: Client
    subject: str = EVENTS_SUBJECT
    seen: list[Seen] = field(default_factory=list)
    errors: list[tuple[bytes, str]] = field(default_factory=list)
    _sub: Subscription | None = None

    async def start(self) -> Capture:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on)
        await self.nc.flush()  # the server has the subscription before any request is sent
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on(self, msg: Msg) -> None:
        try:
            envelope = _ENVELOPE.decode(msg.data)
            event = _EVENT.decode(envelope.payload)
        except msgspec.DecodeError as exc:
            self.errors.append((msg.data, str(exc)))
            return
        self.seen.append(Seen(envelope, event, msg.data))

    def of(self, request_ids: Iterable[str]) -> list[Seen]:
        wanted = set(request_ids)
        return [s for s in self.seen if s.event.request_id in wanted]

    def kinds(self, request_id: str) -> list[str]:
        return [s.kind for s in self.seen if s.event.request_id == request_id]

    def adds(self, request_ids: Iterable[str]) -> dict[str, Seen]:
        """request id -> its first AddRequest. A second one from the same publisher fails the
        test here; one from another publisher is a republication (``seqstate dynamo
        resync``), see :meth:`republished`."""
        found: dict[str, Seen] = {}
        for s in self.of(request_ids):
            if s.kind != "AddRequest":
                continue
            first = found.setdefault(s.event.request_id, s)
            if first is not s:
                assert first.envelope.publisher_id != s.envelope.publisher_id, (
                    f"two AddRequests for {s.event.request_id} from one publisher"
                )
        return found

    def republished(self, request_ids: Iterable[str]) -> list[Seen]:
        """AddRequests of ``request_ids`` after the first one of each (another publisher's)."""
        firsts = {id(s) for s in self.adds(request_ids).values()}
        return [s for s in self.of(request_ids) if s.kind == "AddRequest" and id(s) not in firsts]

    def freed(self, request_ids: Iterable[str]) -> set[str]:
        return {s.event.request_id for s in self.of(request_ids) if s.kind == "Free"}

    def marked_by(self, request_id: str) -> set[int]:
        """The router_id of every MarkPrefillCompleted for ``request_id``."""
        return {
            s.event.router_id
            for s in self.seen
            if s.event.request_id == request_id and s.kind == "MarkPrefillCompleted"
        }

    def in_flight(self, request_ids: Iterable[str]) -> dict[str, Seen]:
        """The AddRequests of ``request_ids`` with no Free yet."""
        ids = list(request_ids)
        freed = self.freed(ids)
        return {rid: add for rid, add in self.adds(ids).items() if rid not in freed}


def unique_blocks(adds: Iterable[Seen]) -> dict[Rank, int]:
    """Per rank, the number of distinct block hashes over the requests' ``token_sequence``s:
    what a replica's decode-block gauge shows (a block shared by two requests counts once; a
    partial last block is in no ``token_sequence`` and counts nowhere)."""
    hashes: dict[Rank, set[int]] = {}
    for add in adds:
        hashes.setdefault(add.rank, set()).update(add.add.token_sequence or ())
    return {rank: len(found) for rank, found in hashes.items()}


# ---- forging: a peer's messages, in Dynamo's wire format ---------------------------------------

_ENCODER = msgspec.msgpack.Encoder()


def forge(
    request_id: str,
    rank: Rank,
    data: str | AddRequest,
    *,
    publisher_id: int,
    sequence: int,
    router_id: int,
    published_at: int = 0,
) -> bytes:
    """One ``active_sequences_events`` message as a peer replica would publish it (``data``:
    an AddRequest, or ``"MarkPrefillCompleted"`` / ``"Free"``), encoded from the structs above:
    a captured message re-encoded this way is byte-identical (test_facts.py checks it)."""
    event = ActiveSequenceEvent(
        request_id=request_id,
        worker=WorkerRef(*rank),
        data=data if isinstance(data, str) else {"AddRequest": data},
        router_id=router_id,
        lora_name=None,
    )
    envelope = Envelope(
        publisher_id=publisher_id,
        sequence=sequence,
        published_at=published_at,
        topic="active_sequences_events",
        payload=_ENCODER.encode(event),
    )
    return _ENCODER.encode(envelope)


@dataclass
class Forger:
    """A peer replica of our own on the subject: numbers its messages from 0 under one
    publisher id, names one router id (neither is any process of the fleet), and flushes
    after each, so the server has it before :meth:`send` returns."""

    nc: Client
    publisher_id: int
    router_id: int
    sequence: int = 0

    async def send(self, request_id: str, rank: Rank, data: str | AddRequest) -> None:
        raw = forge(
            request_id,
            rank,
            data,
            publisher_id=self.publisher_id,
            sequence=self.sequence,
            router_id=self.router_id,
            published_at=time.time_ns() // 1_000_000,
        )
        self.sequence += 1
        await self.nc.publish(EVENTS_SUBJECT, raw)
        await self.nc.flush()


def add_of(hashes: list[int], prefill_tokens: int | None = None) -> AddRequest:
    """An AddRequest of ``hashes`` (one per full block), as a frontend sends it."""
    hint = None if prefill_tokens is None else PrefillLoadHint(prefill_tokens, None)
    return AddRequest(
        token_sequence=hashes,
        track_prefill_tokens=True,
        expected_output_tokens=None,
        prefill_load_hint=hint,
    )
