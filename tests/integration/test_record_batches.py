"""Record batches on a real server: one stored message, many events, each decided alone.

A batch with poison events in the middle (bytes nested 1000 deep, another rank's AddRequest,
an event past a bound) is stored as one message: the writer dead-letters each poison event
alone, naming the batch's stream sequence and the event's index, with the event's own bytes,
and applies its neighbours. A log of single events and batches, folded again by the one fold
and by ``seqstate replay --verify`` (a process of its own, the fast path), gives the writer's
state byte for byte, and the bucket the projector wrote from the batches' deltas is
identical. A writer restarted over the log folds the batches alike and stays up.
"""

from __future__ import annotations

import json

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_events, read_stream, run_cli

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.route.publisher import EventTooLarge, RouterPublisher
from projector.run.assemble import build_delta_log
from projector.run.pipeline import Pipeline
from projector.wire.headers import MSG_ID, REASON, SIZE, SOURCE_INDEX, SOURCE_SEQ
from seqstate import (
    AddRequest,
    Delta,
    Fold,
    Free,
    MarkPrefillCompleted,
    Refusal,
    decode_deltas,
    encode_event,
)
from seqstate.batches import encode_batch_of
from seqstate.deltas import as_parts
from seqstate.fold import OUT_OF_BOUNDS, TOO_LARGE, UNDECODABLE, WRONG_SUBJECT

NESTED = b"\x92\x01" + b"\x91" * 1000 + b"\xc0"


async def test_a_poison_event_in_a_batch_is_dead_lettered_alone_and_every_fold_agrees(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("batch", idle_tick_s=3600.0, tick_every_s=3600.0)  # no Tick between
    await ensure(nc, config)
    ns = config.namespace
    js = nc.jetstream()
    batch = [
        encode_event(AddRequest("a", 1, block_hashes=[1, 2, 3], prefill_tokens=48)),
        NESTED,
        encode_event(AddRequest("b", 1, block_hashes=[1, 2, 4], prefill_tokens=32)),
        encode_event(AddRequest("w2", 2)),  # another rank's: not on worker 1's subject
        encode_event(AddRequest("big", 1, prefill_tokens=2**64 - 1)),  # past a bound
        encode_event(MarkPrefillCompleted("a", 1)),
    ]
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=ns, router_id="rb", config=config)
        first = await pub.add("before", 1, block_hashes=[9], prefill_tokens=16)
        ack = await js.publish(config.event_subject(1), encode_batch_of(batch))
        burst = [encode_event(Free("b", 1)), encode_event(AddRequest("c", 1, block_hashes=[7]))]
        second = await js.publish(config.event_subject(1), encode_batch_of(burst))
        last = await pub.add("after", 1, block_hashes=[8])
        await pipeline.wait_applied(last)
        writer = pipeline.writer
        counts = dict(writer.dead_letters.counts)
        applied, dead = writer.stats.applied, writer.stats.dead_letters
        assert sorted(writer.state.requests.owner) == ["a", "after", "before", "c"]
        state = writer.state.snapshot()
    assert (ack.seq, second.seq) == (first + 1, first + 2)
    assert counts == {UNDECODABLE: 1, TOO_LARGE: 0, OUT_OF_BOUNDS: 1, WRONG_SUBJECT: 1}
    assert (applied, dead) == (1 + 3 + 2 + 1, 3)
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [
        (int(h[SOURCE_SEQ]), int(h[SOURCE_INDEX]), h[MSG_ID], int(h[SIZE]), data)
        for _, h, data in letters
    ] == [
        (ack.seq, i, f"dead:{ns}:{config.events_stream}:{ack.seq}.{i}", len(batch[i]), batch[i])
        for i in (1, 3, 4)
    ]
    assert letters[1][1][REASON] == (
        "event 3 of the batch: refused: AddRequest of worker 2 rank 0 on subject "
        f"'seqstate.events.{ns}.1.0'; it belongs on 'seqstate.events.{ns}.2.0'"
    )
    # The one fold over the log: the writer's verdicts, its state byte for byte.
    log = await read_events(nc, config)
    assert [seq for seq, *_ in log] == list(range(first, last + 1))
    fold = Fold(config.new_state(), config.fold_rules)
    refused = []
    for message in log:
        verdict = fold(*message)
        for i, each in enumerate(verdict if isinstance(verdict, list) else [verdict]):
            if type(each) is Refusal:
                refused.append((message[0], i, each.kind))
    assert refused == [
        (ack.seq, 1, UNDECODABLE),
        (ack.seq, 3, WRONG_SUBJECT),
        (ack.seq, 4, OUT_OF_BOUNDS),
    ]
    assert fold.state.snapshot() == state
    url = nats_server.url
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
    out = await run_cli(config, url, "replay", "--from-seq", str(first), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "(3 dead-lettered)" in out.stdout, out.stdout
    # inspect names each event of a batch by its position, with its own outcome.
    out = await run_cli(config, url, "inspect", "request", "b", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)["events"]
    assert [(e["seq"], e.get("index"), e["type"], e["outcome"]) for e in found] == [
        (ack.seq, 2, "AddRequest", "applied"),
        (second.seq, 0, "Free", "applied"),
    ]
    out = await run_cli(config, url, "inspect", "request", "big", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert f"{ack.seq}#4" in out.stdout and "dead-lettered" in out.stdout, out.stdout
    # A writer restarted after the batches goes on from them.
    async with Pipeline(nc, config) as pipeline:
        again = await pub.add("again", 1)
        await pipeline.wait_applied(again)
        owners = sorted(pipeline.writer.state.requests.owner)
        assert owners == ["a", "after", "again", "before", "c"]
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout


async def test_a_writer_restarted_inside_a_batchs_parts_stores_only_the_rest(nc: Client) -> None:
    """A batch's deltas are the parts of one delta at its sequence: a delta log that died
    with the first two stored leaves the chain inside the batch, and its successor stores
    the others, each part once, in order, as a projector expects them."""
    config = fresh_config("batchparts")
    await ensure(nc, config)
    subject = config.event_subject(1)
    payload = encode_batch_of(
        [encode_event(AddRequest(f"r{i}", 1, block_hashes=[i])) for i in range(5)]
    )

    seq = (await nc.jetstream().publish(subject, payload)).seq
    assert seq == 1

    def folded() -> list[Delta]:
        fold = Fold(config.new_state(), config.fold_rules)
        verdicts = fold(seq, 1000, subject, payload)
        assert isinstance(verdicts, list)
        return [v for v in verdicts if type(v) is Delta]

    parts = as_parts(folded())
    assert [(d.seq, d.part, d.more, d.index) for d in parts] == [(1, i, i < 4, i) for i in range(5)]
    log = build_delta_log(nc, config)
    assert await log.open() == 0
    failures: list[BaseException] = []
    log.start(failures.append)
    for part in parts[:2]:  # what was in flight when it died
        log.append(part)
    await eventually(
        lambda: (log.messages, len(log._pending)),
        lambda stored_pending: stored_pending == (1, 0),
        what="the parts in flight stored",
        watch=lambda: f"failures: {failures}",
    )
    await log.close()
    successor = build_delta_log(nc, config)
    assert await successor.open() == 0
    assert successor.stored_part == (1, 1)
    successor.start(failures.append)
    successor.append_parts(folded())
    await successor.flush()
    await successor.close()
    assert not failures
    messages = await read_stream(nc, config.deltas_stream, config.deltas_subject)
    stored = [d for _, _, data in messages for d in decode_deltas(data)]
    assert [(d.seq, d.part, d.index) for d in stored] == [(1, i, i) for i in range(5)]
    assert [len(decode_deltas(data)) for _, _, data in messages] == [2, 3]


async def test_publish_many_sends_a_ranks_events_in_batches_the_writer_folds_one_by_one(
    nc: Client,
) -> None:
    """``batch_events=4``: 10 events of worker 1 and 3 of worker 2, interleaved, go out as 4
    messages (two full batches and one of three for worker 1, then one of three for worker
    2: the ranks in the order of their first events), one msg-id each, in each rank's order;
    the sequences come back per event; the writer's state is the one fold's of the log."""
    config = fresh_config("pubmany", idle_tick_s=3600.0, tick_every_s=3600.0)
    await ensure(nc, config)
    ns = config.namespace
    events: list[AddRequest | Free] = []
    for i in range(10):
        events.append(AddRequest(f"a{i}", 1, block_hashes=[i, i + 1], prefill_tokens=16))
        if i in (2, 5, 8):
            events.append(AddRequest(f"b{i}", 2, block_hashes=[100 + i]))
    events.append(Free("a0", 1))
    pub = RouterPublisher(nc, namespace=ns, router_id="pm", config=config, batch_events=4)
    async with Pipeline(nc, config) as pipeline:
        seqs = await pub.publish_many(events)
        await pipeline.wait_applied(max(seqs))
        state = pipeline.writer.state.snapshot()
        assert pipeline.writer.stats.applied == len(events)
    log = await read_events(nc, config)
    assert len(log) == 4
    one, two, three, four = (m[0] for m in log)
    w1 = [seqs[n] for n, e in enumerate(events) if e.worker_id == 1]
    w2 = [seqs[n] for n, e in enumerate(events) if e.worker_id == 2]
    assert w1 == [one] * 4 + [two] * 4 + [three] * 3
    assert w2 == [four] * 3
    headers = [h for _, h, _ in await read_stream(nc, config.events_stream, config.events_subjects)]
    tag = headers[0][MSG_ID].rsplit(":", 1)[1]
    assert [h[MSG_ID] for h in headers] == [f"pm:{n}:{tag}" for n in (1, 6, 11, 4)]
    # The same events, one per message, fold to the same state.
    fold = Fold(config.new_state(), config.fold_rules)
    ordered = [e for e in events if e.worker_id == 1] + [e for e in events if e.worker_id == 2]
    for n, event in enumerate(ordered):
        fold(n + 1, log[0][1], config.subject_of(event), encode_event(event))
    assert sorted(fold.state.requests.owner) == sorted(
        e.request_id for e in events if e.request_id != "a0"
    )
    again = Fold(config.new_state(), config.fold_rules)
    for message in log:
        again(*message)
    assert again.state.snapshot() == state


async def test_publish_many_checks_every_event_of_a_batch_before_sending_any(nc: Client) -> None:
    """An event too large for the fold anywhere in the call: nothing is sent, no router_seq
    taken; a batch keeps to the server's payload limit however many events it may hold."""
    config = fresh_config("pubcheck", max_event_bytes=4096)
    await ensure(nc, config)
    pub = RouterPublisher(nc, router_id="pc", config=config, batch_events=1024)
    big = AddRequest("big", 1, block_hashes=list(range(2**40, 2**40 + 1000)))
    with pytest.raises(EventTooLarge, match="AddRequest for request 'big'"):
        await pub.publish_many([AddRequest("s", 1), big])
    js = nc.jetstream()
    assert (await js.stream_info(config.events_stream)).state.messages == 0
    # 400 events of ~3.6 KB: over 1 MB, so more than one batch under the payload limit.
    many = [AddRequest(f"m{i}", 1, block_hashes=list(range(400))) for i in range(400)]
    seqs = await pub.publish_many(many)
    assert seqs[0] == 1 and len(set(seqs)) == 2
    sizes = [len(data) for _, _, data in await read_stream(nc, config.events_stream, ">")]
    assert all(size <= nc.max_payload for size in sizes) and len(sizes) == 2
