"""The slot-tracker drop-in's logic (SlotService.call) on a real server and pipeline: Dynamo's
scenarios with their exact statuses, texts and numbers, each status the writer's real outcome;
and two serving processes on one stream answering alike."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.http.slot_service import SlotService
from projector.http.tracker_names import namespace_for
from projector.nats.server import NatsServer
from projector.settings.config import Config

JSON = "application/json"


@contextlib.asynccontextmanager
async def serving(url: str, config: Config) -> AsyncIterator[SlotService]:
    nc = await nats.connect(url)
    service = await SlotService(nc, config).start()
    try:
        yield service
    finally:
        await service.stop()
        await nc.close()


async def post(service: SlotService, path: str, **body: Any) -> tuple[int, Any]:
    status, payload = await service.call("POST", path, {}, JSON, msgspec.json.encode(body))
    return status, json.loads(msgspec.json.encode(payload))


async def get(service: SlotService, path: str, **query: str) -> tuple[int, Any]:
    status, payload = await service.call("GET", path, query, None, b"")
    return status, json.loads(msgspec.json.encode(payload))


def loads(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (
            r["model_name"],
            r["worker_id"],
            r["dp_rank"],
            r["active_prefill_tokens"],
            r["active_decode_blocks"],
        )
        for r in rows
    ]


async def test_dynamos_scenarios_with_their_statuses_and_numbers(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("ss")
    async with serving(nats_server.url, config) as s:
        m = {"model_name": "m/1"}
        where = "model=m/1 routing_group=default"
        reg = {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}
        assert await post(s, "/register", **reg) == (201, {"status": "ok"})
        assert await post(s, "/register", **reg) == (
            409,
            {"error": f"worker 1 already registered for {where}"},
        )
        mismatch = f"block_size mismatch for {where}: existing=16, requested=32"
        assert await post(s, "/register", **{**reg, "worker_id": 2, "block_size": 32}) == (
            409,
            {"error": mismatch},
        )
        assert await get(s, "/workers") == (
            200,
            [
                {
                    "worker_id": 1,
                    "model_name": "m/1",
                    "routing_group": "default",
                    "block_size": 16,
                    "dp_start": 0,
                    "dp_size": 2,
                }
            ],
        )
        add = {**m, "worker_id": 1, "dp_rank": 0}
        assert await post(
            s, "/add", **add, request_id="r1", sequence_hashes=[1, 2, 3], new_isl_tokens=100
        ) == (201, {"status": "ok"})
        assert await post(
            s, "/add", **add, request_id="r2", sequence_hashes=[1, 2, -4], new_isl_tokens=50
        ) == (201, {"status": "ok"})
        assert loads((await get(s, "/loads"))[1]) == [("m/1", 1, 0, 150, 4), ("m/1", 1, 1, 0, 0)]
        assert await post(
            s, "/add", **{**add, "dp_rank": 1}, request_id="r1", sequence_hashes=[]
        ) == (
            409,
            {
                "error": (
                    "Request r1 already exists (assigned to worker WorkerWithDpRank { "
                    "worker_id: 1, dp_rank: 0 })"
                )
            },
        )
        assert await post(
            s, "/add", **{**add, "dp_rank": 7}, request_id="r1", sequence_hashes=[]
        ) == (404, {"error": ("Worker WorkerWithDpRank { worker_id: 1, dp_rank: 7 } not found")})
        for _ in range(2):  # idempotent
            assert await post(s, "/prefill_complete", **m, request_id="r1") == (
                200,
                {"status": "ok"},
            )
        assert loads((await get(s, "/loads", model_name="m/1"))[1])[0] == ("m/1", 1, 0, 50, 4)
        assert await post(s, "/prefill_complete", **m, request_id="ghost") == (
            404,
            {"error": "Request ghost not found"},
        )
        status, rows = await post(
            s, "/potential_loads", **m, sequence_hashes=[1, 2, 9], new_isl_tokens=10
        )
        assert status == 200 and [
            (
                r["dp_rank"],
                r["potential_prefill_tokens"],
                r["potential_decode_blocks"],
                r["active_requests"],
            )
            for r in rows
        ] == [(0, 60, 5, 2), (1, 10, 3, 0)]
        for _ in range(2):  # a free of an id no longer live is 200 too
            assert await post(s, "/free", **m, request_id="r1") == (200, {"status": "ok"})
        assert loads((await get(s, "/loads"))[1])[0] == ("m/1", 1, 0, 50, 3)
        assert await post(s, "/unregister", **m, worker_id=1) == (200, {"status": "ok"})
        assert (await get(s, "/loads"))[1] == []  # the last worker: the tracker is gone
        assert await post(s, "/add", **add, request_id="r3", sequence_hashes=[1]) == (
            404,
            {"error": f"no slot tracker for {where}"},
        )
        assert await post(s, "/unregister", **m, worker_id=1) == (
            404,
            {"error": f"worker 1 not found for {where}"},
        )
        assert await post(s, "/register", **{**reg, "block_size": 32}) == (201, {"status": "ok"})
        assert await post(s, "/free", model_name="never", request_id="x") == (
            404,
            {"error": "no slot tracker for model=never routing_group=default"},
        )


async def test_the_extractor_and_router_errors(nc: Client, nats_server: NatsServer) -> None:
    async with serving(nats_server.url, fresh_config("se")) as s:
        body = b'{"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0}'
        assert (await s.call("POST", "/add", {}, None, body))[0] == 415
        assert (await s.call("POST", "/add", {}, "text/plain", body))[0] == 415
        assert (await s.call("POST", "/add", {}, JSON, b"{bad"))[0] == 400
        status, error = await s.call("POST", "/add", {}, JSON, body)
        assert status == 422 and "sequence_hashes" in str(error)
        assert await s.call("GET", "/nowhere", {}, None, b"") == (404, {"error": "route not found"})
        assert await s.call("GET", "/add", {}, None, b"") == (405, {"error": "method not allowed"})
        assert await s.call("GET", "/health", {}, None, b"") == (200, None)
        assert (
            await post(
                s, "/register", model_name="m", worker_id=1, block_size=0, dp_start=0, dp_size=1
            )
        ) == (400, {"error": "block_size must be greater than 0"})


async def test_two_serving_processes_on_one_stream_answer_alike(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("s2")
    async with serving(nats_server.url, config) as one, serving(nats_server.url, config) as two:
        await post(
            one, "/register", model_name="a", worker_id=1, block_size=16, dp_start=0, dp_size=1
        )
        # The second learns of the tracker from the bucket at its first call.
        assert await post(
            two,
            "/add",
            model_name="a",
            request_id="x",
            worker_id=1,
            dp_rank=0,
            sequence_hashes=[5, 6],
        ) == (201, {"status": "ok"})
        assert await post(
            one, "/add", model_name="a", request_id="x", worker_id=1, dp_rank=0, sequence_hashes=[7]
        ) == (
            409,
            {
                "error": (
                    "Request x already exists (assigned to worker WorkerWithDpRank { "
                    "worker_id: 1, dp_rank: 0 })"
                )
            },
        )
        await post(
            two, "/register", model_name="b", worker_id=9, block_size=8, dp_start=0, dp_size=1
        )
        await post(
            one,
            "/add",
            model_name="b",
            request_id="y",
            worker_id=9,
            dp_rank=0,
            sequence_hashes=[1],
            new_isl_tokens=30,
        )
        await post(two, "/prefill_complete", model_name="a", request_id="x")
        both = [await get(one, "/loads"), await get(two, "/loads")]
        assert both[0] == both[1]
        assert loads(both[0][1]) == [("a", 1, 0, 0, 2), ("b", 9, 0, 30, 1)]
        assert (await get(one, "/workers")) == (await get(two, "/workers"))


async def test_reads_through_a_process_without_the_lease_share_one_lookup(
    nc: Client, nats_server: NatsServer
) -> None:
    """A process that does not hold a tracker's lease asks the server for the newest stored
    event before a read (read-your-writes across processes), but not once per read: reads
    that come while one lookup is out share the next. 40 reads begun at once make two
    lookups, and each still reflects the write another process answered just before."""
    config = fresh_config("sl")
    m = {"model_name": "a", "routing_group": "default"}
    async with serving(nats_server.url, config) as one, serving(nats_server.url, config) as two:
        register = {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await post(one, "/register", **register))[0] == 201
        assert (await get(two, "/loads", **m))[0] == 200  # two serves the tracker too
        tracker = two.trackers[namespace_for("a", "default", config.namespace)]
        assert not tracker.standby.active.is_set()  # one holds the lease (it registered)
        lookups: list[str] = []
        inbox = bytes(two.nc._resp_sub_prefix or b"").decode()  # two's requests' replies
        assert inbox.startswith("_INBOX.")

        async def count(msg: Any) -> None:
            if msg.reply.startswith(inbox):  # not another process's (a writer's lag watch)
                lookups.append(msg.subject)

        sub = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{config.events_stream}", cb=count)
        add = {**m, "request_id": "x", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [5, 6]}
        assert (await post(one, "/add", **add, new_isl_tokens=40))[0] == 201
        answers = await asyncio.gather(*(get(two, "/loads", **m) for _ in range(40)))
        await nc.flush()
        await sub.unsubscribe()
        assert {(status, str(loads(rows))) for status, rows in answers} == {
            (200, str([("a", 1, 0, 40, 2)]))
        }
        assert len(lookups) == 2
