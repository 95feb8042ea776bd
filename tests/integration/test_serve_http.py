"""``seqstate serve-http`` as a Dynamo client meets it: a real process on a port, HTTP/1.1 over
a socket (pipelined too), a restart that loses no booking, and two processes on one stream that
answer alike."""

from __future__ import annotations

from typing import Any

from eventually import eventually
from http_kit import WAIT_S, exchange, rows, serve_http
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.nats.server import NatsServer


async def test_a_dynamo_client_session_pipelined_over_one_connection(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sh")
    m = {"model_name": "Qwen/Qwen3-8B"}
    where = "model=Qwen/Qwen3-8B routing_group=default"
    async with serve_http(nats_server.url, config) as port:
        answers = await exchange(
            port,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 3, "block_size": 16, "dp_start": 0, "dp_size": 2},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "a",
                        "worker_id": 3,
                        "dp_rank": 1,
                        "sequence_hashes": [11, -12, 13],
                        "new_isl_tokens": 200,
                    },
                ),
                (
                    "POST",
                    "/add",
                    {**m, "request_id": "a", "worker_id": 3, "dp_rank": 0, "sequence_hashes": [11]},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "b",
                        "worker_id": 3,
                        "dp_rank": 0,
                        "sequence_hashes": [11, -12],
                    },
                ),
                ("POST", "/prefill_complete", {**m, "request_id": "a"}),
                ("GET", "/loads", None),
                ("POST", "/free", {**m, "request_id": "nobody"}),
                ("GET", "/nowhere", None),
                ("GET", "/add", None),
            ],
        )
        assert [status for status, _ in answers] == [201, 201, 409, 201, 200, 200, 200, 404, 405]
        duplicate = (
            "Request ID already exists (assigned to worker WorkerWithDpRank { "
            "worker_id: 3, dp_rank: 1 })"
        )
        assert answers[2][1] == {"error": duplicate}
        assert rows(answers[5]) == [("Qwen/Qwen3-8B", 3, 0, 0, 2), ("Qwen/Qwen3-8B", 3, 1, 0, 3)]
        assert answers[7][1] == {"error": "route not found"}
        answers = await exchange(
            port,
            [
                ("POST", "/unregister", {**m, "worker_id": 3}),
                (
                    "POST",
                    "/add",
                    {**m, "request_id": "c", "worker_id": 3, "dp_rank": 0, "sequence_hashes": []},
                ),
                ("GET", "/loads", None),
            ],
        )
        assert answers == [
            (200, {"status": "ok"}),
            (404, {"error": f"no slot tracker for {where}"}),
            (200, []),
        ]


async def test_a_restart_loses_no_booking_and_two_processes_answer_alike(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sr")
    m = {"model_name": "llama"}
    async with serve_http(nats_server.url, config) as port:
        await exchange(
            port,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "k",
                        "worker_id": 1,
                        "dp_rank": 0,
                        "sequence_hashes": [1, 2],
                        "new_isl_tokens": 64,
                    },
                ),
            ],
        )
        before = rows((await exchange(port, [("GET", "/loads", None)]))[0])
    assert before == [("llama", 1, 0, 64, 2)]
    url = nats_server.url
    async with serve_http(url, config) as one, serve_http(url, config) as two:
        assert rows((await exchange(one, [("GET", "/loads", None)]))[0]) == before
        assert (await exchange(two, [("POST", "/free", {**m, "request_id": "k"})]))[0][0] == 200
        after = [rows((await exchange(p, [("GET", "/loads", None)]))[0]) for p in (two, one)]
        assert after[0] == [("llama", 1, 0, 0, 0)]

        # The other process shows it once its view has it: read-your-writes is per process.
        async def loads_of_one() -> list[tuple[Any, ...]]:
            return rows((await exchange(one, [("GET", "/loads", None)]))[0])

        after[1] = await eventually(
            loads_of_one,
            lambda got: got == after[0],
            what="the other process's /loads with the free",
            timeout=WAIT_S,
            interval=0.05,
        )
