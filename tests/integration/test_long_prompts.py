"""Long prompts through every door, and the one size rule at each, on a real server.

A slot value packs each block hash in 8 bytes where an event carries it in 1 to 9, so an event
well under the server's payload limit (140,000 small hashes: about half a megabyte) booked a
slot value over it: the projector's flush failed on every retry ("MaxPayloadError") and the
namespace's bucket stopped, ``verify`` failed, and a restart did not help. Long-context models
make such prompts legitimate (a 1M-token prompt is 62,500 blocks), so they are accepted: the
slot is cut into keys of at most 4,096 hashes. What no door may accept is refused by one rule
(``projector.wire.sizes``): an event over ``max_event_bytes``, at most the server's
``max_payload`` less 5 KiB. Each door is tried just under its limit (accepted, applied whole,
``replay --verify`` identical, the view's overlaps exact, the projector going on) and just over
(refused, naming the limit, nothing applied): ``RouterPublisher``, ``seqstate publish``,
serve-http's ``POST /add``, and a Dynamo replica-sync message on the captured subject.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from pathlib import Path

import msgspec
import nats
import pytest
from eventually import eventually
from http_kit import exchange, serve_http
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import (
    bucket_values,
    folded,
    fresh_config,
    read_events,
    read_stream,
    run_cli,
)

from projector.bucket.projection import BucketUnfit
from projector.bucket.reader import RegistryView
from projector.dynamo.forward import fitted
from projector.http.slot_api import AddBody, event_for
from projector.http.tracker_names import namespace_for
from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.route.publisher import EventTooLarge, RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.headers import REASON
from projector.wire.sizes import DELTA_HEADROOM, event_limit
from projector.wire.values import EMPTY_SLOT, LARGEST_VALUE, parse_key
from seqstate import AddRequest, Free, WorkerRemoved, encode_event
from seqstate.dynamo import DynamoMessage, dynamo_subject, encode_dynamo

_RNG = random.Random(1)
MILLION = [_RNG.getrandbits(64) for _ in range(62_500)]  # a 1M-token prompt, blocks of 16
SMALL = list(range(1, 140_001))  # 140,000 small hashes: 1 to 5 bytes each in an event
WIDE = list(range(2**63, 2**63 + 100_000))  # 9 bytes each


def sized(size: int, worker_id: int, router_id: str) -> AddRequest:
    """An AddRequest of exactly ``size`` encoded bytes (100,000 hashes, an id filling the
    rest), as ``router_id``'s publisher sends it."""

    def event(n: int) -> AddRequest:
        return AddRequest(f"edge-{'x' * n}", worker_id, block_hashes=WIDE, router_id=router_id)

    n = 70_000
    n += size - len(encode_event(event(n)))
    assert len(encode_event(event(n))) == size
    return event(n)


async def assert_exact(nc: Client, url: str, config: Config, queries: list[list[int]]) -> None:
    """The bucket is the replay's (``seqstate replay --verify``), no value is over the
    server's limit, and a RegistryView's overlaps and potential loads are the fold's."""
    state = folded(config, await read_events(nc, config))
    state.sync_registry()
    last = await last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects)
    async with RegistryView(nc, config=config) as view:
        await view.wait_for(last, timeout=30)
        now = state.now_ns
        assert view.loads(now) == state.registry.loads(now)
        for query in queries:
            assert view.overlap_depths(query) == state.registry.overlap_depths(query)
            assert view.potential_loads(query, 16, now) == state.registry.potential_loads(
                query, 16, now
            )
    values = await bucket_values(nc, config)
    assert max(map(len, values.values())) < nc.max_payload
    done = await run_cli(
        config, url, "replay", "--verify", "--no-progress", "--rules", config.rules
    )
    assert done.returncode == 0 and "identical: 0 keys differ" in done.stdout, done


async def test_a_router_books_a_1m_token_prompt_and_140000_small_hashes_whole(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("lpr")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="lp", config=config)
        await pub.add("million", 1, block_hashes=MILLION)
        await pub.add("small-hashes", 1, block_hashes=SMALL)
        await pub.add("shares", 2, block_hashes=MILLION[:30_000])
        limit = event_limit(nc.max_payload, config.max_event_bytes)
        assert limit == nc.max_payload - 5 * 1024 == config.max_event_bytes
        await pub.publish(sized(limit, 3, "lp"))  # the largest event one may send: accepted
        over = sized(limit + 1, 3, "lp")
        with pytest.raises(EventTooLarge) as refused:
            await pub.publish(over)
        assert str(refused.value) == (
            f"AddRequest for request {over.request_id[:60]!r}… ({len(over.request_id):,} "
            f"characters): {limit + 1:,} bytes encoded, over the {limit:,} bytes one event may "
            f"take (the server's max_payload of {nc.max_payload:,} less 5,120 for its delta); "
            "it was not sent"
        )
        with pytest.raises(EventTooLarge):  # the whole call is refused before anything is sent
            await pub.publish_many([AddRequest("never", 3, block_hashes=[1]), over])
        after = await pub.add("after", 1, block_hashes=[1, 2, 3])
        await pipeline.wait_applied(after)
        assert after == 5  # nothing of the refused calls was stored
        assert pipeline.writer.stats.dead_letters == 0
    await assert_exact(nc, nats_server.url, config, [MILLION, SMALL, [*MILLION[:100], 7], WIDE])
    # The parts hold every hash: a 1M-token prompt is a head and 15 parts.
    values = await bucket_values(nc, config)
    ns = config.namespace
    keys = [parse_key(ns, key) for key in values]
    parts = collections.Counter(k.slot for k in keys if k.kind == "part" and k.rank == (1, 0))
    assert parts == {0: 15, 1: 34}, parts
    # `seqstate rebuild` writes the same layout from the write model.
    rebuilt = await run_cli(config, nats_server.url, "rebuild")
    assert rebuilt.returncode == 0, rebuilt
    await assert_exact(nc, nats_server.url, config, [MILLION, SMALL])
    # Freed, then the rank removed: its parts are emptied, then deleted with it.
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=ns, router_id="lp2", config=config)
        freed = await pub.publish_many([Free("million", 1), Free("small-hashes", 1)])
        await pipeline.wait_applied(freed[-1])
        values = await bucket_values(nc, config)
        emptied = [k for k in values if parse_key(ns, k).kind == "part" and ".req.1." in k]
        assert len(emptied) == 15 + 34 and {values[k] for k in emptied} == {EMPTY_SLOT}
        await assert_exact(nc, nats_server.url, config, [MILLION, SMALL])
        removed = await pub.publish(WorkerRemoved(1))
        await pipeline.wait_applied(removed)
    values = await bucket_values(nc, config)
    assert not [k for k in values if k.startswith((f"{ns}.req.1.", f"{ns}.load.1."))]
    await assert_exact(nc, nats_server.url, config, [MILLION])


async def test_seqstate_publish_takes_an_event_at_the_limit_and_refuses_one_byte_more(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("lpc")
    await ensure(nc, config)
    limit = event_limit(nc.max_payload, config.max_event_bytes)
    router = "cli-edge"

    def line(event: AddRequest) -> str:
        return msgspec.json.encode(event).decode() + "\n"

    fits, over = tmp_path / "fits.jsonl", tmp_path / "over.jsonl"
    small = AddRequest("s", 2, block_hashes=SMALL, router_id=router)
    fits.write_text(line(sized(limit, 1, router)) + line(small))
    edge = sized(limit + 1, 1, router)
    over.write_text(line(edge))
    async with Pipeline(nc, config) as pipeline:
        done = await run_cli(config, nats_server.url, "publish", str(fits), "--router-id", router)
        assert done.returncode == 0 and "published 2 events, last sequence 2" in done.stdout, done
        refused = await run_cli(config, nats_server.url, "publish", str(over))
        assert refused.returncode == 1 and refused.stdout == "", refused
        assert plain_lines(refused.stderr) == [
            f"seqstate: error: {over}:1: AddRequest for request {edge.request_id[:60]!r}… "
            f"({len(edge.request_id):,} characters): {limit + 1:,} bytes encoded, over the "
            f"{limit:,} bytes one event may take (the server's max_payload of "
            f"{nc.max_payload:,} less 5,120 for its delta); it was not sent"
        ]
        await pipeline.wait_applied(2)
        assert pipeline.writer.stats.dead_letters == 0
    assert await last_seq_of(nc.jetstream(), config.events_stream, config.events_subjects) == 2
    await assert_exact(nc, nats_server.url, config, [WIDE, SMALL])


async def test_post_add_books_140000_small_hashes_and_refuses_an_event_over_the_limit(
    nc: Client, nats_server: NatsServer
) -> None:
    """serve-http's door: a body the HTTP limit lets in may still make an event over the one
    size rule: 413 with the limit named, nothing stored (it was a 500, and the event under it
    stopped the bucket)."""
    config = fresh_config("lph")
    m = {"model_name": "long"}
    ns = namespace_for("long", "default", config.namespace)
    tracker = dataclasses.replace(config.with_namespace(ns), rules="slot-tracker")
    limit = event_limit(nc.max_payload, config.max_event_bytes)

    def add(rid: str, hashes: list[int]) -> dict[str, object]:
        return {**m, "request_id": rid, "worker_id": 1, "dp_rank": 0, "sequence_hashes": hashes}

    def event_size(rid: str, hashes: list[int]) -> int:
        body = msgspec.convert(add(rid, hashes), AddBody)
        publisher = "slots-" + "0" * 32  # serve-http's router id: a uuid's 32 hex digits
        return len(encode_event(msgspec.structs.replace(event_for(body), router_id=publisher)))

    hashes = list(range(2**62, 2**62 + 50_000))
    pad = limit - event_size("x" * 70_000, hashes) + 70_000
    at_limit, over = "e" * pad, "e" * (pad + 1)
    assert (event_size(at_limit, hashes), event_size(over, hashes)) == (limit, limit + 1)
    async with serve_http(nats_server.url, config) as port:
        register = {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        answers = await exchange(
            port,
            [
                ("POST", "/register", register),
                ("POST", "/add", add("small-hashes", SMALL)),
                ("POST", "/add", add(at_limit, hashes)),
                ("POST", "/add", add(over, hashes)),
                ("POST", "/add", add("after", [1, 2, 3])),
            ],
        )
        refusal = {
            "error": (
                f"AddRequest for request {over[:60]!r}… ({len(over):,} characters): "
                f"{limit + 1:,} bytes encoded, over the {limit:,} bytes one event may take "
                f"(the server's max_payload of {nc.max_payload:,} less 5,120 for its delta); "
                "it was not sent"
            )
        }
        assert [a.status for a in answers] == [201, 201, 201, 413, 201], answers
        assert answers[3].body == refusal
        # A process that does not hold the tracker's lease refuses it alike.
        async with serve_http(nats_server.url, config) as other:
            assert await exchange(other, [("POST", "/add", add(over, hashes))]) == [(413, refusal)]
        stored = await last_seq_of(nc.jetstream(), config.events_stream, tracker.events_subjects)
        assert stored == 4  # the registration and three adds: nothing of the refused ones
        await assert_exact(nc, nats_server.url, tracker, [SMALL, hashes, [*SMALL[:10], 0]])


def dynamo_add(sequence: int, request_id: str, hashes: list[int], worker_id: int = 1) -> bytes:
    return encode_dynamo(
        DynamoMessage(
            publisher_id=77,
            sequence=sequence,
            published_at_ms=1,
            request_id=request_id,
            worker_id=worker_id,
            router_id=9,
            op="AddRequest",
            token_sequence=hashes,
        )
    )


def dynamo_sized(size: int, sequence: int) -> bytes:
    """A Dynamo AddRequest of exactly ``size`` bytes (100,000 hashes, an id filling the rest)."""
    n = 70_000
    n += size - len(dynamo_add(sequence, "d" * n, WIDE, 3))
    data = dynamo_add(sequence, "d" * n, WIDE, 3)
    assert len(data) == size
    return data


async def test_a_captured_dynamo_long_prompt_is_applied_and_one_over_the_limit_dead_lettered(
    nc: Client, nats_server: NatsServer
) -> None:
    endpoint = "lp.backend.generate"
    config = fresh_config("lpd", dynamo_endpoint=endpoint)
    await ensure(nc, config)
    limit = event_limit(nc.max_payload, config.max_event_bytes)
    messages = [
        dynamo_add(0, "small-hashes", list(range(2**16, 2**16 + 140_000))),  # ~700 KB
        dynamo_add(1, "million", MILLION, 2),
        dynamo_sized(limit, 2),
        dynamo_sized(limit + 1, 3),
        dynamo_sized(nc.max_payload, 4),  # the most NATS takes: captured, cut, refused
        dynamo_add(5, "after", [1, 2, 3]),
    ]
    async with Pipeline(nc, config) as pipeline:
        for data in messages:
            await nc.publish(dynamo_subject(endpoint), data)  # NATS Core, as Dynamo does
        await nc.flush()
        js = nc.jetstream()
        last = await eventually(
            lambda: last_seq_of(js, config.events_stream, config.events_subjects),
            lambda seq: seq >= len(messages),
            what="the captured messages stored",
        )
        await pipeline.wait_applied(last)
        assert pipeline.writer.stats.dead_letters == 2
        assert pipeline.writer.state.publishers.holes == 0  # refused, not lost
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    # The largest cannot be stored with the forwarder's headers: the tail of its hashes is cut
    # (still over the limit, still counted in its publisher's sequence).
    cut = len(fitted(messages[4], nc.max_payload - DELTA_HEADROOM))
    assert limit + 1 < cut < nc.max_payload
    assert [headers[REASON] for _, headers, _ in letters] == [
        f"refused: an event of {size} bytes; its delta would not fit a message (at most "
        f"{limit} bytes of event)"
        for size in (limit + 1, cut)
    ]
    await assert_exact(
        nc, nats_server.url, config, [list(range(2**16, 2**16 + 140_000)), MILLION, WIDE]
    )


async def test_a_projector_refuses_a_server_whose_payload_limit_cannot_hold_a_long_prompts_key(
    tmp_path: Path,
) -> None:
    """On a server of 32 KiB messages an event of 27 KiB can hold 27,000 hashes: a key of
    4,096 of them (32 KiB packed) could never be written, and the bucket would stop at the
    first long prompt. The projector says so at start, in one line, rather than then."""
    conf = tmp_path / "server.conf"
    conf.write_text(f"max_payload: {32 * 1024}\n")
    config = fresh_config("tiny", max_event_bytes=27 * 1024)
    with NatsServer(tmp_path / "js", extra_args=("-c", str(conf))) as server:
        small = await nats.connect(server.url, max_reconnect_attempts=0)
        try:
            with pytest.raises(BucketUnfit) as refused:
                async with Pipeline(small, config):
                    pass
        finally:
            await small.close()
    assert str(refused.value) == (
        f"the server's max_payload of 32,768 bytes is under the {LARGEST_VALUE:,} one bucket "
        "value may take (4,096 hashes of a long prompt beside a request id of up to 4 KiB); "
        "raise nats-server's max_payload"
    )
    assert LARGEST_VALUE == 36_921


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            (),
            "max_event_bytes=1043456: over the 27,648 bytes of event whose delta this server "
            "can store (its max_payload of 32,768 less 5,120); set --max-event-bytes "
            "(SEQSTATE_MAX_EVENT_BYTES) to at most 27648, the same for every fold of the log",
        ),
        (
            ("--max-event-bytes", "27648"),
            f"the server's max_payload of 32,768 bytes is under the {LARGEST_VALUE:,} one "
            "bucket value may take (4,096 hashes of a long prompt beside a request id of up to "
            "4 KiB); raise nats-server's max_payload",
        ),
    ],
)
async def test_serve_http_refuses_a_server_no_trackers_pipeline_can_run_on(
    tmp_path: Path, flags: tuple[str, ...], said: str
) -> None:
    """serve-http on a server of 32 KiB messages served on, and each tracker's pipeline
    failed there silently: a /register waited 15 s for a stream that never took its
    namespace, then answered 503 "no response from stream". It refuses at start, in the
    words ``run`` uses, exit 1."""
    conf = tmp_path / "server.conf"
    conf.write_text(f"max_payload: {32 * 1024}\n")
    config = fresh_config("tinyh")
    with NatsServer(tmp_path / "js", extra_args=("-c", str(conf))) as server:
        result = await run_cli(config, server.url, "serve-http", "--http-port", "0", *flags)
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert plain_lines(result.stderr) == [f"seqstate: error: {said}"]
