"""Dynamo's own replica-sync traffic through the whole ledger on a real server.

The shared capture's 155 real messages (two KV-router frontends with replica sync, two
mockers, one with dp 2) are published again on NATS Core, on Dynamo's own subject, as Dynamo
publishes them. A pipeline whose namespace captures the endpoint folds them; the bucket, the
CLI's ``loads`` and ``replay --verify`` agree with one fold of the capture in the core; a
hole is named; ``seqstate dynamo resync`` republishes the requests in flight in Dynamo's wire
format under seqstate's own publisher id, and the ledger ignores them.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from dynamo_capture import CAPTURE, EDGES, ENDPOINT, SUBJECT
from log_text import plain_lines
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pipeline_kit import fresh_config, logged, read_events, read_stream, run_cli, where
from prometheus_client import generate_latest

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.ops.metrics import Metrics
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.headers import REASON
from seqstate import Fold, SequenceState
from seqstate.dynamo import (
    ADD,
    MARK,
    captured_subject,
    decode_dynamo,
    dynamo_subject,
    resync_publisher_id,
)
from seqstate.fold import UNDECODABLE

HALF = 60  # messages of the capture published before the checks in flight


def reference(config: Config, count: int) -> SequenceState:
    """The capture's first ``count`` messages folded by the one fold, in the core."""
    fold = Fold(config.new_state(), config.fold_rules)
    subject = captured_subject(config.namespace, ENDPOINT)
    for seq, message in enumerate(CAPTURE[:count], 1):
        fold(seq, message.t_ns, subject, message.data)
    return fold.state


def ranks(state: SequenceState) -> dict[tuple[int, int], tuple[int, int]]:
    """(active requests, active blocks) per rank with anything active."""
    rows = state.registry.loads(state.now_ns)
    return {
        (r.worker_id, r.dp_rank): (r.active_requests, r.active_blocks)
        for r in rows
        if r.active_requests
    }


async def publish(nc: Client, messages: list[bytes], subject: str = SUBJECT) -> None:
    for data in messages:
        await nc.publish(subject, data)  # NATS Core: no ack, as Dynamo publishes
    await nc.flush()


def loads_json(out: str) -> dict[tuple[int, int], tuple[int, int]]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {
        (r["worker_id"], r["dp_rank"]): (r["active_requests"], r["active_blocks"])
        for r in rows
        if r["active_requests"]
    }


async def test_the_capture_folds_through_the_pipeline_as_in_the_core(
    nc: Client, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    config = fresh_config("dyn", dynamo_endpoint=ENDPOINT, idle_tick_s=3600.0)
    await ensure(nc, config)
    url = nats_server.url
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, [m.data for m in CAPTURE[:HALF]])
        last = await logged(nc, config, HALF)
        await pipeline.wait_applied(last)
        want = ranks(reference(config, HALF))
        assert want, "the first half of the capture has requests in flight"
        assert max(w for w, _ in want) > 2**63  # worker ids above 2^63, through every path
        state = pipeline.writer.state
        state.sync_registry()
        assert ranks(state) == want
        out = await run_cli(config, url, "loads", "--json")
        assert out.returncode == 0, out.stderr
        assert loads_json(out.stdout) == want

        # inspect finds a Dynamo request: active, on its rank, its events on its subject.
        rid, rank = sorted(reference(config, HALF).requests.owner.items())[0]
        out = await run_cli(config, url, "inspect", "request", rid, "--json", "--no-progress")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["state"], report["worker_id"], report["dp_rank"]) == ("active", *rank)
        assert report["searched"]["subject"] == captured_subject(config.namespace, ENDPOINT)
        assert [e["type"] for e in report["events"]][:1] == ["AddRequest"], report
        assert report["events"][0]["outcome"] == "applied", report
        out = await run_cli(config, url, "inspect", "worker", str(rank[0]), "--json")
        assert out.returncode == 0, out.stderr

        # A late frontend's resync: the requests in flight, in Dynamo's wire format.
        sub = await nc.subscribe(SUBJECT)
        out = await run_cli(config, url, "dynamo", "resync", "--dynamo-endpoint", ENDPOINT)
        assert out.returncode == 0, out.stderr
        live = sum(n for n, _ in want.values())
        assert f"resynced {live} requests in flight" in out.stdout, out.stdout
        reference_state = reference(config, HALF)
        marked = {
            rid
            for rid, rank in reference_state.requests.owner.items()
            if reference_state.workers.slots[rank].requests[rid].marked
        }
        republished = [decode_dynamo(msg.data) for msg in await take(sub, live + len(marked))]
        await sub.unsubscribe()
        assert {m.publisher_id for m in republished} == {resync_publisher_id(config.namespace)}
        assert [m.sequence for m in republished] == list(range(len(republished)))
        adds = [m for m in republished if m.op == ADD]
        assert {m.request_id for m in adds} == set(reference_state.requests.owner)
        assert {m.request_id for m in republished if m.op == MARK} == marked
        # A mistyped endpoint is said, never "resynced 0 requests", exit 0: nothing is sent.
        typo = ENDPOINT[:-1]
        out = await run_cli(config, url, "dynamo", "resync", "--dynamo-endpoint", typo)
        assert (out.returncode, out.stdout) == (1, ""), out.stdout
        assert plain_lines(out.stderr) == [
            f"seqstate: error: namespace {config.namespace!r} does not capture Dynamo endpoint "
            f"{typo}; it captures {ENDPOINT}"
        ]
        # The ledger takes its own republished messages as echoes: nothing changes.
        after = await logged(nc, config, HALF + len(republished))
        await pipeline.wait_applied(after)
        pipeline.writer.state.sync_registry()
        assert ranks(pipeline.writer.state) == want

        # The rest of the capture, but for one message of a frontend: a hole, named.
        rest = [m.data for m in CAPTURE[HALF:]]
        dropped = next(i for i, d in enumerate(rest) if decode_dynamo(d).op == ADD)
        lost = decode_dynamo(rest.pop(dropped))
        revealed = next(  # the publisher's next message reveals the hole
            i
            for i, data in enumerate(rest)
            if i >= dropped and decode_dynamo(data).publisher_id == lost.publisher_id
        )
        await publish(nc, rest)
        last = await logged(nc, config, HALF + len(republished) + len(rest))
        await pipeline.wait_applied(last)
        publishers = pipeline.writer.state.publishers
        assert publishers.holes == 1 and publishers[lost.publisher_id].holes == 1
        said = [r.getMessage() for r in caplog.records if "lost 1 message" in r.getMessage()]
        at = where(await read_events(nc, config), rest[revealed])  # <seq>, or <seq>#<index>
        assert said == [
            f"Dynamo publisher {lost.publisher_id} lost 1 message (its sequence "
            f"{lost.sequence} on) before event {at}: what they added, "
            "marked or "
            "freed stays wrong until a Free or expiry"
        ]
        metrics = Metrics()
        metrics.follow("writer", lambda: [pipeline.writer])
        scraped = generate_latest(metrics.registry).decode()
        ns = config.namespace
        assert f'seqstate_dynamo_publishers{{namespace="{ns}"}} 4.0' in scraped
        big = max(w for w, _ in want)  # a worker id above 2^63, exact in its labels
        assert f'seqstate_worker_active_blocks{{dp_rank="0",namespace="{ns}",worker="{big}"}}' in (
            scraped
        )
        for publisher in ("all", str(lost.publisher_id)):
            assert (
                f'seqstate_dynamo_messages_lost_total{{namespace="{ns}",publisher="{publisher}"}}'
                " 1.0"
            ) in scraped, scraped
    out = await run_cli(config, url, "status")
    assert out.returncode == 0, out.stderr
    assert f"publisher {lost.publisher_id}: 1 message lost" in out.stdout, out.stdout
    out = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout


async def test_an_operators_edge_is_dead_lettered_with_its_reason_and_the_writer_goes_on(
    nc: Client, nats_server: NatsServer
) -> None:
    """An empty request id and a message of another topic, on the endpoint's subject among
    real traffic: the writer dead-letters each with the
    fold's reason (``undecodable``), counts them, folds the AddRequest after them, and replay
    finds the bucket identical."""
    endpoint = "edge.backend.generate"  # the module's other namespace captures ENDPOINT
    config = fresh_config("edge", dynamo_endpoint=endpoint, idle_tick_s=3600.0)
    await ensure(nc, config)
    edges = [data for data, _ in EDGES.values()]
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, [*edges, CAPTURE[0].data], dynamo_subject(endpoint))
        await pipeline.wait_applied(await logged(nc, config, len(edges) + 1))
        writer = pipeline.writer
        assert {kind: n for kind, n in writer.dead_letters.counts.items() if n} == {
            UNDECODABLE: len(EDGES)
        }
        assert list(writer.state.requests.owner) == [decode_dynamo(CAPTURE[0].data).request_id]
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    # alone, or in a burst the forwarder stored as a batch (then each names its index)
    reasons = [re.sub(r"^event \d+ of the batch: ", "", h[REASON]) for _, h, _ in letters]
    assert reasons == [reason for _, reason in EDGES.values()]
    assert [data for *_, data in letters] == edges  # each as it was stored
    out = await run_cli(config, nats_server.url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout


async def take(sub: Subscription, count: int) -> list[Msg]:
    """The next ``count`` messages the subscription receives."""
    return [await sub.next_msg(timeout=10) for _ in range(count)]
