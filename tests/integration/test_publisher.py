"""RouterPublisher against a real nats-server: sequences, msg-ids, dedup, retries, pipelining.

The server is shared by the module, so every test gets its own namespace and stream.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import PubAck

from projector.config import Config
from projector.publisher import MSG_ID_HEADER, PublishError, RouterPublisher
from seqstate import (
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
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
        assert headers[MSG_ID_HEADER] == f"r1:{n}"
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
    assert headers[MSG_ID_HEADER] == "ctl:3"


async def test_same_msg_id_twice_is_stored_once(nc: Client, config: Config) -> None:
    js = nc.jetstream()
    subject = config.event_subject(1, 0)
    first = await js.publish(subject, b"a", headers={MSG_ID_HEADER: "r:1"})
    again = await js.publish(subject, b"a", headers={MSG_ID_HEADER: "r:1"})
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert await _stream_messages(nc, config) == 1


async def test_lost_ack_is_retried_with_the_same_msg_id_and_stored_once(
    nc: Client, config: Config
) -> None:
    pub = RouterPublisher(nc, router_id="lossy", config=config, timeout=0.3)
    real = pub._js.publish_async
    calls: list[dict[str, str]] = []

    async def drop_first_ack(subject: str, payload: bytes, **kw: Any) -> asyncio.Future[PubAck]:
        calls.append(dict(kw["headers"]))
        future = await real(subject, payload, **kw)
        if len(calls) > 1:
            return future
        await future  # the server stored it; the router never hears so
        return asyncio.get_running_loop().create_future()

    pub._js.publish_async = drop_first_ack  # type: ignore[method-assign,assignment]
    seq = await pub.add("req-lost", 1)
    assert [c[MSG_ID_HEADER] for c in calls] == ["lossy:1", "lossy:1"]
    assert await _stream_messages(nc, config) == 1
    _, stored, _ = await _stored(nc, config, seq)
    assert stored == AddRequest(request_id="req-lost", worker_id=1, router_id="lossy")
    assert pub.pending == 0


async def test_no_stream_raises_publish_error_after_retries(nc: Client) -> None:
    config = _unique_config()  # no stream captures its subjects
    pub = RouterPublisher(nc, router_id="lost", config=config, retries=2, timeout=0.5)
    with pytest.raises(PublishError) as raised:
        await pub.add("req-nowhere", 4)
    message = str(raised.value)
    assert "req-nowhere" in message and "lost:1" in message and "3 attempt" in message
    assert raised.value.msg_id == "lost:1" and raised.value.request_id == "req-nowhere"
    assert pub.pending == 0 and await pub.flush() is None


async def test_ack_timeout_retries_same_msg_id_then_raises(nc: Client) -> None:
    config = _unique_config()
    seen: list[str] = []

    async def silent(msg: Msg) -> None:  # a responder that never acks
        seen.append((msg.headers or {})[MSG_ID_HEADER])

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


async def test_reused_router_id_is_not_silently_deduplicated(nc: Client, config: Config) -> None:
    first = RouterPublisher(nc, router_id="dup", config=config)
    await first.add("a", 1)
    restarted = RouterPublisher(nc, router_id="dup", config=config)
    with pytest.raises(PublishError, match=r"'b'.*dup:1.*already used"):
        await restarted.add("b", 1)
    assert await _stream_messages(nc, config) == 1


async def test_invalid_event_is_rejected_before_publishing(nc: Client, config: Config) -> None:
    pub = RouterPublisher(nc, router_id="v", config=config)
    with pytest.raises(EventDecodeError, match="request_id"):
        await pub.add("", 1)
    with pytest.raises(EventDecodeError, match="expected_prefill_ms"):
        await pub.add("r", 1, expected_prefill_ms=-1.0)
    assert pub.router_seq == 0
    assert await pub.add("r", 1) == 1
    assert (await _stored(nc, config, 1))[2][MSG_ID_HEADER] == "v:1"


async def test_thousand_concurrent_adds_are_bounded_distinct_and_flushed(
    nc: Client, config: Config
) -> None:
    pub = RouterPublisher(nc, router_id="bulk", config=config, max_pending=64)
    real = pub._js.publish_async
    outstanding = 0
    peak = 0

    def settled(_: asyncio.Future[PubAck]) -> None:
        nonlocal outstanding
        outstanding -= 1

    async def counting(subject: str, payload: bytes, **kw: Any) -> asyncio.Future[PubAck]:
        nonlocal outstanding, peak
        future = await real(subject, payload, **kw)
        outstanding += 1
        peak = max(peak, outstanding)
        future.add_done_callback(settled)
        return future

    pub._js.publish_async = counting  # type: ignore[method-assign,assignment]
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
    assert 1 < peak <= 64
    assert await _stream_messages(nc, config) == 1000
    assert pub.router_seq == 1000 and pub.pending == 0

    more = await asyncio.gather(*(pub.free(f"req-{i}", i % 8) for i in range(10)))
    assert len(set(more)) == 10 and min(more) > last
    assert await pub.flush() == max(more)
