"""The Dynamo capture stored as record batches: a burst of Dynamo's messages is one stored
message of the events stream, and the one fold still decides each message alone, in order.

The writer's forwarder (``projector.dynamo.forward``) reads the namespace's capture stream and
stores what waits there on the captured subject: a lone message as it is, a burst as a record
batch of Dynamo's own bytes, each message naming the capture sequences it holds. Every test
counts every captured message: none lost, none twice, in the order captured.
"""

from __future__ import annotations

import asyncio
import dataclasses

from dynamo_capture import CAPTURE
from nats.aio.client import Client
from nats.js import api
from pipeline_kit import (
    events_in,
    folded,
    forwarding,
    fresh_config,
    logged,
    read_events,
    read_stream,
    run_cli,
)

from projector.nats.resources import dead_letter_stream, dynamo_capture, ensure
from projector.nats.server import NatsServer
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.capture import RAW_PATTERN, rewrite
from projector.wire.headers import CAPTURE as CAPTURE_HEADER
from projector.wire.headers import REASON, SOURCE_INDEX, SOURCE_SEQ, STREAM_SOURCE
from seqstate import Fold, SequenceState
from seqstate.batches import is_batch, items_of
from seqstate.dynamo import captured_subject, decode_dynamo, dynamo_subject

DATA = [m.data for m in CAPTURE]


def config_for(prefix: str) -> Config:
    """A namespace of its own capturing an endpoint of its own (Dynamo's subject renamed)."""
    config = fresh_config(prefix, idle_tick_s=3600.0)
    return dataclasses.replace(config, dynamo_endpoint=f"{config.namespace}.backend.generate")


def raw_subject(config: Config) -> str:
    return dynamo_subject(config.dynamo_endpoints[0])


async def publish(nc: Client, config: Config, data: list[bytes]) -> None:
    for each in data:
        await nc.publish(raw_subject(config), each)  # NATS Core, as Dynamo: no ack
    await nc.flush()


async def captured(nc: Client, config: Config, count: int) -> None:
    """Until the capture stream has stored ``count`` messages in all."""
    js = nc.jetstream()
    for _ in range(1000):
        if (await js.stream_info(dynamo_capture(config))).state.last_seq >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} messages not captured")


async def written(
    nc: Client, config: Config
) -> tuple[SequenceState, list[tuple[int, int, str, bytes]]]:
    """Once the capture holds the whole of ``DATA``: a writer's model once it folded it, and
    the log it wrote."""
    await captured(nc, config, len(DATA))
    async with Pipeline(nc, config) as pipeline:
        await pipeline.wait_applied(await logged(nc, config, len(DATA)))
        state = pipeline.writer.state
    return state, await read_events(nc, config)


def dynamo_messages(log: list[tuple[int, int, str, bytes]]) -> list[bytes]:
    """Every Dynamo message the log holds, in order: alone, or in a batch."""
    return [item for _, _, subject, data in log if ".dynamo." in subject for item in items_of(data)]


def one_by_one(config: Config, log: list[tuple[int, int, str, bytes]]) -> SequenceState:
    """The fold of ``log`` with each event of a batch handed over as a message of its own
    (at the batch's sequence and log time): what the fold of the batches must equal."""
    fold = Fold(config.new_state(), config.fold_rules)
    for seq, at_ns, subject, data in log:
        for item in items_of(data) if ".dynamo." in subject else [data]:
            fold(seq, at_ns, subject, item)
    return fold.state


async def test_a_burst_is_fewer_stored_messages_folded_as_each_alone(nc: Client) -> None:
    """Broke: 155 Dynamo messages (a real fleet's) captured while no writer ran. Expected:
    the writer stores them in fewer messages, each batch naming its capture range, every
    message once and in order; its write model equals the fold of each message alone."""
    config = config_for("cb")
    await ensure(nc, config)
    await publish(nc, config, DATA)
    state, log = await written(nc, config)
    assert dynamo_messages(log) == DATA
    assert len(log) < len(DATA) and any(is_batch(data) for *_, data in log)
    js = nc.jetstream()
    ranges = []
    for seq, *_ in log:
        header = (await js.get_msg(config.events_stream, seq)).headers or {}
        stream, first, last, count = header[CAPTURE_HEADER].split()
        assert stream == dynamo_capture(config)
        ranges.append((int(first), int(last), int(count)))
    assert [r[0] for r in ranges] == [1] + [r[1] + 1 for r in ranges[:-1]]  # gap-free
    assert ranges[-1][1] == len(DATA) and sum(r[2] for r in ranges) == len(DATA)
    assert state.snapshot() == one_by_one(config, log).snapshot()
    assert state.snapshot() == folded(config, log).snapshot()


async def test_a_poison_message_in_a_burst_is_dead_lettered_alone_with_its_index(
    nc: Client,
) -> None:
    """Broke: a Dynamo message that is no msgpack between two good ones, captured while no
    writer ran (one burst). Expected: one batch; the poison one dead-lettered alone, naming
    its index and the batch's sequence, with its own bytes; its neighbours applied."""
    config = config_for("cp")
    await ensure(nc, config)
    poison = b"\x81\xa4oops\xc1"
    await publish(nc, config, [DATA[0], poison, DATA[2]])
    await captured(nc, config, 3)
    async with Pipeline(nc, config) as pipeline:
        await pipeline.wait_applied(await logged(nc, config, 3))
        owners = set(pipeline.writer.state.requests.owner)
        assert pipeline.writer.stats.dead_letters == 1
    log = await read_events(nc, config)
    assert len(log) == 1 and items_of(log[0][3]) == [DATA[0], poison, DATA[2]]
    assert decode_dynamo(DATA[0]).request_id in owners
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert len(letters) == 1
    _, headers, payload = letters[0]
    assert (headers[SOURCE_SEQ], headers[SOURCE_INDEX], payload) == (str(log[0][0]), "1", poison)
    assert headers[REASON].startswith("event 1 of the batch: malformed Dynamo")


async def test_a_lone_message_is_stored_as_it_was_captured(nc: Client) -> None:
    """A message alone in the capture goes at once, as a plain message: Dynamo's bytes."""
    config = config_for("cl")
    await ensure(nc, config)
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, config, [DATA[0]])
        await pipeline.wait_applied(await logged(nc, config, 1))
    log = await read_events(nc, config)
    assert [(subject, data) for _, _, subject, data in log] == [
        (captured_subject(config.namespace, config.dynamo_endpoints[0]), DATA[0])
    ]
    stored = await nc.jetstream().get_msg(config.events_stream, log[0][0])
    headers = stored.headers or {}
    assert headers[CAPTURE_HEADER] == f"{dynamo_capture(config)} 1 1 1"
    assert STREAM_SOURCE not in headers


async def test_two_forwarders_at_once_store_each_message_once_in_order(nc: Client) -> None:
    """Two writers' forwarders (two connections) race over one capture while a burst
    arrives in parts: every message stored once, in the order captured."""
    config = config_for("c2")
    await ensure(nc, config)
    data = [b"\x81\xa1n" + i.to_bytes(4, "big") for i in range(3000)]
    other = await _connect(nc)
    try:
        async with forwarding(nc, config) as a, forwarding(other, config) as b:
            for start in range(0, len(data), 500):
                await publish(nc, config, data[start : start + 500])
            log = []
            for _ in range(3000):
                log = await read_events(nc, config)
                if events_in(log) >= len(data):
                    break
                await asyncio.sleep(0.01)
            assert a.forwarded + b.forwarded == len(data)
    finally:
        await other.close()
    assert dynamo_messages(await read_events(nc, config)) == data


async def _connect(nc: Client) -> Client:
    import nats

    return await nats.connect(nc.connected_url.geturl() if nc.connected_url else "")


async def test_a_log_sourced_then_batched_replays_identically(
    nc: Client, nats_server: NatsServer
) -> None:
    """Broke: an events stream provisioned before the forwarder, sourcing the capture (a
    message each), then a writer started with the forwarder. Expected: it removes the source
    and resumes just after the last message sourced; the log holds every message once, the
    sourced ones then batches; the writer's model equals a replay of the whole log."""
    config = config_for("cs")
    await ensure(nc, config)
    js = nc.jetstream()
    events = (await js.stream_info(config.events_stream)).config
    events.sources = [
        api.StreamSource(
            name=dynamo_capture(config),
            subject_transforms=[
                api.SubjectTransform(src=RAW_PATTERN, dest=rewrite(config.namespace))
            ],
        )
    ]
    await js.update_stream(events)
    await publish(nc, config, DATA[:60])
    await logged(nc, config, 60)  # sourced by the server, one message each
    async with Pipeline(nc, config):
        pass  # its forwarder takes over
    assert not (await js.stream_info(config.events_stream)).config.sources
    await publish(nc, config, DATA[60:])
    state, log = await written(nc, config)
    assert dynamo_messages(log) == DATA
    headers = [(await js.get_msg(config.events_stream, seq)).headers or {} for seq, *_ in log]
    assert all(STREAM_SOURCE in h for h in headers[:60])
    assert all(CAPTURE_HEADER in h for h in headers[60:]) and len(log) < len(DATA)
    assert state.snapshot() == folded(config, log).snapshot()
    out = await run_cli(config, nats_server.url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
