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

from nats.aio.client import Client
from pipeline_kit import fresh_config, read_events, read_stream, run_cli

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.wire.headers import MSG_ID, REASON, SIZE, SOURCE_INDEX, SOURCE_SEQ
from seqstate import AddRequest, Fold, Free, MarkPrefillCompleted, Refusal, encode_event
from seqstate.batches import encode_batch_of
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
    # A writer restarted after the batches goes on from them.
    async with Pipeline(nc, config) as pipeline:
        again = await pub.add("again", 1)
        await pipeline.wait_applied(again)
        owners = sorted(pipeline.writer.state.requests.owner)
        assert owners == ["a", "after", "again", "before", "c"]
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
