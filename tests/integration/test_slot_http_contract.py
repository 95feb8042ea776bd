"""The slot-tracker HTTP contract (docs/slot-tracker-api.md), call by call, against
``seqstate serve-http`` started as docs/http-api.md shows it: every status code and error text,
Dynamo's own scenarios with their exact numbers, the transport's details (pipelining, HEAD,
``Allow``), and where seqstate departs from Dynamo on purpose.

Each test is a script of ``(request, expected status, expected body)`` steps sent pipelined on
one connection. The tests of this module
share a server, each as a deployment of its own (``--namespace``), all with one model name.
"""

from __future__ import annotations

from typing import Any

from http_kit import exchange, request, rows, serve_http
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.nats.server import NatsServer

OK = {"status": "ok"}
M = "meta-llama/Llama-3.1-8B"  # a name no namespace token could hold as it is
W = f"model={M} routing_group=default"
G = "gpu/a100 ü"  # a routing group with a slash, a space and UTF-8


def reg(
    worker: int,
    *,
    model: str = M,
    group: str | None = None,
    block: int = 16,
    start: int = 0,
    size: int = 1,
) -> tuple[str, str, dict[str, Any]]:
    body: dict[str, Any] = {
        "worker_id": worker,
        "model_name": model,
        "block_size": block,
        "dp_start": start,
        "dp_size": size,
    }
    if group is not None:
        body["routing_group"] = group
    return ("POST", "/register", body)


def add(
    rid: str,
    worker: int,
    hashes: list[int],
    isl: int | None = None,
    *,
    rank: int = 0,
    model: str = M,
    group: str | None = None,
) -> tuple[str, str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model_name": model,
        "request_id": rid,
        "worker_id": worker,
        "dp_rank": rank,
        "sequence_hashes": hashes,
    }
    if isl is not None:
        body["new_isl_tokens"] = isl
    if group is not None:
        body["routing_group"] = group
    return ("POST", "/add", body)


def by_id(route: str, rid: str, *, model: str = M) -> tuple[str, str, dict[str, Any]]:
    return ("POST", route, {"model_name": model, "request_id": rid})


def unreg(worker: int, *, model: str = M, group: str | None = None) -> tuple[str, str, Any]:
    body: dict[str, Any] = {"worker_id": worker, "model_name": model}
    if group is not None:
        body["routing_group"] = group
    return ("POST", "/unregister", body)


def loads(query: str = "") -> tuple[str, str, None]:
    return ("GET", f"/loads{query}", None)


def load_rows(*rows_: tuple[Any, ...], model: str = M, group: str = "default") -> list[Any]:
    return [
        {
            "model_name": model,
            "routing_group": group,
            "worker_id": w,
            "dp_rank": r,
            "active_prefill_tokens": p,
            "active_decode_blocks": b,
        }
        for w, r, p, b in rows_
    ]


def potential(hashes: list[int], isl: int = 0, *, model: str = M) -> tuple[str, str, Any]:
    return (
        "POST",
        "/potential_loads",
        {"model_name": model, "sequence_hashes": hashes, "new_isl_tokens": isl},
    )


def no_rank(worker: int, rank: int) -> dict[str, str]:
    return {
        "error": f"Worker WorkerWithDpRank {{ worker_id: {worker}, dp_rank: {rank} }} not found"
    }


def duplicate(request_id: str, worker: int, rank: int) -> dict[str, str]:
    """Dynamo's 409, naming the request as it was given."""
    return {
        "error": f"Request {request_id} already exists (assigned to worker WorkerWithDpRank "
        f"{{ worker_id: {worker}, dp_rank: {rank} }})"
    }


def not_found(request_id: str) -> dict[str, str]:
    return {"error": f"Request {request_id} not found"}


def parse(text: str) -> dict[str, str]:
    return {"error": f"Failed to parse the request body as JSON: {text}"}


def data(text: str) -> dict[str, str]:
    return {"error": f"Failed to deserialize the JSON body into the target type: {text}"}


NO_TRACKER = {"error": f"no slot tracker for {W}"}


async def run(port: int, steps: list[tuple[Any, int, Any]]) -> None:
    """Send the steps pipelined on one connection; every answer must be as expected."""
    replies = await exchange(port, [call for call, _, _ in steps])
    for n, ((call, status, body), reply) in enumerate(zip(steps, replies, strict=True)):
        assert (reply.status, reply.body) == (status, body), f"step {n} {call!r} {reply.body}"


async def test_every_status_and_error_text_of_the_contract(
    nc: Client, nats_server: NatsServer
) -> None:
    async with serve_http(nats_server.url, fresh_config("hc")) as port:
        await run(
            port,
            [
                # /register: the 400s come before anything is stored.
                (reg(1, block=0), 400, {"error": "block_size must be greater than 0"}),
                (reg(1, size=0), 400, {"error": "dp_size must be greater than 0"}),
                (
                    reg(1, start=4_294_967_290, size=6),
                    400,
                    {"error": "dp range overflows u32: start=4294967290 size=6"},
                ),
                (reg(1, start=4_294_967_290, size=5), 201, OK),  # ends at u32::MAX: allowed
                (unreg(1), 200, OK),
                # seqstate's own bound, where Dynamo has none (a worker's ranks are keys)
                (
                    reg(1, size=1025),
                    400,
                    {
                        "error": "dp_size 1025 is over this ledger's bound of "
                        "1024 ranks per worker (--max-ranks-per-worker)"
                    },
                ),
                (reg(1, size=2), 201, OK),
                (reg(1, start=5, size=1), 409, {"error": f"worker 1 already registered for {W}"}),
                (
                    reg(2, block=32),
                    409,
                    {"error": f"block_size mismatch for {W}: existing=16, requested=32"},
                ),
                (reg(1, model="other", block=32), 201, OK),  # one id, another tracker
                (reg(1, group=G, start=3, size=2), 201, OK),  # non-zero dp_start: ranks 3 and 4
                # /unregister
                (unreg(7), 404, {"error": f"worker 7 not found for {W}"}),
                (
                    unreg(7, model="never"),
                    404,
                    {"error": "worker 7 not found for model=never routing_group=default"},
                ),
                # /add
                (add("a", 1, [1, 2, 3], 100), 201, OK),
                (add("b", 1, [], 7, rank=1), 201, OK),  # no blocks, prefill tokens still count
                (add("a", 1, [9], rank=1), 409, duplicate("a", 1, 0)),
                (add("a", 1, [9], rank=2), 404, no_rank(1, 2)),  # the rank before the duplicate
                (add("c", 9, [9]), 404, no_rank(9, 0)),
                (
                    add("c", 1, [9], model="never"),
                    404,
                    {"error": "no slot tracker for model=never routing_group=default"},
                ),
                # /prefill_complete
                (by_id("/prefill_complete", "a"), 200, OK),
                (by_id("/prefill_complete", "a"), 200, OK),  # idempotent
                (by_id("/prefill_complete", "ghost"), 404, not_found("ghost")),
                (by_id("/prefill_complete", "c"), 404, not_found("c")),  # its add failed
                (
                    by_id("/prefill_complete", "a", model="never"),
                    404,
                    {"error": "no slot tracker for model=never routing_group=default"},
                ),
                # /free
                (by_id("/free", "ghost"), 200, OK),
                (by_id("/free", "b"), 200, OK),
                (by_id("/free", "b"), 200, OK),  # a duplicate free is a no-op
                (by_id("/prefill_complete", "b"), 404, not_found("b")),  # freed
                (
                    by_id("/free", "b", model="never"),
                    404,
                    {"error": "no slot tracker for model=never routing_group=default"},
                ),
                (add("b", 1, [4], rank=1), 201, OK),  # an id is reused after its free
                # reads: one row per registered rank, zero rows included, sorted
                (
                    loads(),
                    200,
                    [
                        *load_rows((1, 0, 0, 3), (1, 1, 0, 1)),
                        *load_rows((1, 3, 0, 0), (1, 4, 0, 0), group=G),
                        *load_rows((1, 0, 0, 0), model="other"),
                    ],
                ),
                (loads("?model_name=other"), 200, load_rows((1, 0, 0, 0), model="other")),
                (
                    loads("?routing_group=gpu%2Fa100%20%C3%BC"),
                    200,
                    load_rows((1, 3, 0, 0), (1, 4, 0, 0), group=G),
                ),
                (loads("?model_name=nobody"), 200, []),
                (
                    ("GET", "/workers", None),
                    200,
                    [
                        {
                            "worker_id": 1,
                            "model_name": M,
                            "routing_group": "default",
                            "block_size": 16,
                            "dp_start": 0,
                            "dp_size": 2,
                        },
                        {
                            "worker_id": 1,
                            "model_name": M,
                            "routing_group": G,
                            "block_size": 16,
                            "dp_start": 3,
                            "dp_size": 2,
                        },
                        {
                            "worker_id": 1,
                            "model_name": "other",
                            "routing_group": "default",
                            "block_size": 32,
                            "dp_start": 0,
                            "dp_size": 1,
                        },
                    ],
                ),
                (
                    ("GET", "/workers?model_name=other&routing_group=default", None),
                    200,
                    [
                        {
                            "worker_id": 1,
                            "model_name": "other",
                            "routing_group": "default",
                            "block_size": 32,
                            "dp_start": 0,
                            "dp_size": 1,
                        }
                    ],
                ),
                (
                    potential([1, 2, 8], 10),
                    200,
                    [
                        {
                            "worker_id": 1,
                            "dp_rank": 0,
                            "potential_prefill_tokens": 10,
                            "potential_decode_blocks": 4,
                            "active_requests": 1,
                        },
                        {
                            "worker_id": 1,
                            "dp_rank": 1,
                            "potential_prefill_tokens": 10,
                            "potential_decode_blocks": 4,
                            "active_requests": 1,
                        },
                    ],
                ),
                (
                    potential([1], model="never"),
                    404,
                    {"error": "no slot tracker for model=never routing_group=default"},
                ),
                (("GET", "/health", None), 200, None),
                # the router's and the extractor's errors
                (("GET", "/nowhere", None), 404, {"error": "route not found"}),
                (("GET", "/add", None), 405, {"error": "method not allowed"}),
                (
                    request("POST", "/add", add("x", 1, [1])[2], content_type=None),
                    415,
                    {"error": "Expected request with `Content-Type: application/json`"},
                ),
                (
                    request("POST", "/add", add("x", 1, [1])[2], content_type="text/plain"),
                    415,
                    {"error": "Expected request with `Content-Type: application/json`"},
                ),
                (
                    request(
                        "POST",
                        "/free",
                        by_id("/free", "x")[2],
                        content_type="application/vnd.seqstate+json",
                    ),
                    200,
                    OK,
                ),
                (
                    request(
                        "POST",
                        "/free",
                        by_id("/free", "x")[2],
                        content_type="application/json; charset=utf-8",
                    ),
                    200,
                    OK,
                ),
                # axum's extractor errors, in serde's words (as the 1.6.1 wheel answers these very
                # bytes: json.dumps's ", " and ": " put the columns where they are)
                (
                    request("POST", "/add", raw=b'{"model_name":'),
                    400,
                    parse("model_name: EOF while parsing a value at line 1 column 14"),
                ),
                (
                    request("POST", "/add", raw=b""),
                    400,
                    parse("EOF while parsing a value at line 1 column 0"),
                ),
                (
                    ("POST", "/add", {**add("x", 1, [])[2], "request_id": 5}),
                    422,
                    data(
                        "request_id: invalid type: integer `5`, expected a string "
                        "at line 1 column 57"
                    ),
                ),
                (
                    (
                        "POST",
                        "/add",
                        {k: v for k, v in add("x", 1, [])[2].items() if k != "sequence_hashes"},
                    ),
                    422,
                    data("missing field `sequence_hashes` at line 1 column 90"),
                ),
                (
                    ("POST", "/add", add("x", 1, [2**63])[2]),
                    422,
                    data(
                        "sequence_hashes[0]: invalid value: integer `9223372036854775808`, "
                        "expected i64 at line 1 column 130"
                    ),
                ),
                (
                    ("POST", "/add", add("x", 1, [None])[2]),
                    422,
                    data(  # type: ignore[list-item]
                        "sequence_hashes[0]: invalid type: null, expected i64 at line 1 column 115"
                    ),
                ),
                (
                    ("POST", "/add", add("x", 1, [1.5])[2]),
                    422,
                    data(  # type: ignore[list-item]
                        "sequence_hashes[0]: invalid type: floating point `1.5`, expected i64 "
                        "at line 1 column 114"
                    ),
                ),
                (
                    ("POST", "/add", add("x", 1, ["1"])[2]),
                    422,
                    data(  # type: ignore[list-item]
                        'sequence_hashes[0]: invalid type: string "1", expected i64 '
                        "at line 1 column 114"
                    ),
                ),
                (
                    ("POST", "/add", add("x", 1, [1], -1)[2]),
                    422,
                    data(
                        "new_isl_tokens: invalid value: integer `-1`, expected usize at line 1 "
                        "column 135"
                    ),
                ),
                (
                    request("POST", "/add", raw=b'{"model_name": "m", "model_name": "n"}'),
                    422,
                    data("duplicate field `model_name` at line 1 column 32"),
                ),
                (
                    request(
                        "POST",
                        "/free",
                        raw=b'{"model_name": "m", "request_id": "r", "request_id": -0}',
                    ),
                    422,
                    data("duplicate field `request_id` at line 1 column 51"),
                ),
                # what serde reads and msgspec alone would not: a positional array, trailing bytes
                (
                    request("POST", "/add", raw=b'["m", "g", "r", 1, 0, [1, 2], 5] trailing'),
                    404,
                    {"error": "no slot tracker for model=m routing_group=g"},
                ),
                (
                    request("POST", "/free", raw=b'{"model_name": "m", "request_id": "r"} }}'),
                    404,
                    {"error": "no slot tracker for model=m routing_group=default"},
                ),
                (("POST", "/add", {**add("x", 1, [1])[2], "unknown": [1, {"a": None}]}), 201, OK),
            ],
        )


async def test_dynamos_scenarios_with_their_numbers(nc: Client, nats_server: NatsServer) -> None:
    async with serve_http(nats_server.url, fresh_config("hd")) as port:
        await run(
            port,
            [
                # shared prefixes count once per rank; ranks never share; unregister drops
                (reg(1), 201, OK),
                (reg(2), 201, OK),
                (add("r1", 1, [1, 2, 3], 100), 201, OK),
                (add("r2", 1, [1, 2, 4], 50), 201, OK),
                (add("r3", 2, [1, 2, 3]), 201, OK),
                (loads(), 200, load_rows((1, 0, 150, 4), (2, 0, 0, 3))),
                (by_id("/free", "r1"), 200, OK),
                (loads(), 200, load_rows((1, 0, 50, 3), (2, 0, 0, 3))),
                (unreg(1), 200, OK),
                (loads(), 200, load_rows((2, 0, 0, 3))),
                (by_id("/prefill_complete", "r2"), 404, not_found("r2")),  # dropped with its worker
                (by_id("/free", "r2"), 200, OK),
                # unregister then register starts fresh
                (reg(1), 201, OK),
                (loads(), 200, load_rows((1, 0, 0, 0), (2, 0, 0, 3))),
                # the prefill lifecycle on both load dimensions
                (add("p", 1, [7, 8], 384), 201, OK),
                (
                    loads("?model_name=" + M.replace("/", "%2F")),
                    200,
                    load_rows((1, 0, 384, 2), (2, 0, 0, 3)),
                ),
                (by_id("/prefill_complete", "p"), 200, OK),
                (loads(), 200, load_rows((1, 0, 0, 2), (2, 0, 0, 3))),
                (by_id("/free", "p"), 200, OK),
                (loads(), 200, load_rows((1, 0, 0, 0), (2, 0, 0, 3))),
                # a free implies prefill complete
                (add("q", 1, [7], 20), 201, OK),
                (by_id("/free", "q"), 200, OK),
                (loads(), 200, load_rows((1, 0, 0, 0), (2, 0, 0, 3))),
                # a duplicate add changes nothing: the original keeps its rank and prefill
                (add("d", 2, [5], 30), 201, OK),
                (add("d", 1, [6], 40), 409, duplicate("d", 2, 0)),
                (loads(), 200, load_rows((1, 0, 0, 0), (2, 0, 30, 4))),
                # negative hashes (i64) are blocks like any other
                (add("s", 1, [-1, -2], 0), 201, OK),
                (
                    potential([-1, -2, 3], 5),
                    200,
                    [
                        {
                            "worker_id": 1,
                            "dp_rank": 0,
                            "potential_prefill_tokens": 5,
                            "potential_decode_blocks": 3,
                            "active_requests": 1,
                        },
                        {
                            "worker_id": 2,
                            "dp_rank": 0,
                            "potential_prefill_tokens": 35,
                            "potential_decode_blocks": 7,
                            "active_requests": 2,
                        },
                    ],
                ),
                # block-size mismatch, then the last worker's removal ends the tracker
                (
                    reg(3, block=64),
                    409,
                    {"error": f"block_size mismatch for {W}: existing=16, requested=64"},
                ),
                (unreg(1), 200, OK),
                (unreg(2), 200, OK),
                (loads(), 200, []),
                (add("z", 2, [1]), 404, NO_TRACKER),
                (by_id("/prefill_complete", "d"), 404, NO_TRACKER),
                (by_id("/free", "d"), 404, NO_TRACKER),
                (potential([1]), 404, NO_TRACKER),
                (unreg(2), 404, {"error": f"worker 2 not found for {W}"}),
                (reg(3, block=64), 201, OK),  # a new tracker may choose a new block size
                (
                    ("GET", "/workers", None),
                    200,
                    [
                        {
                            "worker_id": 3,
                            "model_name": M,
                            "routing_group": "default",
                            "block_size": 64,
                            "dp_start": 0,
                            "dp_size": 1,
                        }
                    ],
                ),
            ],
        )


async def test_where_seqstate_departs_from_dynamo_on_purpose(
    nc: Client, nats_server: NatsServer
) -> None:
    """An early free is remembered: the late add is answered 201 (the client did nothing
    wrong) but books nothing, where Dynamo books it and it leaks until expiry. An early
    prefill_complete is 404 as in Dynamo, but remembered: the late add is booked with its
    blocks and without prefill load, where Dynamo counts the prefill that already happened."""
    async with serve_http(nats_server.url, fresh_config("hp")) as port:
        await run(
            port,
            [
                (reg(1), 201, OK),
                (by_id("/free", "early"), 200, OK),
                (add("early", 1, [1, 2], 64), 201, OK),
                (loads(), 200, load_rows((1, 0, 0, 0))),  # Dynamo: (1, 0, 64, 2), leaking
                (by_id("/free", "early"), 200, OK),
                (by_id("/prefill_complete", "soon"), 404, not_found("soon")),
                (add("soon", 1, [1, 2], 64), 201, OK),
                (loads(), 200, load_rows((1, 0, 0, 2))),  # Dynamo: (1, 0, 64, 2)
                (by_id("/free", "soon"), 200, OK),
                (loads(), 200, load_rows((1, 0, 0, 0))),
            ],
        )


async def test_the_transport_as_axum_serves_it(nc: Client, nats_server: NatsServer) -> None:
    async with serve_http(nats_server.url, fresh_config("ht")) as port:
        replies = await exchange(
            port,
            [
                ("HEAD", "/loads", None),
                ("GET", "/add", None),
                ("POST", "/loads", None),
                ("DELETE", "/health", None),
                ("PUT", "/nowhere", None),
            ],
        )
        assert [(r.status, r.raw, r.headers.get("allow")) for r in replies] == [
            (200, b"", None),
            (405, b'{"error":"method not allowed"}', "POST"),
            (405, b'{"error":"method not allowed"}', "GET,HEAD"),
            (405, b'{"error":"method not allowed"}', "GET,HEAD"),
            (404, b'{"error":"route not found"}', None),
        ]
        assert replies[0].headers["content-length"] == "2"  # the GET's body: []
        # Pipelined calls take effect in order: a register, adds that need it, a read that
        # sees them all, a free of the first, and a read after it.
        calls = [
            reg(5, size=2),
            *(add(f"r{i}", 5, [i, 100 + i], 10, rank=i % 2) for i in range(40)),
            loads(),
            by_id("/free", "r0"),
            loads(),
        ]
        replies = await exchange(port, calls)
        assert [r.status for r in replies] == [201] + [201] * 40 + [200, 200, 200]
        assert rows(replies[41]) == [(M, 5, 0, 200, 40), (M, 5, 1, 200, 40)]
        assert rows(replies[43]) == [(M, 5, 0, 190, 38), (M, 5, 1, 200, 40)]


async def test_a_registration_the_writer_refuses_is_a_500_at_once(
    nc: Client, nats_server: NatsServer
) -> None:
    """Past ``--max-ranks`` the writer dead-letters the registration: answered 500 as soon as
    its dead letter is stored (no later event settles it here: the idle Tick is ten minutes
    away), and the reads after it are not kept waiting for a change that never comes."""
    async with serve_http(
        nats_server.url, fresh_config("hm"), "--max-ranks", "2", "--idle-tick-s", "600"
    ) as port:
        await run(
            port,
            [
                (reg(1, size=2), 201, OK),
                (reg(2), 500, {"error": "the ledger refused the event (see its dead letters)"}),
                (loads(), 200, load_rows((1, 0, 0, 0), (1, 1, 0, 0))),
                (add("a", 1, [1]), 201, OK),
                (loads(), 200, load_rows((1, 0, 0, 1), (1, 1, 0, 0))),
            ],
        )
