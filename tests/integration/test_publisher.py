"""RouterPublisher against a real nats-server: sequences, msg-ids, dedup, retries, pipelining,
and the batch path ``publish_many``.

The server is shared by the module, so every test gets its own namespace and stream.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from eventually import eventually
from msgspec.structs import replace
from nats.aio.client import Client
from nats.aio.msg import Msg

from projector.nats.server import NatsServer
from projector.route.publisher import (
    MSG_ID_HEADER,
    EventTooLarge,
    PublishError,
    RouterPublisher,
)
from projector.settings.config import Config
from projector.wire.sizes import event_limit
from seqstate import (
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    Tick,
    WorkerAdded,
    decode_event,
)


def _unique_config() -> Config:
    tag = uuid.uuid4().hex[:12]
    return Config(namespace=f"t{tag}", events_stream=f"EVENTS_{tag}")


@pytest.fixture
async def config(nc: Client) -> AsyncIterator[Config]:
    cfg = _unique_config()
    js = nc.jetstream()
    await js.add_stream(
        name=cfg.events_stream,
        # events_subjects ("<ns>.>") already covers the control subject; listing both is
        # rejected by nats-server 2.15 as overlapping subjects.
        subjects=[cfg.events_subjects],
        duplicate_window=120,
    )
    try:
        yield cfg
    finally:
        await js.delete_stream(cfg.events_stream)


def bare(msg_id: str) -> str:
    """A router's msg-id without its tag: ``<router_id>:<n>``."""
    head, n, tag = msg_id.rsplit(":", 2)
    assert len(tag) == 16 and int(tag, 16) >= 0, msg_id
    return f"{head}:{n}"


async def _stored(nc: Client, config: Config, seq: int) -> tuple[str, Any, dict[str, str]]:
    msg = await nc.jetstream().get_msg(config.events_stream, seq)
    assert msg.data is not None and msg.subject is not None
    return msg.subject, decode_event(msg.data), dict(msg.headers or {})


async def _stream_messages(nc: Client, config: Config) -> int:
    info = await nc.jetstream().stream_info(config.events_stream)
    return info.state.messages


async def test_lifecycle_is_stored_in_order_with_router_id_and_msg_ids(
    nc: Client, config: Config
) -> None:
    pub = RouterPublisher(nc, router_id="r1", config=config)
    s1 = await pub.add(
        "req-1",
        7,
        dp_rank=2,
        block_hashes=(1, 2, 2**64 - 1),
        prefill_tokens=100,
        expected_prefill_ms=12.5,
        expected_output_tokens=64,
        lora_name="lora-a",
    )
    s2 = await pub.mark_prefill_completed("req-1", 7, dp_rank=2)
    s3 = await pub.free("req-1", 7, dp_rank=2)
    assert s1 < s2 < s3

    expected = [
        AddRequest(
            request_id="req-1",
            worker_id=7,
            dp_rank=2,
            block_hashes=[1, 2, 2**64 - 1],
            prefill_tokens=100,
            expected_prefill_ms=12.5,
            expected_output_tokens=64,
            router_id="r1",
            lora_name="lora-a",
        ),
        MarkPrefillCompleted(request_id="req-1", worker_id=7, dp_rank=2, router_id="r1"),
        Free(request_id="req-1", worker_id=7, dp_rank=2, router_id="r1"),
    ]
    for n, (seq, event) in enumerate(zip([s1, s2, s3], expected, strict=True), start=1):
        subject, stored, headers = await _stored(nc, config, seq)
        assert stored == event
        assert subject == config.event_subject(7, 2)
        assert bare(headers[MSG_ID_HEADER]) == f"r1:{n}"
    assert await _stream_messages(nc, config) == 3
    assert await pub.flush() == s3


async def test_control_events_go_to_the_control_subject(nc: Client, config: Config) -> None:
    pub = RouterPublisher(nc, router_id="ctl", config=config)
    s1 = await pub.publish(WorkerAdded(worker_id=3, dp_size=2))
    s2 = await pub.publish(Tick())
    s3 = await pub.publish(Free(request_id="x", worker_id=3, dp_rank=1))  # router_id filled in
    for seq, event in [(s1, WorkerAdded(worker_id=3, dp_size=2)), (s2, Tick())]:
        subject, stored, _ = await _stored(nc, config, seq)
        assert (subject, stored) == (config.control_subject, event)
    subject, stored, headers = await _stored(nc, config, s3)
    assert subject == config.event_subject(3, 1)
    assert stored == Free(request_id="x", worker_id=3, dp_rank=1, router_id="ctl")
    assert bare(headers[MSG_ID_HEADER]) == "ctl:3"


async def test_a_routers_heartbeat_and_goodbye_go_to_the_routers_subject(
    nc: Client, config: Config
) -> None:
    """A router's own lifecycle names no worker but is the router's: ``<ns>.routers``, so the
    router role never needs the operator's control subject (deploy/nats_roles.py)."""
    pub = RouterPublisher(nc, router_id="rt", config=config, heartbeat_every_s=3600)
    await pub.start()
    await pub.close()
    beat, goodbye = pub.last_sequence - 1, pub.last_sequence  # type: ignore[operator]
    assert (await _stored(nc, config, beat))[:2] == (
        config.router_subject,
        RouterHeartbeat(router_id="rt"),
    )
    assert (await _stored(nc, config, goodbye))[:2] == (
        config.router_subject,
        RouterGoodbye(router_id="rt"),
    )
    assert config.router_subject == f"seqstate.events.{config.namespace}.routers"


async def test_same_msg_id_twice_is_stored_once(nc: Client, config: Config) -> None:
    js = nc.jetstream()
    subject = config.event_subject(1, 0)
    first = await js.publish(subject, b"a", headers={MSG_ID_HEADER: "r:1"})
    again = await js.publish(subject, b"a", headers={MSG_ID_HEADER: "r:1"})
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert await _stream_messages(nc, config) == 1


async def test_lost_ack_is_retried_with_the_same_msg_id_and_stored_once(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = RouterPublisher(nc, router_id="lossy", config=config, timeout=0.3)
    real = nc.publish
    calls: list[dict[str, str]] = []

    async def lose_first_ack(subject: str, payload: bytes = b"", **kw: Any) -> None:
        if (kw.get("headers") or {}).get(MSG_ID_HEADER) is not None:
            calls.append(dict(kw["headers"]))
            if len(calls) == 1:  # the server stores it; its ack goes to nobody
                kw["reply"] = nc.new_inbox()
        await real(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", lose_first_ack)
    seq = await pub.add("req-lost", 1)
    assert [bare(c[MSG_ID_HEADER]) for c in calls] == ["lossy:1", "lossy:1"]
    assert await _stream_messages(nc, config) == 1
    _, stored, _ = await _stored(nc, config, seq)
    assert stored == AddRequest(request_id="req-lost", worker_id=1, router_id="lossy")
    assert pub.pending == 0 and pub.in_flight == 0


async def test_the_default_retries_outlast_a_stream_missing_for_seconds(nc: Client) -> None:
    """The defaults backed off about 0.35 s in all, while an R3 leader election
    leaves a stream without a leader ("no responders") for 4-9 s. Broke: published with the
    defaults to a stream that only appears 3 s later (what an election looks like to a
    publisher). Expected: stored, once; and with ``retries`` capped, the same raises."""
    config = _unique_config()
    js = nc.jetstream()
    capped = RouterPublisher(nc, router_id="capped", config=config, retries=3)
    with pytest.raises(PublishError, match="4 attempt"):
        await capped.publish(Free(request_id="r0", worker_id=1))
    pub = RouterPublisher(nc, router_id="rides", config=config)
    assert pub.retries is None and pub.retry_for_s == 15.0

    async def appears() -> None:
        await asyncio.sleep(3.0)  # the outage being ridden out, not a wait for a result
        await js.add_stream(name=config.events_stream, subjects=[config.events_subjects])

    try:
        seqs, _ = await asyncio.gather(
            pub.publish_many([Free(request_id=f"r{i}", worker_id=1) for i in range(3)]),
            appears(),
        )
        assert seqs == [1, 2, 3]
        assert (await js.stream_info(config.events_stream)).state.messages == 3
    finally:
        await js.delete_stream(config.events_stream)


async def test_no_stream_raises_publish_error_after_retries(nc: Client) -> None:
    config = _unique_config()  # no stream captures its subjects
    pub = RouterPublisher(nc, router_id="lost", config=config, retries=2, timeout=0.5)
    with pytest.raises(PublishError) as raised:
        await pub.add("req-nowhere", 4)
    message = str(raised.value)
    assert "req-nowhere" in message and "lost:1" in message and "3 attempt" in message
    assert bare(raised.value.msg_id) == "lost:1" and raised.value.request_id == "req-nowhere"
    assert pub.pending == 0 and await pub.flush() is None


async def test_ack_timeout_retries_same_msg_id_then_raises(nc: Client) -> None:
    config = _unique_config()
    seen: list[str] = []

    async def silent(msg: Msg) -> None:  # a responder that never acks
        seen.append(bare((msg.headers or {})[MSG_ID_HEADER]))

    sub = await nc.subscribe(config.event_subject(5, 0), cb=silent)
    try:
        pub = RouterPublisher(nc, router_id="mute", config=config, retries=1, timeout=0.2)
        with pytest.raises(PublishError, match=r"req-mute.*mute:1.*ack timed out"):
            await pub.add("req-mute", 5)
        await nc.flush()
        assert seen == ["mute:1", "mute:1"]
        assert pub.pending == 0
    finally:
        await sub.unsubscribe()


async def test_a_restarted_router_may_reuse_its_id(nc: Client, config: Config) -> None:
    """Each publisher draws its own tag: a router restarted under its id stores its events
    under msg-ids of its own, none deduplicated away."""
    first = RouterPublisher(nc, router_id="again", config=config)
    await first.add("a", 1)
    restarted = RouterPublisher(nc, router_id="again", config=config)
    await restarted.add("b", 1)
    ids = [(await _stored(nc, config, seq))[2][MSG_ID_HEADER] for seq in (1, 2)]
    assert [bare(i) for i in ids] == ["again:1", "again:1"] and ids[0] != ids[1]
    assert first.msg_id(1) == ids[0] and restarted.msg_id(1) == ids[1]


async def test_reused_router_id_is_not_silently_deduplicated(nc: Client, config: Config) -> None:
    """With one key (``seqstate publish``'s, the events stream's), a second publisher of a
    router id meets the first one's msg-ids: refused, never passed as stored."""
    first = RouterPublisher(nc, router_id="dup", config=config, msg_id_key="k")
    await first.add("a", 1)
    restarted = RouterPublisher(nc, router_id="dup", config=config, msg_id_key="k")
    with pytest.raises(PublishError, match=r"'b'.*dup:1:.*already used") as raised:
        await restarted.add("b", 1)
    assert raised.value.taken_at == 1 and not raised.value.squatted
    assert await _stream_messages(nc, config) == 1


async def test_invalid_event_is_rejected_before_publishing(nc: Client, config: Config) -> None:
    pub = RouterPublisher(nc, router_id="v", config=config)
    with pytest.raises(EventDecodeError, match="request_id"):
        await pub.add("", 1)
    with pytest.raises(EventDecodeError, match="expected_prefill_ms"):
        await pub.add("r", 1, expected_prefill_ms=-1.0)
    assert pub.router_seq == 0
    assert await pub.add("r", 1) == 1
    assert bare((await _stored(nc, config, 1))[2][MSG_ID_HEADER]) == "v:1"


ROUTER_IDS = {  # id -> its msg-ids' prefix
    "r": "r",
    " r": "%20r",
    "r ": "r%20",
    "%20r": "%2520r",
    "a b": "a%20b",
    "a\nb": "a%0Ab",
    "a\r\nb": "a%0D%0Ab",
    "\t": "%09",
    "x\x00y\x7f": "x%00y%7F",
    "é路由🙂": "%C3%A9%E8%B7%AF%E7%94%B1%F0%9F%99%82",
    "a.*.>": "a.*.>",
    "*": "*",
    ">": ">",
    "r" * 256: "r" * 256,
}


async def test_router_ids_of_any_alphabet_publish_with_msg_ids_of_their_own(
    nc: Client, config: Config
) -> None:
    """Broke: nats-py trims a header value and turns its CR and LF into spaces, so the router
    ids " r" and "r", or "a\\nb" and "a b", published under the same msg-ids: every event of
    the second router was refused as a duplicate (PublishError, a message broken over lines),
    or lost had it met the other's on a retry. A 257-character id published adds and then
    failed at its first heartbeat. Expected: ids of 1 to 256 characters of any alphabet
    publish, one after another and in a batch, under msg-ids of their own (printable ASCII
    kept, anything else and "%" percent-encoded) and arrive exact in the events; an empty id,
    a 257-character one and one that is not UTF-8 are refused when the publisher is made, each
    with one line."""
    for rid, prefix in ROUTER_IDS.items():
        pub = RouterPublisher(nc, router_id=rid, config=config)
        seqs = [await pub.publish(RouterHeartbeat(router_id=rid))]
        seqs += await pub.publish_many([AddRequest(request_id="q", worker_id=1)])
        stored = [await _stored(nc, config, seq) for seq in seqs]
        assert [event for _, event, _ in stored] == [
            RouterHeartbeat(router_id=rid),
            AddRequest(request_id="q", worker_id=1, router_id=rid),
        ]
        assert [bare(headers[MSG_ID_HEADER]) for _, _, headers in stored] == [
            f"{prefix}:1",
            f"{prefix}:2",
        ]
    assert await _stream_messages(nc, config) == 2 * len(ROUTER_IDS)
    too_long = f"router_id {'r' * 60!r}… (257 characters): at most 256 characters"
    refused = {
        "": "router_id must not be empty",
        "r" * 257: f"{too_long} (what a RouterHeartbeat carries)",
        "r\ud800": "router_id 'r\\ud800': not encodable as UTF-8",
    }
    for rid, message in refused.items():
        with pytest.raises(ValueError) as info:
            RouterPublisher(nc, router_id=rid, config=config)
        assert str(info.value) == message


async def test_request_ids_of_any_alphabet_are_published_up_to_the_size_limit(
    nc: Client, config: Config
) -> None:
    """Broke: an id too long for an event was echoed whole in the EventTooLarge message (a
    megabyte on one line). Expected: request ids of any alphabet (NATS wildcards and dots,
    controls, spaces, non-ASCII, one character, and as long as an event may be) are stored
    exact; one character longer is refused before it is sent, with one line that shows 60
    characters of the id and its length, and takes no router_seq."""
    pub = RouterPublisher(nc, router_id="ids", config=config)
    limit = event_limit(nc.max_payload, config.max_event_bytes)
    overhead = len(pub.check(AddRequest(request_id="x" * 70_000, worker_id=1))[1]) - 70_000
    longest = "x" * (limit - overhead)
    assert len(pub.check(AddRequest(request_id=longest, worker_id=1))[1]) == limit
    ids = ["*", ">", "a.b", "a.*.>", "\x00\r\n\t", " ", "é路由🙂", "x", longest]
    seqs = [await pub.add(rid, 1) for rid in ids]
    assert [(await _stored(nc, config, seq))[1].request_id for seq in seqs] == ids
    with pytest.raises(EventTooLarge) as info:
        await pub.add(longest + "x", 1)
    assert str(info.value) == (
        f"AddRequest for request {'x' * 60!r}… ({len(longest) + 1:,} characters): {limit + 1:,} "
        f"bytes encoded, over the {limit:,} bytes one event may take (the server's max_payload "
        f"of {nc.max_payload:,} less 5,120 for its delta); it was not sent"
    )
    assert pub.router_seq == len(ids)
    assert await _stream_messages(nc, config) == len(ids)


async def test_thousand_concurrent_adds_are_bounded_distinct_and_flushed(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = RouterPublisher(nc, router_id="bulk", config=config, max_pending=64)
    real = nc.publish
    peak = 0

    async def counting(subject: str, payload: bytes = b"", **kw: Any) -> None:
        nonlocal peak
        if (kw.get("headers") or {}).get(MSG_ID_HEADER) is not None:
            peak = max(peak, len(pub._awaiting), pub.in_flight)
        await real(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", counting)
    tasks = [
        asyncio.create_task(pub.add(f"req-{i}", i % 8, block_hashes=range(i % 16)))
        for i in range(1000)
    ]
    await asyncio.sleep(0)  # one loop pass: every task has entered publish (no I/O awaited yet)
    assert pub.pending == 1000
    last = await pub.flush()
    assert all(t.done() for t in tasks)
    seqs = [t.result() for t in tasks]
    assert len(set(seqs)) == 1000
    assert last == max(seqs) == pub.last_sequence
    assert 1 < peak <= 64 and pub.peak_in_flight == peak
    assert await _stream_messages(nc, config) == 1000
    assert pub.router_seq == 1000 and pub.pending == 0
    assert (pub.in_flight, pub.waiting) == (0, 0)

    more = await asyncio.gather(*(pub.free(f"req-{i}", i % 8) for i in range(10)))
    assert len(set(more)) == 10 and min(more) > last
    assert await pub.flush() == max(more)


# ---- publish_many: the batch path -----------------------------------------------------------


def _adds(count: int, *, start: int = 0, worker: int | None = None) -> list[AddRequest]:
    return [
        AddRequest(
            request_id=f"req-{n}",
            worker_id=n % 4 if worker is None else worker,
            block_hashes=[n, n + 1],
            prefill_tokens=n,
        )
        for n in range(start, start + count)
    ]


def _record_sends(nc: Client, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(subject, msg-id) of every message with a msg-id ``nc`` publishes from now on."""
    sent: list[tuple[str, str]] = []
    real = nc.publish

    async def recording(subject: str, payload: bytes = b"", **kw: Any) -> None:
        msg_id = (kw.get("headers") or {}).get(MSG_ID_HEADER)
        if msg_id is not None:
            sent.append((subject, bare(msg_id)))
        await real(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", recording)
    return sent


async def _stream_order(nc: Client, config: Config, count: int) -> list[tuple[str, Any, str]]:
    """(subject, event, msg-id) of the stream's first ``count`` messages, in stream order."""
    first = (await nc.jetstream().stream_info(config.events_stream)).state.first_seq
    stored = [await _stored(nc, config, seq) for seq in range(first, first + count)]
    return [(subject, event, bare(headers[MSG_ID_HEADER])) for subject, event, headers in stored]


async def test_publish_many_stores_a_call_in_order_with_consecutive_msg_ids(
    nc: Client, config: Config
) -> None:
    pub = RouterPublisher(nc, router_id="b1", config=config)
    before = await pub.add("req-before", 1)
    events = [
        AddRequest(request_id="a", worker_id=3, dp_rank=1, block_hashes=[1, 2], router_id="x"),
        WorkerAdded(worker_id=9, dp_size=2),
        MarkPrefillCompleted(request_id="a", worker_id=3, dp_rank=1),
        Tick(),
        *_adds(40),
        Free(request_id="a", worker_id=3, dp_rank=1),
    ]
    seqs = await pub.publish_many(iter(events))  # any iterable
    assert len(seqs) == len(events)
    assert before < seqs[0] and all(a < b for a, b in itertools.pairwise(seqs))
    assert pub.router_seq == 1 + len(events) and pub.last_sequence == seqs[-1]

    stored = await _stream_order(nc, config, 1 + len(events))
    assert [event for _, event, _ in stored[1:]] == [
        e if isinstance(e, WorkerAdded | Tick) or e.router_id else replace(e, router_id="b1")
        for e in events
    ]
    assert [msg_id for _, _, msg_id in stored] == [f"b1:{n}" for n in range(1, len(events) + 2)]
    assert [subject for subject, _, _ in stored[1:5]] == [
        config.event_subject(3, 1),
        config.control_subject,
        config.event_subject(3, 1),
        config.control_subject,
    ]
    for seq, (subject, event, _) in zip(seqs, stored[1:], strict=True):
        assert (await _stored(nc, config, seq))[:2] == (subject, event)

    more = await pub.publish_many(_adds(3, start=100))  # msg-ids count on
    assert min(more) > seqs[-1]
    assert [bare((await _stored(nc, config, s))[2][MSG_ID_HEADER]) for s in more] == [
        f"b1:{n}" for n in range(len(events) + 2, len(events) + 5)
    ]
    assert pub.pending == 0 and await pub.flush() == more[-1]


async def test_publish_many_of_nothing_returns_an_empty_list(nc: Client, config: Config) -> None:
    pub = RouterPublisher(nc, router_id="none", config=config)
    assert await pub.publish_many([]) == []
    assert await pub.publish_many(e for e in ()) == []
    assert pub.router_seq == 0 and pub.last_sequence is None and pub.pending == 0
    assert await _stream_messages(nc, config) == 0


async def test_publish_many_checks_every_event_before_sending_any(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = RouterPublisher(nc, router_id="chk", config=config)
    sent = _record_sends(nc, monkeypatch)
    hashes = list(range(2**62, 2**62 + 120_000))  # 9 bytes each: about 1.08 MB
    huge = AddRequest(request_id="huge", worker_id=1, block_hashes=hashes)
    with pytest.raises(EventTooLarge, match=r"AddRequest for request 'huge': .* it was not sent"):
        await pub.publish_many([*_adds(5), huge, *_adds(5, start=5)])
    with pytest.raises(EventDecodeError, match="request_id"):
        await pub.publish_many([*_adds(2), AddRequest(request_id="", worker_id=1)])
    assert sent == [] and pub.router_seq == 0
    assert await _stream_messages(nc, config) == 0

    seqs = await pub.publish_many(_adds(2))  # nothing was spent: the msg-ids start at 1
    assert [msg_id for _, msg_id in sent] == ["chk:1", "chk:2"]
    assert [bare((await _stored(nc, config, s))[2][MSG_ID_HEADER]) for s in seqs] == [
        "chk:1",
        "chk:2",
    ]


async def test_publish_many_retries_a_lost_ack_with_its_msg_id_and_stores_it_once(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = RouterPublisher(nc, router_id="lossy", config=config, timeout=0.3)
    sent = _record_sends(nc, monkeypatch)
    real = pub._on_ack
    dropped: list[str] = []

    async def drop_one_ack(msg: Msg) -> None:
        token = int(msg.subject.rsplit(".", 1)[1])
        _, index = pub._awaiting[token]
        if index == 1 and not dropped:  # the server stored event 1; the router never hears so
            dropped.append(msg.subject)
            return
        await real(msg)

    monkeypatch.setattr(pub, "_on_ack", drop_one_ack)  # before the reply subscription exists
    events = _adds(4)
    seqs = await pub.publish_many(events)
    assert len(dropped) == 1
    assert [msg_id for _, msg_id in sent] == ["lossy:1", "lossy:2", "lossy:3", "lossy:4", "lossy:2"]
    assert await _stream_messages(nc, config) == 4  # the repeat was deduplicated...
    assert all(a < b for a, b in itertools.pairwise(seqs))  # ...and kept its first place
    stored = await _stream_order(nc, config, 4)
    assert [event for _, event, _ in stored] == [replace(e, router_id="lossy") for e in events]
    assert pub.pending == 0 and not pub._awaiting


async def test_publish_many_a_retried_event_lands_after_later_ones_and_says_so(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented order: an event not stored at its first attempt is stored at its retry,
    after the events of the call already stored; the sequences returned say where."""
    pub = RouterPublisher(nc, router_id="late", config=config)
    real = nc.publish
    diverted: list[str] = []

    async def first_attempt_of_2_finds_no_stream(subject: str, payload: bytes, **kw: Any) -> None:
        msg_id = (kw.get("headers") or {}).get(MSG_ID_HEADER)
        if msg_id is not None and bare(msg_id) == "late:2" and not diverted:
            diverted.append(subject)
            subject = f"nowhere-{uuid.uuid4().hex}"  # no stream: the server answers 503
        await real(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", first_attempt_of_2_finds_no_stream)
    events = _adds(4)
    seqs = await pub.publish_many(events)
    assert diverted == [config.event_subject(1, 0)]
    assert seqs[1] > seqs[3] and seqs[0] < seqs[2] < seqs[3]  # stored 0, 2, 3, then 1
    stored = await _stream_order(nc, config, 4)
    assert [msg_id for _, _, msg_id in stored] == ["late:1", "late:3", "late:4", "late:2"]
    for seq, event in zip(seqs, events, strict=True):
        assert (await _stored(nc, config, seq))[1] == replace(event, router_id="late")
    assert await _stream_messages(nc, config) == 4


async def test_publish_many_raises_after_persistent_failure_and_keeps_the_rest(
    nc: Client,
) -> None:
    config = _unique_config()
    js = nc.jetstream()
    # The stream takes worker 1's subject only: events for worker 2 find no stream.
    await js.add_stream(name=config.events_stream, subjects=[config.event_subject(1, 0)])
    try:
        pub = RouterPublisher(nc, router_id="part", config=config, retries=2, timeout=0.5)
        events = [*_adds(1, worker=1), *_adds(1, start=1, worker=2), *_adds(1, start=2, worker=1)]
        with pytest.raises(PublishError) as raised:
            await pub.publish_many(events)
        error = raised.value
        assert (bare(error.msg_id), error.request_id) == ("part:2", "req-1")
        assert "req-1" in str(error) and "part:2" in str(error) and "3 attempt" in str(error)
        assert "NoStreamResponseError" in str(error)
        assert error.sequences is not None and error.sequences[1] is None
        first, third = error.sequences[0], error.sequences[2]
        assert first is not None and third is not None and first < third
        assert await _stream_messages(nc, config) == 2
        assert pub.last_sequence == third and pub.pending == 0 and not pub._awaiting
    finally:
        await js.delete_stream(config.events_stream)


async def test_publish_many_ack_timeouts_retry_same_msg_ids_then_raise(nc: Client) -> None:
    config = _unique_config()
    seen: list[str] = []

    async def silent(msg: Msg) -> None:  # a responder that never acks
        seen.append(bare((msg.headers or {})[MSG_ID_HEADER]))

    sub = await nc.subscribe(config.event_subject(5, 0), cb=silent)
    try:
        pub = RouterPublisher(nc, router_id="mute", config=config, retries=1, timeout=0.2)
        events = _adds(3, worker=5)
        with pytest.raises(PublishError, match=r"req-0.*mute:1.*2 attempt.*ack timed out"):
            await pub.publish_many(events)
        await nc.flush()
        assert seen == ["mute:1", "mute:2", "mute:3"] * 2
        assert pub.pending == 0 and not pub._awaiting
        assert pub.router_seq == 3  # the msg-ids were spent
    finally:
        await sub.unsubscribe()


async def test_publish_many_with_a_reused_router_id_is_not_silently_deduplicated(
    nc: Client, config: Config
) -> None:
    first = RouterPublisher(nc, router_id="dupm", config=config, msg_id_key="k")
    await first.publish_many(_adds(2))
    restarted = RouterPublisher(nc, router_id="dupm", config=config, msg_id_key="k")
    with pytest.raises(PublishError, match=r"'req-10'.*dupm:1.*already used") as raised:
        await restarted.publish_many(_adds(3, start=10))
    assert raised.value.sequences is not None
    assert raised.value.sequences[:2] == [None, None] and raised.value.sequences[2] is not None
    assert await _stream_messages(nc, config) == 3


async def test_publish_many_honours_max_pending_alongside_publish(
    nc: Client, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = RouterPublisher(nc, router_id="win", config=config, max_pending=8)
    real = nc.publish
    peak = 0

    async def counting(subject: str, payload: bytes = b"", **kw: Any) -> None:
        nonlocal peak
        if kw.get("reply", "").startswith(pub._inbox or "-"):  # publish_many's own sends
            peak = max(peak, len(pub._awaiting))
        await real(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", counting)
    results = await asyncio.gather(
        pub.publish_many(_adds(100)),
        pub.publish_many(_adds(50, start=100)),
        *(pub.free(f"req-{n}", n % 4) for n in range(20)),
    )
    batch_a, batch_b, *frees = results
    assert isinstance(batch_a, list) and isinstance(batch_b, list)
    assert 1 < peak <= 8
    assert all(a < b for a, b in itertools.pairwise(batch_a))
    assert all(a < b for a, b in itertools.pairwise(batch_b))
    assert len({*batch_a, *batch_b, *frees}) == 170
    assert await _stream_messages(nc, config) == 170
    assert pub.router_seq == 170 and pub.pending == 0 and not pub._awaiting


async def test_cancelled_publish_many_gives_back_its_window(nc: Client) -> None:
    config = _unique_config()

    async def silent(msg: Msg) -> None:
        pass

    sub = await nc.subscribe(config.event_subject(6, 0), cb=silent)
    try:
        pub = RouterPublisher(nc, router_id="cx", config=config, max_pending=2, timeout=30)
        task = asyncio.create_task(pub.publish_many(_adds(5, worker=6)))
        await eventually(  # the window is full, no ack will come
            lambda: len(pub._awaiting), lambda n: n >= 2, what="two publishes awaiting acks"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pub.pending == 0 and not pub._awaiting
        assert not pub._slots.locked()  # both slots are free again
    finally:
        await sub.unsubscribe()


async def test_a_client_that_gave_up_on_its_server_raises_only_publish_error(
    nats_server: NatsServer, config: Config
) -> None:
    """Breaks: the connection, closed for good (what a client with bounded reconnects ends in
    when its server stays dead), under a publisher that has sent one event by each path and
    one that has sent none (its first publish_many must still subscribe for acks).
    Expects: publish and publish_many raise PublishError, the batch's ``sequences`` all None;
    before, the fresh publisher's first call (which subscribes for acks) let nats-py's
    ConnectionClosedError out."""
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    used = RouterPublisher(client, router_id="gone-a", config=config, retries=1, timeout=0.5)
    await used.add("before", 1)
    await used.publish_many(_adds(2))
    fresh = RouterPublisher(client, router_id="gone-b", config=config, retries=1, timeout=0.5)
    await client.close()
    for pub in (used, fresh):
        with pytest.raises(PublishError, match="connection closed"):
            await pub.add("after", 1)
        with pytest.raises(PublishError, match="connection closed") as raised:
            await pub.publish_many(_adds(3))
        assert raised.value.sequences == [None, None, None]
        assert pub.pending == 0
