"""Outcomes learned from the deltas stream: each published event's real outcome, as the writer
folded it under the slot-tracker rules, reaches the caller that waits for it."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.route.outcomes import EventOutcome, OutcomeForgotten, Outcomes
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from seqstate import (
    AddRequest,
    Free,
    MarkPrefillCompleted,
    WorkerAdded,
    WorkerRemoved,
    encode_event,
)
from seqstate.batches import encode_batch_of


async def test_each_event_gets_the_outcome_the_writer_folded(nc: Client) -> None:
    config = fresh_config("oc", rules="slot-tracker")
    async with Pipeline(nc, config):
        outcomes = await Outcomes(nc, config).start()
        try:
            pub = RouterPublisher(nc, namespace=config.namespace, router_id="oc", config=config)
            events = [
                AddRequest(request_id="early", worker_id=1, block_hashes=[1]),  # no tracker
                WorkerAdded(worker_id=1, dp_size=2, block_size=16),
                WorkerAdded(worker_id=2, block_size=32),  # another block size
                WorkerAdded(worker_id=1, block_size=16),  # registered already
                AddRequest(request_id="a", worker_id=1, dp_rank=1, block_hashes=[1, 2]),
                AddRequest(request_id="a", worker_id=1, block_hashes=[3]),  # a duplicate
                AddRequest(request_id="a", worker_id=1, dp_rank=5),  # the rank comes first
                MarkPrefillCompleted(request_id="ghost", worker_id=1),
                Free(request_id="a", worker_id=1, dp_rank=1),
                WorkerRemoved(worker_id=1),
                Free(request_id="a", worker_id=1),  # the tracker is gone
            ]
            seqs = await pub.publish_many(events)
            got = await asyncio.gather(*(outcomes.of(seq, timeout=20) for seq in seqs))
            assert [(o.outcome, o.owner, o.block_size) for o in got] == [
                ("no_tracker", None, None),
                ("applied", None, 16),
                ("block_size_mismatch", None, 16),
                ("worker_exists", None, None),
                ("applied", None, None),
                ("duplicate", (1, 1), None),
                ("unknown_worker", None, None),
                ("unknown_request", None, None),
                ("applied", None, None),
                ("applied", None, 0),  # the last worker: the tracker ended (TRACKER_ENDED)
                ("no_tracker", None, None),
            ]
            assert [o.seq for o in got] == seqs
            # Asked again after the delta went by: remembered.
            assert (await outcomes.of(seqs[5])).outcome == "duplicate"
            # An event the writer refused has no delta: known once a later one is folded.
            js = nc.jetstream()
            bad = (await js.publish(config.control_subject, b"\xc1 not an event")).seq
            after = await pub.publish(WorkerAdded(worker_id=3, block_size=8))
            assert await outcomes.of(bad, timeout=20) == EventOutcome(bad, None)
            assert (await outcomes.of(after, timeout=20)).outcome == "applied"
        finally:
            await outcomes.stop()


async def test_a_follower_started_late_answers_what_is_published_after_it(nc: Client) -> None:
    config = fresh_config("ol", rules="slot-tracker")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="ol", config=config)
        first = await pub.publish(WorkerAdded(worker_id=1, block_size=16))
        await pipeline.wait_applied(first)
        outcomes = await Outcomes(nc, config, remember=2).start()
        try:
            with pytest.raises(OutcomeForgotten):
                await outcomes.of(first)  # folded before this follower started
            seqs = [await pub.publish(WorkerAdded(worker_id=1, block_size=16)) for _ in range(3)]
            assert [(await outcomes.of(s, timeout=20)).outcome for s in seqs[-2:]] == [
                "worker_exists",
                "worker_exists",
            ]
            with pytest.raises(OutcomeForgotten):
                await outcomes.of(seqs[0])  # remember=2: the oldest went
        finally:
            await outcomes.stop()


async def test_a_follower_started_late_knows_what_was_folded_before_it(nc: Client) -> None:
    """``folded`` asks no wait for an event folded before the follower started: one a delta
    named, or one refused with no delta after it (its dead letter is the newest)."""
    config = fresh_config("of", rules="slot-tracker")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="of", config=config)
        first = await pub.publish(WorkerAdded(worker_id=1, block_size=16))
        await pipeline.wait_applied(first)
        outcomes = await Outcomes(nc, config).start()
        try:
            await outcomes.folded(first, timeout=0)
            assert outcomes.named == first
            with pytest.raises(TimeoutError):
                await outcomes.folded(first + 1, timeout=0)  # not stored yet
        finally:
            await outcomes.stop()
        js = nc.jetstream()
        bad = (await js.publish(config.control_subject, b"\xc1 not an event")).seq
        await pipeline.writer.wait_applied(bad, timeout=20)  # its dead letter is stored
        late = await Outcomes(nc, config).start()
        try:
            await late.folded(bad, timeout=0)
            assert late.named == first  # no delta after the refused event
        finally:
            await late.stop()


async def test_each_event_of_a_batch_gets_its_own_outcome(nc: Client) -> None:
    """A record batch's events share its sequence: each is asked for by its index, and gets
    its own outcome; one refused gets None (its dead letter names its index) while its
    neighbours apply, and a batch refused event by event answers each of them, with no delta
    after it."""
    config = fresh_config("ob")
    async with Pipeline(nc, config):
        outcomes = await Outcomes(nc, config).start()
        try:
            js = nc.jetstream()
            events = [
                AddRequest("x", 1),
                AddRequest("y", 2),
                AddRequest("x", 1),
                AddRequest("z", 1),
            ]
            payload = encode_batch_of([encode_event(e) for e in events])
            seq = (await js.publish(config.event_subject(1), payload)).seq
            got = await asyncio.gather(
                *(outcomes.of(seq, timeout=20, index=i) for i in range(len(events)))
            )
            assert got == [
                EventOutcome(seq, "applied"),
                EventOutcome(seq, None),  # on worker 1's subject: refused
                EventOutcome(seq, "duplicate", owner=(1, 0)),
                EventOutcome(seq, "applied"),
            ]
            refused = [encode_event(AddRequest("u", 2)), encode_event(AddRequest("v", 2))]
            seq = (await js.publish(config.event_subject(1), encode_batch_of(refused))).seq
            got = await asyncio.gather(*(outcomes.of(seq, timeout=20, index=i) for i in (0, 1)))
            assert got == [EventOutcome(seq, None)] * 2
        finally:
            await outcomes.stop()


async def test_a_batch_refused_event_by_event_is_folded_with_no_delta_after_it(
    nc: Client,
) -> None:
    """The newest stored message a record batch whose every event was refused: ``folded``
    says so once its dead letters are read (no delta will name it, and no Tick comes)."""
    config = fresh_config("oz", idle_tick_s=3600.0, tick_every_s=3600.0)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="oz", config=config)
        first = await pub.publish(AddRequest("a", 1))
        await pipeline.wait_applied(first)
        outcomes = await Outcomes(nc, config).start()
        try:
            refused = [encode_event(AddRequest(r, 2)) for r in ("u", "v", "w")]
            js = nc.jetstream()
            seq = (await js.publish(config.event_subject(1), encode_batch_of(refused))).seq
            await outcomes.folded(seq, timeout=20)
            assert outcomes.named == first  # no delta names it
        finally:
            await outcomes.stop()
