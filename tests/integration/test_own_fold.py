"""serve-http's lease holder answers each lifecycle call from its own writer's fold.

What must hold: every answer is what a replay of the stored log decides for that call's event
(same position, same log time), the events went the lease holder's way (its msg-ids, no
outcome read back from the deltas; calls that come together stored as record batches, one
message per subject, a lone call a plain message), and an event the server refuses is
answered 503 at once, never guessed."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import msgspec
from eventually import eventually
from http_kit import exchange
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_events, read_stream
from test_slot_service import JSON, get, loads, post, serving

from projector.http.http_server import serve
from projector.http.slot_api import AddBody, RequestBody, answer, as_u64
from projector.http.slot_service import SlotService
from projector.http.tracker_names import namespace_for
from projector.nats.connection import connect
from projector.nats.resources import dead_letter_stream
from projector.nats.server import NatsServer
from projector.settings.config import Config
from projector.wire.headers import MSG_ID, SOURCE_INDEX, SOURCE_SEQ
from seqstate import Delta, Fold, Refusal
from seqstate.batches import decode_batch, is_batch
from seqstate.events import Event, decode_event
from seqstate.fold import Verdict

M = "m/own"
WORKERS = 3
PROBE_EVERY = 10  # calls between two /potential_loads


def _calls(seed: int, n: int, ids: str = "r") -> list[tuple[str, dict[str, Any]]]:
    """Adds (some duplicates), marks and frees, some of ids never added; request ids start
    with ``ids``."""
    rng = random.Random(seed)
    live: list[str] = []
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.5 or not live:
            rid = rng.choice(live) if live and rng.random() < 0.15 else f"{ids}{i}"
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
            rid = rng.choice(live) if rng.random() < 0.9 else f"{ids}ghost"
            out.append(("/free", {"model_name": M, "request_id": rid}))
    return out


async def _holding(service: SlotService) -> None:
    """Until the tracker's lease holder (this process) answers from its own fold."""
    tracker = service.trackers[namespace_for(M, "default", service.config.namespace)]

    async def ready() -> bool:
        service._trackers.own_fold(tracker)  # opens it once the pipeline runs
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


def _add(rid: str, worker: int, **more: Any) -> bytes:
    body = {"model_name": M, "request_id": rid, "worker_id": worker, "dp_rank": 0}
    body["sequence_hashes"] = [1]
    body.update(more)
    return msgspec.json.encode(body)


async def _stored_by_holder(
    nc: Client, tracker: Config
) -> list[tuple[int, str, list[tuple[Event, Verdict]]]]:
    """The lease holder's messages as one fold of the log decides them: (sequence, subject,
    each event with its verdict: a record batch's in order, a plain message's alone)."""
    js = nc.jetstream()
    fold = Fold(tracker.new_state(), tracker.fold_rules)
    out = []
    for seq, at_ns, subject, data in await read_events(nc, tracker):
        verdict = fold(seq, at_ns, subject, data)
        headers = (await js.get_msg(tracker.events_stream, seq)).headers or {}
        if not headers.get(MSG_ID, "").startswith("fold-"):
            continue  # the registrations, and ticks: not the holder's own calls
        if is_batch(data):
            assert isinstance(verdict, list)
            events = [decode_event(item) for item in decode_batch(data)]
            out.append((seq, subject, list(zip(events, verdict, strict=True))))
        else:
            assert not isinstance(verdict, list)
            out.append((seq, subject, [(decode_event(data), verdict)]))
    return out


async def test_concurrent_calls_go_out_as_record_batches_each_answered_by_its_own_fold(
    nc: Client, nats_server: NatsServer
) -> None:
    """Calls that come while the lease holder's last events wait for their acks gather and go
    out together as record batches, one per subject, each call answered from its own event's
    verdict in its batch: 64 adds begun at once are two group commits (the first alone, at
    once, a plain message; the other 63 together) and five stored messages (the 63 on four
    workers' subjects), each subject's events in the calls' order."""
    config = fresh_config("og")
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        own = service.trackers[namespace_for(M, "default", config.namespace)].own
        assert own is not None
        before = own.commits, own.committed, own.messages
        # one worker (WORKERS) is never registered: 404s
        adds = [
            _add(f"g{i}", i % (WORKERS + 1), sequence_hashes=[i, i + 1], new_isl_tokens=16)
            for i in range(64)
        ]
        answers = await asyncio.gather(*(service.call("POST", "/add", {}, JSON, a) for a in adds))
        assert (own.commits, own.committed, own.messages) == (
            before[0] + 2,
            before[1] + 64,
            before[2] + 5,
        )
    stored = await _stored_by_holder(nc, _tracker_config(config))
    assert [len(events) for _, _, events in stored] == [1, 16, 16, 16, 15]  # g0; g1, g2, g3, g4
    outcomes = {}
    for _, subject, events in stored:
        ids = [int(event.request_id[1:]) for event, _ in events]  # type: ignore[union-attr]
        assert ids == sorted(ids) and {i % (WORKERS + 1) for i in ids} == {ids[0] % 4}, subject
        for index, (event, verdict) in enumerate(events):
            assert type(verdict) is Delta and verdict.index == (index if len(events) > 1 else 0)
            outcomes[event.request_id] = verdict.outcome  # type: ignore[union-attr]
    for i, (add, got) in enumerate(zip(adds, answers, strict=True)):
        assert got == answer("/add", msgspec.json.decode(add, type=AddBody), outcomes[f"g{i}"])
    assert sorted({status for status, _ in answers}) == [201, 404]


async def test_concurrent_callers_answers_are_what_a_replay_of_the_log_decides(
    nc: Client, nats_server: NatsServer
) -> None:
    """Six callers at once, each making its calls one after another (adds, duplicates,
    marks, frees, ids never added): their calls are stored in record batches, and each
    answer is what one fold of the log decides for that call's event, each caller's events
    in the order of its calls."""
    config = fresh_config("oc")
    works = {f"c{k}-": _calls(100 + k, 60, f"c{k}-") for k in range(6)}
    answers: dict[str, list[tuple[int, object]]] = {ids: [] for ids in works}
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        own = service.trackers[namespace_for(M, "default", config.namespace)].own
        assert own is not None
        before = own.committed, own.messages

        async def caller(ids: str) -> None:
            for path, body in works[ids]:
                encoded = msgspec.json.encode(body)
                answers[ids].append(await service.call("POST", path, {}, JSON, encoded))

        await asyncio.gather(*(caller(ids) for ids in works))
        committed, messages = own.committed - before[0], own.messages - before[1]
    # the first five calls, gathered behind the very first, fall on at most four subjects
    assert committed == 360 and messages < committed
    stored = await _stored_by_holder(nc, _tracker_config(config))
    assert len(stored) == messages and sum(len(events) for _, _, events in stored) == 360
    decided: dict[str, list[Verdict]] = {ids: [] for ids in works}
    for _, _, events in stored:
        for event, verdict in events:
            assert type(verdict) is not Refusal, verdict
            decided[event.request_id.partition("-")[0] + "-"].append(verdict)  # type: ignore[union-attr]
    decoders = {"/add": AddBody, "/prefill_complete": RequestBody, "/free": RequestBody}
    for ids, work in works.items():
        for (path, body), got, verdict in zip(work, answers[ids], decided[ids], strict=True):
            outcome, owner = verdict.outcome, verdict.owner  # type: ignore[union-attr]
            want = answer(path, msgspec.convert(body, decoders[path]), outcome, owner=owner)
            assert msgspec.json.encode(got) == msgspec.json.encode(want), (path, body)


async def test_calls_pipelined_on_a_connection_are_stored_in_their_order(
    nc: Client, nats_server: NatsServer
) -> None:
    """A connection's calls are stored in the order it sent them, across subjects: pipelined
    behind a first add (alone, at once), ``y`` and ``z`` on worker 1 share a batch, ``x`` on
    worker 2 goes after them, and ``x`` again on worker 1 may not join the batch before it:
    it is stored after, so it is the duplicate (409, naming worker 2), as sent."""
    config = fresh_config("oo")
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        own = service.trackers[namespace_for(M, "default", config.namespace)].own
        assert own is not None
        before = own.committed, own.messages
        listener = await serve(service, "127.0.0.1", 0)
        try:
            calls = [(0, "p"), (1, "y"), (1, "z"), (2, "x"), (1, "x")]
            replies = await exchange(
                listener.port,
                [("POST", "/add", msgspec.json.decode(_add(rid, worker))) for worker, rid in calls],
            )
        finally:
            await listener.close()
        assert (own.committed - before[0], own.messages - before[1]) == (5, 4)
    duplicate = (
        "Request x already exists (assigned to worker WorkerWithDpRank { "
        "worker_id: 2, dp_rank: 0 })"
    )
    assert [tuple(reply) for reply in replies] == [
        *[(201, {"status": "ok"})] * 4,
        (409, {"error": duplicate}),
    ]
    stored = await _stored_by_holder(nc, _tracker_config(config))
    assert [[getattr(e, "request_id", "") for e, _ in events] for _, _, events in stored] == [
        ["p"],
        ["y", "z"],
        ["x"],
        ["x"],
    ]


async def test_an_event_refused_in_a_batch_is_answered_as_it_is_alone(
    nc: Client, nats_server: NatsServer
) -> None:
    """An add that would take its rank's prefill tokens past u64 is refused by the fold: alone
    (a plain message) and within a record batch (its neighbour in the batch applies) its call
    gets the same answer, and its dead letter names its place in the batch."""
    config = fresh_config("ob")
    big = 2**64 - 1
    async with serving(nats_server.url, config) as service:
        await _registered_and_holding(service)
        own = service.trackers[namespace_for(M, "default", config.namespace)].own
        assert own is not None
        assert await service.call(
            "POST", "/add", {}, JSON, _add("full", 1, new_isl_tokens=big)
        ) == (
            201,
            {"status": "ok"},
        )
        alone = await service.call("POST", "/add", {}, JSON, _add("o1", 1, new_isl_tokens=big))
        assert alone == answer("/add", msgspec.json.decode(_add("o1", 1), type=AddBody), None)
        before = own.committed, own.messages
        calls = [_add("first", 2), _add("o2", 1, new_isl_tokens=big), _add("next", 1)]
        answers = await asyncio.gather(*(service.call("POST", "/add", {}, JSON, c) for c in calls))
        assert (own.committed - before[0], own.messages - before[1]) == (3, 2)
        assert answers == [(201, {"status": "ok"}), alone, (201, {"status": "ok"})]
    tracker = _tracker_config(config)
    stored = await _stored_by_holder(nc, tracker)
    assert [
        ([getattr(event, "request_id", "") for event, _ in events], [type(v) for _, v in events])
        for _, _, events in stored
    ] == [
        (["full"], [Delta]),
        (["o1"], [Refusal]),
        (["first"], [Delta]),
        (["o2", "next"], [Refusal, Delta]),
    ]
    letters = await read_stream(nc, dead_letter_stream(tracker), tracker.dead_letter_subject)
    assert [(int(h[SOURCE_SEQ]), h.get(SOURCE_INDEX)) for _, h, _ in letters] == [
        (stored[1][0], None),  # "o1", alone
        (stored[3][0], "0"),  # "o2", first of its batch
    ]


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
