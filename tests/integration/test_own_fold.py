"""serve-http's lease holder answers each lifecycle call from its own writer's fold.

What must hold: every answer is what a replay of the stored log decides for that call's event
(same position, same log time), the events went the lease holder's way (one message each,
its msg-id, no outcome read back from the deltas), and an event the server refuses is
answered 503 at once, never guessed."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import msgspec
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_events
from test_slot_service import JSON, get, loads, post, serving

from projector.http.slot_api import AddBody, RequestBody, answer, as_u64
from projector.http.slot_service import SlotService
from projector.http.tracker_names import namespace_for
from projector.nats.connection import connect
from projector.nats.server import NatsServer
from projector.wire.config import Config
from projector.wire.headers import MSG_ID
from seqstate import Fold, Refusal
from seqstate.events import decode_event

M = "m/own"
WORKERS = 3
PROBE_EVERY = 10  # calls between two /potential_loads


def _calls(seed: int, n: int) -> list[tuple[str, dict[str, Any]]]:
    """Adds (some duplicates), marks and frees, some of ids never added."""
    rng = random.Random(seed)
    live: list[str] = []
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.5 or not live:
            rid = rng.choice(live) if live and rng.random() < 0.15 else f"r{i}"
            body = {
                "model_name": M,
                "request_id": rid,
                "worker_id": rng.randrange(WORKERS + 1),  # one worker is never registered
                "dp_rank": 0,
                "sequence_hashes": [rng.randrange(-(2**63), 2**63) for _ in range(3)],
                "new_isl_tokens": rng.choice([0, 64, 300]),
            }
            out.append(("/add", body))
            live.append(rid)
        elif roll < 0.7:
            out.append(("/prefill_complete", {"model_name": M, "request_id": rng.choice(live)}))
        else:
            rid = rng.choice(live) if rng.random() < 0.9 else "ghost"
            out.append(("/free", {"model_name": M, "request_id": rid}))
    return out


async def _holding(service: SlotService) -> None:
    """Until the tracker's lease holder (this process) answers from its own fold."""
    tracker = service.trackers[namespace_for(M, "default", service.config.namespace)]

    async def ready() -> bool:
        service._commit(tracker)  # opens it once the pipeline runs
        return tracker.own is not None

    await eventually(ready, bool, what="the lease holder's own fold")


async def _registered_and_holding(service: SlotService) -> None:
    """WORKERS workers registered, and this process answering from its own fold."""
    for worker in range(WORKERS):
        status, _ = await post(
            service,
            "/register",
            model_name=M,
            worker_id=worker,
            block_size=16,
            dp_start=0,
            dp_size=1,
        )
        assert status == 201
    await _holding(service)


def _tracker_config(config: Config) -> Config:
    """The tracker's namespace as serve-http folds it."""
    tracker = config.with_namespace(namespace_for(M, "default", config.namespace))
    return dataclasses.replace(tracker, rules="slot-tracker", worker_grace_s=0.0)


async def test_every_answer_is_what_a_replay_of_the_log_decides(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("of")
    work = _calls(23, 300)
    probe = {"model_name": M, "sequence_hashes": work[0][1]["sequence_hashes"][:2]}
    probe["new_isl_tokens"] = 100
    answers, potentials = [], []
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        for n, (path, body) in enumerate(work, 1):
            answers.append(await service.call("POST", path, {}, JSON, msgspec.json.encode(body)))
            if n % PROBE_EVERY == 0:  # read from the same fold, at once
                potential = msgspec.json.encode(probe)
                potentials.append(
                    await service.call("POST", "/potential_loads", {}, JSON, potential)
                )
    tracker = _tracker_config(config)
    js = nc.jetstream()
    fold = Fold(tracker.new_state(), tracker.fold_rules)
    expected, expected_potentials = [], []
    hashes = [as_u64(h) for h in probe["sequence_hashes"]]
    for seq, at_ns, subject, data in await read_events(nc, tracker):
        verdict = fold(seq, at_ns, subject, data)
        headers = (await js.get_msg(tracker.events_stream, seq)).headers or {}
        if not headers.get(MSG_ID, "").startswith("fold-"):
            continue  # the registrations, and ticks: not the holder's own calls
        assert type(verdict) is not Refusal, verdict
        expected.append((verdict.outcome, verdict.owner, verdict.block_size))
        if len(expected) % PROBE_EVERY == 0:
            state = fold.state
            rows = state.registry.potential_loads(hashes, 100, state.now_ns)
            expected_potentials.append((200, rows))
    assert msgspec.json.encode(potentials) == msgspec.json.encode(expected_potentials)
    assert len(expected) == len(work), "every lifecycle call went the lease holder's way"
    decoders = {"/add": AddBody, "/prefill_complete": RequestBody, "/free": RequestBody}
    statuses = set()
    for (path, body), got, (outcome, owner, block_size) in zip(
        work, answers, expected, strict=True
    ):
        parsed = msgspec.convert(body, decoders[path])
        want = answer(path, parsed, outcome, owner=owner, block_size=block_size)
        assert msgspec.json.encode(got) == msgspec.json.encode(want), (path, body)
        statuses.add(got[0])
    assert statuses == {200, 201, 404, 409}  # the run met every kind of answer


async def test_an_event_the_server_refuses_is_answered_503_at_once(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("or")
    async with serving(nats_server.url, config) as service:
        status, _ = await post(
            service, "/register", model_name=M, worker_id=1, block_size=16, dp_start=0, dp_size=1
        )
        assert status == 201
        await _holding(service)
        js = nc.jetstream()
        info = await js.stream_info(config.events_stream)
        full = info.config
        full.max_msgs = info.state.messages  # discard new: the next event is refused
        await js.update_stream(full)
        add = {
            "model_name": M,
            "request_id": "x",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": [1],
        }
        status, body = await post(service, "/add", **add)
        assert status == 503 and "not stored" in body["error"], body
        assert (await js.stream_info(config.events_stream)).state.messages == info.state.messages
        full.max_msgs = -1
        await js.update_stream(full)
        assert await post(service, "/add", **add) == (201, {"status": "ok"})


async def test_a_refused_event_is_503_through_a_process_that_does_not_hold_the_lease(
    nc: Client, nats_server: NatsServer
) -> None:
    """The other door of a call: a process that does not hold the tracker's lease publishes
    with RouterPublisher, whose PublishError (a full stream, a full disk) is a 503 saying why,
    never a 500 "internal error"."""
    config = fresh_config("or2")
    async with serving(nats_server.url, config) as holder:
        register = {"worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await post(holder, "/register", model_name=M, **register))[0] == 201
        await _holding(holder)
        async with serving(nats_server.url, config) as other:
            js = nc.jetstream()
            info = await js.stream_info(config.events_stream)
            full = info.config
            full.max_msgs = info.state.messages  # discard new: the next event is refused
            await js.update_stream(full)
            add = {"model_name": M, "request_id": "y", "worker_id": 1, "sequence_hashes": [1]}
            status, body = await post(other, "/add", **add, dp_rank=0)
            assert status == 503, body
            assert body["error"].startswith("not stored: AddRequest for request 'y'"), body
            assert "the stream is full" in body["error"], body
            assert other.trackers[namespace_for(M, "default", config.namespace)].own is None
            full.max_msgs = -1
            await js.update_stream(full)
            assert await post(other, "/add", **add, dp_rank=0) == (201, {"status": "ok"})


async def test_a_server_restart_mid_run_leaves_the_answers_and_loads_a_replay_of_the_log(
    tmp_path: Path,
) -> None:
    """nats-server stops and comes back while the lease holder answers calls: every call is
    answered (a 503 at worst, never a wrong status), and afterwards ``/loads`` is what one
    fold of the stored log gives."""
    server = NatsServer(tmp_path / "js")
    await asyncio.to_thread(server.start)
    again: NatsServer | None = None
    config = fresh_config("os")
    try:
        async with connect(server.url, service=True, config=config) as nc:
            service = await SlotService(nc, config, outcome_wait_s=10.0).start()
            try:
                await _registered_and_holding(service)
                work = _calls(7, 240)
                answers: list[tuple[int, object]] = []

                async def run() -> None:
                    for path, body in work:
                        answers.append(
                            await service.call("POST", path, {}, JSON, msgspec.json.encode(body))
                        )

                calls = asyncio.create_task(run())
                await eventually(lambda: len(answers) >= 80, bool, what="80 calls answered")
                await asyncio.to_thread(server.stop)
                again = NatsServer(server.store_dir, port=server.port)
                await asyncio.to_thread(again.start)
                await asyncio.wait_for(calls, 120)
                assert {status for status, _ in answers} <= {200, 201, 404, 409, 503}
                assert sum(status != 503 for status, _ in answers) >= 200
                tracker = _tracker_config(config)
                fold = Fold(tracker.new_state(), tracker.fold_rules)
                at = 0
                for seq, at_ns, subject, data in await read_events(nc, tracker):
                    fold(seq, at_ns, subject, data)
                    at = at_ns
                want = [
                    (M, r.worker_id, r.dp_rank, r.active_prefill_tokens, r.active_blocks)
                    for r in fold.state.registry.loads(at)
                ]

                async def loads_now() -> list[tuple[Any, ...]]:
                    status, body = await get(service, "/loads")
                    assert status == 200
                    return loads(body)

                await eventually(loads_now, lambda got: got == want, what="/loads = the replay")
            finally:
                await service.stop()
    finally:
        await asyncio.to_thread((again or server).stop)


async def test_concurrent_calls_go_out_by_group_commit_each_answered_by_its_own_fold(
    nc: Client, nats_server: NatsServer
) -> None:
    """Calls that come while the lease holder's last events wait for their acks gather and go
    out together, in the order they came, each answered from its own event's fold: 64 adds
    begun at once are two group commits (the first alone, at once; the other 63 together)."""
    config = fresh_config("og")
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        own = service.trackers[namespace_for(M, "default", config.namespace)].own
        assert own is not None
        before = own.commits, own.committed
        adds = [
            {
                "model_name": M,
                "request_id": f"g{i}",
                "worker_id": i % (WORKERS + 1),  # one worker is never registered: 404s
                "dp_rank": 0,
                "sequence_hashes": [i, i + 1],
                "new_isl_tokens": 16,
            }
            for i in range(64)
        ]
        answers = await asyncio.gather(
            *(service.call("POST", "/add", {}, JSON, msgspec.json.encode(a)) for a in adds)
        )
        assert (own.commits - before[0], own.committed - before[1]) == (2, 64)
    tracker = _tracker_config(config)
    fold = Fold(tracker.new_state(), tracker.fold_rules)
    stored = []
    for seq, at_ns, subject, data in await read_events(nc, tracker):
        verdict = fold(seq, at_ns, subject, data)
        rid = getattr(decode_event(data), "request_id", "")
        if rid.startswith("g"):
            assert type(verdict) is not Refusal, verdict
            stored.append((rid, verdict.outcome))
    assert [rid for rid, _ in stored] == [a["request_id"] for a in adds]  # in the calls' order
    for a, got, (_, outcome) in zip(adds, answers, stored, strict=True):
        assert got == answer("/add", msgspec.convert(a, AddBody), outcome)
    assert sorted({status for status, _ in answers}) == [201, 404]


async def test_the_projector_beside_the_writer_asks_the_server_nothing_per_delta(
    nc: Client, nats_server: NatsServer
) -> None:
    """The lease holder's projector checks that each delta names an event the events stream
    holds. The writer beside it folded that event from the stream, so it asks the server
    nothing: 40 calls one after another, each its own delta message, and no request for the
    events stream's info (the ticks and lag checks, which read it too, are set far apart)."""
    config = fresh_config("op", idle_tick_s=3600.0, tick_every_s=3600.0, lag_check_s=3600.0)
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        tracker = service.trackers[namespace_for(M, "default", config.namespace)]
        lookups: list[str] = []

        async def count(msg: Any) -> None:
            lookups.append(msg.subject)

        sub = await nc.subscribe(f"$JS.API.STREAM.INFO.{config.events_stream}", cb=count)
        await nc.flush()
        for i in range(40):
            add = {"model_name": M, "request_id": f"p{i}", "worker_id": 1, "dp_rank": 0}
            assert (await post(service, "/add", **add, sequence_hashes=[i]))[0] == 201
        pipeline = tracker.standby.pipeline
        assert pipeline is not None
        await tracker.view.wait_for(pipeline.writer.stats.last_seq, 10)  # every delta applied
        await nc.flush()
        await sub.unsubscribe()
        assert lookups == []
