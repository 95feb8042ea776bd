"""Poison pills, published raw on a real server: no message stops the ledger.

Each one once stopped the writer for good, or made the writer and replay disagree: a 1 KB
message nested 1000 deep (RecursionError), two valid AddRequests whose prefill summed past
u64 (OverflowError when its delta was encoded), an AddRequest too large for its delta (the
writer refused it, replay and rebuild booked it), an AddRequest for worker 5 on worker 1's
subject and a WorkerRemoved on a worker's subject (booked as if the subject did not matter).
Now the writer dead-letters each with its kind and the one fold's reason, goes on, survives a
restart over them, and ``seqstate replay --verify`` (the CLI, a process of its own) finds the
bucket identical, before and after ``seqstate rebuild``.
"""

from __future__ import annotations

import asyncio

from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_events, read_stream, run_cli

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.wire.headers import REASON, SOURCE_SEQ
from seqstate import AddRequest, Fold, Free, Refusal, WorkerRemoved, encode_event
from seqstate.fold import OUT_OF_BOUNDS, TOO_LARGE, UNDECODABLE, WRONG_SUBJECT

REPRO = b"\x92\x01" + b"\x91" * 1000 + b"\xc0"  # 1,000 nested arrays: once killed the writer


async def raw_publish(url: str, subject: bytes, payload: bytes) -> None:
    """A PUB no client library would send (its subject as raw bytes), answered by a PONG."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(
            b'CONNECT {"verbose":false,"pedantic":false}\r\n'
            + b"PUB %s %d\r\n%s\r\nPING\r\n" % (subject, len(payload), payload)
        )
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        assert line.startswith(b"PONG"), line
    finally:
        writer.close()


async def test_the_issues_poison_pills_are_dead_lettered_and_every_fold_agrees(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("poison", idle_tick_s=3600.0, tick_every_s=3600.0)  # no Tick between
    await ensure(nc, config)
    ns = config.namespace
    big = AddRequest("big", 1, block_hashes=list(range(2**40, 2**40 + 116_000)))
    pills: list[tuple[str, bytes, str | None]] = [  # subject, payload, the kind (None: applied)
        (f"seqstate.events.{ns}.2.0", REPRO, UNDECODABLE),
        (config.event_subject(2), b"\x92\x01" + b"\x91" * 200_000 + b"\xc0", UNDECODABLE),
        (
            config.event_subject(2),
            b"\x93" + encode_event(Free("a", 2))[1:] + b"\x91" * 5000 + b"\xc0",
            UNDECODABLE,
        ),
        (config.event_subject(3), encode_event(AddRequest("p1", 3, prefill_tokens=2**63)), None),
        (
            config.event_subject(3),
            encode_event(AddRequest("p2", 3, prefill_tokens=2**63)),
            OUT_OF_BOUNDS,
        ),
        (
            config.event_subject(3),
            encode_event(AddRequest("p3", 3, prefill_tokens=2**64 - 1)),
            OUT_OF_BOUNDS,
        ),
        (config.event_subject(1), encode_event(big), TOO_LARGE),
        (config.event_subject(1), encode_event(AddRequest("w5", 5)), WRONG_SUBJECT),
        (config.event_subject(1), encode_event(WorkerRemoved(2)), WRONG_SUBJECT),
    ]
    assert 1_040_000 < len(encode_event(big)) < nc.max_payload
    free = encode_event(Free("before", 2))
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=ns, router_id="pp", config=config)
        first = await pub.add("before", 2, block_hashes=[1, 2], prefill_tokens=10)
        for subject, payload, _ in pills:  # raw, around the publisher's checks
            await nc.publish(subject, payload)
        freed = await pub.free("p1", 3)  # acknowledged: every pill before it is stored
        # A subject that is not UTF-8: nats-py's read loop raised on it, and the writer's
        # connection stopped handing anything over, at every restart.
        await raw_publish(nats_server.url, f"seqstate.events.{ns}.".encode() + b"\xff.0", free)
        await eventually(
            lambda: last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects),
            lambda seq: seq > freed,
            what="the message of a subject that is not UTF-8 stored",
        )
        last = await pub.add("after", 2, block_hashes=[3])
        await pipeline.wait_applied(last)
        writer = pipeline.writer
        counts = dict(writer.dead_letters.counts)
        assert sorted(writer.state.requests.owner) == ["after", "before"]
        state = writer.state.snapshot()
    kinds = [kind for _, _, kind in pills if kind]
    kinds.append(WRONG_SUBJECT)  # the subject that is not UTF-8
    assert counts == {UNDECODABLE: 3, TOO_LARGE: 1, OUT_OF_BOUNDS: 2, WRONG_SUBJECT: 3}
    # The dead letters are the one fold's refusals, reason for reason, at their sequences.
    log = await read_events(nc, config)
    assert [seq for seq, *_ in log] == list(range(first, last + 1))  # every pill was stored
    fold = Fold(config.new_state(), config.fold_rules)
    refused = []
    for message in log:
        verdict = fold(*message)
        if type(verdict) is Refusal:
            refused.append((message[0], verdict.kind, verdict.reason))
    assert [kind for _, kind, _ in refused] == kinds
    assert fold.state.snapshot() == state
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [(int(h[SOURCE_SEQ]), h[REASON]) for _, h, _ in letters] == [
        (seq, reason) for seq, _, reason in refused
    ]
    url = nats_server.url
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
    out = await run_cli(config, url, "replay", "--from-seq", str(first), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert f"({len(kinds)} dead-lettered)" in out.stdout, out.stdout
    # A writer restarted over the pills folds them again, alike, and stays up.
    async with Pipeline(nc, config) as pipeline:
        again = await pub.add("again", 2)
        await pipeline.wait_applied(again)
        assert sorted(pipeline.writer.state.requests.owner) == ["after", "again", "before"]
    out = await run_cli(config, url, "rebuild")
    assert out.returncode == 0, out.stderr
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
