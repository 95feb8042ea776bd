"""The HTTP layer's ceiling: candidate asyncio servers against Dynamo's own slot tracker.

Why this exists: ``seqstate serve-http`` is a drop-in for Dynamo's standalone
slot tracker (``python -m dynamo.slot_tracker``, contract in
``docs/slot-tracker-api.md``), on "a well-kept asyncio HTTP server library, chosen
for throughput (measure two before you pick)", and a target of at least 50% of Dynamo's calls/s
at 16 connections. This script measures, in one run and with one load generator:

- the candidates, each a minimal server of the tracker's shape with nothing behind it (no NATS,
  no state): ``POST /register``, ``/add`` (201), ``/prefill_complete`` and ``/free`` (200), each
  body checked for ``Content-Type: application/json`` and decoded and type-checked with msgspec
  into the contract's types (hashes i64, worker ids u64, ranks u32), and ``GET /loads`` (16 rows
  encoded with msgspec per call), ``GET /health``; unknown routes 404 ``route not found``, wrong
  methods 405 ``method not allowed`` with ``Allow``, extractor errors 415 / 400 / 422 with
  axum's prefixes, every error as ``{"error": "..."}``; all on uvloop:

  - ``aiohttp``: aiohttp's ``web`` server, its router, one middleware for the error bodies;
  - ``aiohttp-ll`` (not in the default set): aiohttp's low-level ``web.Server``, routing by hand;
  - ``starlette``: uvicorn (httptools parser) running a Starlette app (its router, exception
    handlers for the error bodies);
  - ``asgi``: uvicorn (httptools) running a bare ASGI callable that routes by a dict lookup:
    what uvicorn costs without a framework;
  - ``granian``: granian's embedded server (``granian.server.embed``: its Rust HTTP stack on one
    runtime thread, the app on this process's asyncio loop) with a bare RSGI callable;
  - ``httptools``: no server library: an ``asyncio.Protocol`` around httptools' request parser
    (the parser uvicorn uses), the contract written by hand;
- ``trivial``: an ``asyncio.Protocol`` on uvloop that only splits requests and writes canned
  responses, the fastest a Python server gets here: the check on the generator;
- ``dynamo``: Dynamo's own tracker from ``ai-dynamo-runtime`` (``--dynamo-python``, the
  interpreter of a benchmark-only venv; never a project dependency), with 16 workers registered
  and real bookings: every add is a new request id on one of the 16 workers (24 block hashes,
  1,024 distinct hash lists, 384 prefill tokens), every prefill_complete and free hits an id the
  add phase booked, and whatever the free phase did not reach is freed untimed afterwards;
- any server already running (``--target NAME=PORT``), e.g. ``seqstate serve-http`` later: it
  gets the same 16 registrations (201 or 409 accepted) and the same calls as Dynamo.

The generator (this process, uvloop, raw ``asyncio.Protocol`` connections, requests formatted
per call, responses split by ``Content-Length``) runs three modes per endpoint: ``seq`` (one
connection, one request at a time), ``c16`` (16 connections, one request in flight on each) and
``pipe`` (one connection, ``--depth`` requests in flight, HTTP/1.1 pipelining). Every response's
status is checked (add 201, the rest 200); a run with any other status is an error. Each
measurement lasts ``--seconds`` (prefill_complete and free stop earlier when they run out of the
ids the add phase booked). Within a run every (mode, endpoint) is measured on each server in
turn, so that all servers share a phase of this noisy machine; the server order rotates from run
to run. The table gives the median calls/s over ``--runs`` runs, and the CPU the server process
(utime + stime of all its threads, from /proc) and this generator (``time.process_time``) spent
per call. ``--wrk`` adds a cross-check with a C client (wrk, a Debian package): ``wrk -t1 -c16``
on ``GET /loads`` and on ``POST /free`` of an id never added, on every server, every run.

``--probe`` instead sends the contract's error cases to every server and prints status, body
and ``Allow`` header side by side with Dynamo's.

Run from the repository root (after ``pip install -e '.[bench]'``; Dynamo's venv as
BENCHMARKS.md says):

    .venv/bin/python benchmarks/http_servers.py --dynamo-python ../bench-dynamo/.venv/bin/python
    .venv/bin/python benchmarks/http_servers.py --probe --dynamo-python ...
    .venv/bin/python benchmarks/http_servers.py --servers aiohttp,asgi --runs 1 --seconds 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from typing import Annotated, Any, Final

import msgspec
from harness.cli import argument_parser
from harness.measure import rotated
from harness.report import machine
from harness.servers import free_port, stop

# ---------------------------------------------------------------------------------------------
# The contract's shapes, shared by every candidate.

I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec has no bound past i64: __post_init__ checks
U64_MAX: Final = 2**64 - 1
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class Register(msgspec.Struct):
    worker_id: U64
    model_name: str
    block_size: U32
    dp_start: U32
    dp_size: U32
    routing_group: str = "default"

    def __post_init__(self) -> None:
        if self.worker_id > U64_MAX:
            raise ValueError("worker_id: expected u64")


class Add(msgspec.Struct):
    model_name: str
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: list[I64]
    routing_group: str = "default"
    new_isl_tokens: U64 = 0

    def __post_init__(self) -> None:
        if self.worker_id > U64_MAX or self.new_isl_tokens > U64_MAX:
            raise ValueError("expected u64")


class ByRequest(msgspec.Struct):
    model_name: str
    request_id: str
    routing_group: str = "default"


class Load(msgspec.Struct):
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


class Error(msgspec.Struct):
    error: str


ENCODER: Final = msgspec.json.Encoder()
OK: Final = b'{"status":"ok"}'
JSON_CT: Final = "application/json"
LOAD_ROWS: Final = [Load("bench", "default", w, 0, 384 * (w % 3), 24 * w) for w in range(16)]
NOT_FOUND: Final = ENCODER.encode(Error("route not found"))
NOT_ALLOWED: Final = ENCODER.encode(Error("method not allowed"))


class Reject(Exception):
    """An extractor error: its status and its ``{"error": ...}`` body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.body = ENCODER.encode(Error(text))


@functools.lru_cache(maxsize=64)
def is_json(content_type: str | None) -> bool:
    """axum's test: ``application/json`` or ``application/*+json``, parameters allowed."""
    if not content_type:
        return False
    kind, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


def parse(decoder: msgspec.json.Decoder[Any], content_type: str | None, body: bytes) -> Any:
    """Decode a request body the way axum's ``Json`` extractor judges it (statuses, prefixes)."""
    if not is_json(content_type):
        raise Reject(415, "Expected request with `Content-Type: application/json`")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise Reject(422, f"Failed to deserialize the JSON body into the target type: {e}") from e
    except msgspec.DecodeError as e:
        raise Reject(400, f"Failed to parse the request body as JSON: {e}") from e


# path -> (method, decoder or None for GET, success status)
POSTS: Final[dict[str, tuple[msgspec.json.Decoder[Any], int]]] = {
    "/register": (msgspec.json.Decoder(Register), 201),
    "/add": (msgspec.json.Decoder(Add), 201),
    "/prefill_complete": (msgspec.json.Decoder(ByRequest), 200),
    "/free": (msgspec.json.Decoder(ByRequest), 200),
}
GETS: Final = ("/loads", "/health")


# ---------------------------------------------------------------------------------------------
# Candidate servers (each run in a child process: ``--serve KIND --port P``).


def aiohttp_app() -> Any:
    from aiohttp import web

    def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Any:
        return web.Response(status=status, body=body, content_type=JSON_CT, headers=headers)

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> Any:
        try:
            return await handler(request)
        except Reject as r:
            return json_response(r.status, r.body)
        except web.HTTPNotFound:
            return json_response(404, NOT_FOUND)
        except web.HTTPMethodNotAllowed as e:
            return json_response(405, NOT_ALLOWED, {"Allow": e.headers["Allow"]})

    def post(decoder: msgspec.json.Decoder[Any], status: int) -> Any:
        async def handler(request: web.Request) -> web.Response:
            parse(decoder, request.headers.get("Content-Type"), await request.read())
            return json_response(status, OK)

        return handler

    async def loads(request: web.Request) -> web.Response:
        return json_response(200, ENCODER.encode(LOAD_ROWS))

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(middlewares=[errors])
    for path, (decoder, status) in POSTS.items():
        app.router.add_post(path, post(decoder, status))
    app.router.add_get("/loads", loads)
    app.router.add_get("/health", health)
    return app


async def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(aiohttp_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await asyncio.Event().wait()


async def serve_aiohttp_lowlevel(port: int) -> None:
    """aiohttp's low-level ``web.Server``: its protocol and request objects, no app or router."""
    from aiohttp import web

    ct = {"Content-Type": JSON_CT}

    async def handler(request: web.BaseRequest) -> web.Response:
        path, method = request.path, request.method
        post = POSTS.get(path)
        if post is not None:
            if method != "POST":
                return web.Response(status=405, body=NOT_ALLOWED, headers={**ct, "Allow": "POST"})
            decoder, status = post
            try:
                parse(decoder, request.headers.get("Content-Type"), await request.read())
            except Reject as r:
                return web.Response(status=r.status, body=r.body, headers=ct)
            return web.Response(status=status, body=OK, headers=ct)
        if path in GETS:
            if method not in ("GET", "HEAD"):
                return web.Response(
                    status=405, body=NOT_ALLOWED, headers={**ct, "Allow": "GET,HEAD"}
                )
            if path == "/health":
                return web.Response(status=200)
            return web.Response(status=200, body=ENCODER.encode(LOAD_ROWS), headers=ct)
        return web.Response(status=404, body=NOT_FOUND, headers=ct)

    server = web.Server(handler, access_log=None)
    await asyncio.get_running_loop().create_server(server, "127.0.0.1", port, backlog=1024)
    await asyncio.Event().wait()


def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    def post(decoder: msgspec.json.Decoder[Any], status: int) -> Any:
        async def handler(request: Request) -> Response:
            parse(decoder, request.headers.get("content-type"), await request.body())
            return Response(OK, status, media_type=JSON_CT)

        return handler

    async def loads(request: Request) -> Response:
        return Response(ENCODER.encode(LOAD_ROWS), 200, media_type=JSON_CT)

    async def health(request: Request) -> Response:
        return Response(b"", 200)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return Response(NOT_ALLOWED, 405, headers=exc.headers, media_type=JSON_CT)
        if exc.status_code == 404:
            return Response(NOT_FOUND, 404, media_type=JSON_CT)
        body = ENCODER.encode(Error(exc.detail))
        return Response(body, exc.status_code, headers=exc.headers, media_type=JSON_CT)

    async def rejected(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Reject)
        return Response(exc.body, exc.status, media_type=JSON_CT)

    routes = [Route(p, post(d, s), methods=["POST"]) for p, (d, s) in POSTS.items()]
    routes += [Route("/loads", loads, methods=["GET"]), Route("/health", health, methods=["GET"])]
    handlers = {HTTPException: http_error, Reject: rejected}
    return Starlette(routes=routes, exception_handlers=handlers)


def asgi_app() -> Any:
    """A bare ASGI callable: the whole routing and error handling of the contract by hand."""
    ct_json = [(b"content-type", b"application/json")]
    allow_post = (b"allow", b"POST")
    allow_get = (b"allow", b"GET,HEAD")

    async def respond(send: Any, status: int, body: bytes, extra: Any = ()) -> None:
        headers = [*ct_json, (b"content-length", b"%d" % len(body)), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        post = POSTS.get(path)
        if post is not None:
            if method != "POST":
                return await respond(send, 405, NOT_ALLOWED, (allow_post,))
            message = await receive()
            body = message.get("body", b"")
            while message.get("more_body"):
                message = await receive()
                body += message.get("body", b"")
            content_type = None
            for name, value in scope["headers"]:
                if name == b"content-type":
                    content_type = value.decode("latin-1")
                    break
            decoder, status = post
            try:
                parse(decoder, content_type, body)
            except Reject as r:
                return await respond(send, r.status, r.body)
            return await respond(send, status, OK)
        if path in GETS:
            if method not in ("GET", "HEAD"):
                return await respond(send, 405, NOT_ALLOWED, (allow_get,))
            if path == "/health":
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-length", b"0")],
                    }
                )
                return await send({"type": "http.response.body", "body": b""})
            return await respond(send, 200, ENCODER.encode(LOAD_ROWS))
        return await respond(send, 404, NOT_FOUND)

    return app


async def serve_uvicorn(port: int, app: Any) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="none",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=1024,
    )
    await uvicorn.Server(config).serve()


def rsgi_app() -> Any:
    """The same by hand for granian's RSGI interface (granian's Rust server answers the call)."""
    ct_json = [("content-type", JSON_CT)]
    allow_post = [*ct_json, ("allow", "POST")]
    allow_get = [*ct_json, ("allow", "GET,HEAD")]

    async def app(scope: Any, proto: Any) -> None:
        path, method = scope.path, scope.method
        post = POSTS.get(path)
        if post is not None:
            if method != "POST":
                return proto.response_bytes(405, allow_post, NOT_ALLOWED)
            body = await proto()
            decoder, status = post
            try:
                parse(decoder, scope.headers.get("content-type"), body)
            except Reject as r:
                return proto.response_bytes(r.status, ct_json, r.body)
            return proto.response_bytes(status, ct_json, OK)
        if path in GETS:
            if method not in ("GET", "HEAD"):
                return proto.response_bytes(405, allow_get, NOT_ALLOWED)
            if path == "/health":
                return proto.response_empty(200, [])
            return proto.response_bytes(200, ct_json, ENCODER.encode(LOAD_ROWS))
        return proto.response_bytes(404, ct_json, NOT_FOUND)

    return app


async def serve_granian(port: int) -> None:
    """granian's embedded server: its Rust HTTP stack on one runtime thread, the app on our loop."""
    from granian.constants import HTTPModes, Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(
        rsgi_app(),
        address="127.0.0.1",
        port=port,
        interface=Interfaces.RSGI,
        http=HTTPModes.http1,
        websockets=False,
        backlog=1024,
        log_level=LogLevels.warning,
    )
    await server.serve()


REASONS: Final = {
    200: b"OK",
    201: b"Created",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    415: b"Unsupported Media Type",
    422: b"Unprocessable Entity",
}


def raw_response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
        % (status, REASONS[status], len(body), extra)
        + body
    )


class HttptoolsServer(asyncio.Protocol):
    """No server library: an ``asyncio.Protocol`` around httptools' parser, the contract by hand.

    Answers are computed synchronously and written in order at the end of each read; a real
    service, whose mutations wait for the writer's outcome, would keep a queue of futures per
    connection to keep pipelined answers in order.
    """

    POST_ANSWERS: Final = {p.encode(): (d, raw_response(s, OK)) for p, (d, s) in POSTS.items()}
    NOT_FOUND: Final = raw_response(404, NOT_FOUND)
    POST_ONLY: Final = raw_response(405, NOT_ALLOWED, b"allow: POST\r\n")
    GET_ONLY: Final = raw_response(405, NOT_ALLOWED, b"allow: GET,HEAD\r\n")
    HEALTH: Final = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.error = httptools.HttpParserError
        self.transport: Any = None
        self.url = b""
        self.content_type: bytes | None = None
        self.body: list[bytes] = []
        self.out: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self.error:
            self.out.append(raw_response(400, ENCODER.encode(Error("bad request"))))
            self.transport.write(b"".join(self.out))
            self.transport.close()
            return
        if self.out:
            self.transport.write(b"".join(self.out) if len(self.out) > 1 else self.out[0])
            self.out.clear()

    def on_message_begin(self) -> None:
        self.url = b""
        self.content_type = None
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.content_type = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        method = self.parser.get_method()
        post = self.POST_ANSWERS.get(path)
        if post is not None:
            if method != b"POST":
                answer = self.POST_ONLY
            else:
                ct = self.content_type
                try:
                    parse(
                        post[0],
                        ct.decode("latin-1") if ct is not None else None,
                        b"".join(self.body),
                    )
                    answer = post[1]
                except Reject as r:
                    answer = raw_response(r.status, r.body)
        elif path == b"/loads" or path == b"/health":
            if method != b"GET" and method != b"HEAD":
                answer = self.GET_ONLY
            elif path == b"/health":
                answer = self.HEALTH
            else:
                answer = raw_response(200, ENCODER.encode(LOAD_ROWS))
        else:
            answer = self.NOT_FOUND
        self.out.append(answer)
        if not self.parser.should_keep_alive():
            self.transport.write(b"".join(self.out))
            self.out.clear()
            self.transport.close()


async def serve_httptools(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        HttptoolsServer, "127.0.0.1", port, backlog=1024
    )
    await server.serve_forever()


class TrivialServer(asyncio.Protocol):
    """Splits requests by Content-Length and writes canned answers: no HTTP library at all."""

    CREATED: Final = b"HTTP/1.1 201 Created\r\nContent-Length: 15\r\n\r\n" + OK
    DONE: Final = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n" + OK
    LOADS: Final = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(
        ENCODER.encode(LOAD_ROWS)
    ) + ENCODER.encode(LOAD_ROWS)
    EMPTY: Final = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, out = 0, []
        while (h := buf.find(b"\r\n\r\n", pos)) >= 0:
            i = buf.find(b"ontent-Length:", pos, h)
            end = h + 4 + (int(buf[i + 14 : buf.find(b"\r\n", i)]) if i >= 0 else 0)
            if end > len(buf):
                break
            line = buf[pos : pos + 12]
            out.append(
                self.LOADS
                if line.startswith(b"GET /loads")
                else self.EMPTY
                if line.startswith(b"GET ")
                else self.CREATED
                if line.startswith((b"POST /add ", b"POST /reg"))
                else self.DONE
            )
            pos = end
        self.buf = buf[pos:]
        if out:
            self.transport.write(b"".join(out))


async def serve_trivial(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        TrivialServer, "127.0.0.1", port, backlog=1024
    )
    await server.serve_forever()


CANDIDATES: Final[dict[str, Callable[[int], Any]]] = {
    "aiohttp": serve_aiohttp,
    "aiohttp-ll": serve_aiohttp_lowlevel,
    "starlette": lambda port: serve_uvicorn(port, starlette_app()),
    "asgi": lambda port: serve_uvicorn(port, asgi_app()),
    "granian": serve_granian,
    "httptools": serve_httptools,
    "trivial": serve_trivial,
}


def run_loop(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:  # the table says which loop ran
        asyncio.run(coro)
    else:
        uvloop.run(coro)


# ---------------------------------------------------------------------------------------------
# The load generator.

MODEL: Final = b"bench"
WORKERS: Final = 16
HASHES_PER_REQUEST: Final = 24
PREFILL_TOKENS: Final = 384
_rng = random.Random(12)
HASH_LISTS: Final = [
    (
        "["
        + ",".join(str(_rng.randrange(-(2**63), 2**63)) for _ in range(HASHES_PER_REQUEST))
        + "]"
    ).encode()
    for _ in range(1024)
]
POST_HEAD: Final = (
    b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n"
)
JSON_CT_BYTES: Final = b"application/json"
LOADS_REQUEST: Final = b"GET /loads HTTP/1.1\r\nHost: bench\r\n\r\n"


def post_request(path: bytes, body: bytes, content_type: bytes | None = JSON_CT_BYTES) -> bytes:
    ct = b"Content-Type: %s\r\n" % content_type if content_type is not None else b""
    return (
        b"POST %s HTTP/1.1\r\nHost: bench\r\n%sContent-Length: %d\r\n\r\n" % (path, ct, len(body))
        + body
    )


def add_maker(tag: bytes) -> Callable[[int], bytes]:
    tmpl = (
        b'{"model_name":"bench","request_id":"%s-%d","worker_id":%d,"dp_rank":0,'
        b'"sequence_hashes":%s,"new_isl_tokens":%d}'
    )
    head = b"POST /add HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"

    def make(i: int) -> bytes:
        body = tmpl % (tag, i, i % WORKERS, HASH_LISTS[i % 1024], PREFILL_TOKENS)
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    return make


def by_request_maker(path: bytes, tag: bytes, start: int = 0) -> Callable[[int], bytes]:
    head = POST_HEAD.split(b"Content-Length")[0] % path
    tmpl = b'{"model_name":"bench","request_id":"%s-%d"}'

    def make(i: int) -> bytes:
        body = tmpl % (tag, start + i)
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    return make


class Phase:
    """One measurement: requests from ``make(0..limit-1)`` until ``deadline``, statuses checked."""

    def __init__(
        self, make: Callable[[int], bytes], expect: int, limit: int | None, seconds: float | None
    ) -> None:
        self.make = make
        self.expect = b"%d" % expect
        self.limit = limit if limit is not None else 1 << 62
        self.seconds = seconds
        self.deadline = float("inf")
        self.issued = 0
        self.done = 0
        self.bad = 0
        self.first_bad = b""
        self.inflight = 0
        self.started = 0.0
        self.ended = 0.0
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self, n: int) -> list[bytes]:
        out = []
        now = time.perf_counter()
        while n and self.issued < self.limit and now < self.deadline:
            out.append(self.make(self.issued))
            self.issued += 1
            n -= 1
        self.inflight += len(out)
        return out

    def settle(self, n: int) -> None:
        self.done += n
        self.inflight -= n
        if self.inflight == 0 and not self.finished.done():
            self.ended = time.perf_counter()
            self.finished.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(exc)


class ClientConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None
        self.phase: Phase | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start(self, phase: Phase, depth: int) -> None:
        self.phase = phase
        out = phase.take(depth)
        if out:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        assert phase is not None
        buf = self.buf + data if self.buf else data
        pos = n = 0
        while (h := buf.find(b"\r\n\r\n", pos)) >= 0:
            head = buf[pos:h]
            i = head.find(b"ontent-length:")
            if i < 0:
                i = head.find(b"ontent-Length:")
            if i < 0:
                length = 0
            else:
                j = head.find(b"\r\n", i)
                length = int(head[i + 14 : j if j >= 0 else len(head)])
            end = h + 4 + length
            if end > len(buf):
                break
            if head[9:12] != phase.expect:
                phase.bad += 1
                if not phase.first_bad:
                    phase.first_bad = buf[pos:end]
            pos = end
            n += 1
        self.buf = buf[pos:]
        if n:
            out = phase.take(n)
            if out:
                self.transport.write(b"".join(out))
            phase.settle(n)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase is not None:
            self.phase.fail(ConnectionError(f"server closed the connection ({exc})"))
        if not self.closed.done():
            self.closed.set_result(None)


async def connect(port: int, n: int) -> list[ClientConnection]:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(n):
        _, proto = await loop.create_connection(ClientConnection, "127.0.0.1", port)
        conns.append(proto)
    return conns


async def close(conns: list[ClientConnection]) -> None:
    for c in conns:
        c.phase = None
        c.transport.close()
    await asyncio.gather(*(c.closed for c in conns))


def listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:``port`` (a ``--target``), for its CPU per call."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
    return None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


MODES: Final = {"seq": (1, 1), "c16": (16, 1), "pipe": (1, None)}  # (connections, depth)


async def measure(
    port: int, pid: int | None, mode: str, depth: int, phase: Phase, timeout: float
) -> dict[str, Any]:
    n_conns, per_conn = MODES[mode]
    conns = await connect(port, n_conns)
    try:
        cpu0 = cpu_seconds(pid) if pid else 0.0
        gen0 = time.process_time()
        phase.started = time.perf_counter()
        if phase.seconds is not None:
            phase.deadline = phase.started + phase.seconds
        for c in conns:
            c.start(phase, per_conn or depth)
        if phase.inflight == 0:
            phase.ended = phase.started
        else:
            await asyncio.wait_for(phase.finished, timeout)
        gen = time.process_time() - gen0
        cpu = cpu_seconds(pid) - cpu0 if pid else float("nan")
    finally:
        await close(conns)
    elapsed = max(phase.ended - phase.started, 1e-9)
    calls = max(phase.done, 1)
    if phase.bad:
        raise RuntimeError(
            f"{phase.bad} of {phase.done} answers were not {phase.expect.decode()};"
            f" first: {phase.first_bad[:300]!r}"
        )
    return {
        "calls": phase.done,
        "seconds": elapsed,
        "rate": phase.done / elapsed,
        "server_cpu_us": 1e6 * cpu / calls,
        "gen_cpu_us": 1e6 * gen / calls,
    }


ORDER: Final = ("add", "loads", "prefill_complete", "free")  # frees what add booked


async def measure_run(
    targets: dict[str, tuple[int, int | None]],
    tag: str,
    modes: list[str],
    endpoints: list[str],
    seconds: float,
    depth: int,
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """One run: per mode, each endpoint on every server in turn (so all share a phase of the
    machine), in the order add, loads, prefill_complete, free; prefill_complete and free use
    the ids that server's add booked, and what free did not reach is freed untimed."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {s: {} for s in targets}
    timeout = 10 * seconds + 30
    for mode in modes:
        t = f"{tag}{mode}".encode()
        booked: dict[str, int] = {}
        for endpoint in ORDER:
            if endpoint not in endpoints and endpoint not in ("add", "free"):
                continue
            for s, (port, pid) in targets.items():
                if endpoint == "add":
                    phase = Phase(add_maker(t), 201, None, seconds)
                elif endpoint == "loads":
                    phase = Phase(lambda i: LOADS_REQUEST, 200, None, seconds)
                else:
                    phase = Phase(
                        by_request_maker(f"/{endpoint}".encode(), t), 200, booked[s], seconds
                    )
                res = await measure(port, pid, mode, depth, phase, timeout)
                if endpoint == "add":
                    booked[s] = phase.done
                if endpoint == "free" and phase.done < booked[s]:  # untimed: leave no booking
                    rest = Phase(
                        by_request_maker(b"/free", t, phase.done), 200, booked[s] - phase.done, None
                    )
                    await measure(port, None, "pipe", 64, rest, timeout)
                if endpoint in endpoints:
                    out[s].setdefault(mode, {})[endpoint] = res
    return out


WRK_FREE_LUA: Final = """wrk.method = "POST"
wrk.body = '{"model_name":"bench","request_id":"never-added"}'
wrk.headers["Content-Type"] = "application/json"
"""


async def wrk_check(port: int, seconds: float, lua: str) -> dict[str, float]:
    """The c16 cross-check with a C client: GET /loads and POST /free (an id never added)."""
    out = {}
    for name, path, extra in (("loads", "/loads", []), ("free", "/free", ["-s", lua])):
        proc = await asyncio.create_subprocess_exec(
            "wrk",
            "-t1",
            "-c16",
            f"-d{max(1, round(seconds))}s",
            *extra,
            f"http://127.0.0.1:{port}{path}",
            stdout=asyncio.subprocess.PIPE,
        )
        text = (await proc.communicate())[0].decode()
        if "Non-2xx" in text or "Socket errors" in text or proc.returncode:
            raise RuntimeError(f"wrk {path} on port {port}: {text}")
        rate = next(line for line in text.splitlines() if line.startswith("Requests/sec:"))
        out[name] = float(rate.split()[1])
    return out


# ---------------------------------------------------------------------------------------------
# Servers as child processes, the probe, the report.


async def one_shot(
    port: int, raw: bytes, timeout: float = 5.0, host: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    """One request on a connection of its own: the status, the headers (lower-case names)
    and the body."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


async def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            status, _, _ = await one_shot(port, b"GET /health HTTP/1.1\r\nHost: b\r\n\r\n", 2.0)
            if status == 200:
                return
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        if time.monotonic() > give_up:
            raise RuntimeError(f"server on port {port} not ready after {timeout} s")
        await asyncio.sleep(0.2)


async def register_workers(port: int) -> None:
    for w in range(WORKERS):
        body = b'{"worker_id":%d,"model_name":"bench","block_size":16,"dp_start":0,"dp_size":1}' % w
        status, _, text = await one_shot(port, post_request(b"/register", body))
        if status not in (201, 409):
            raise RuntimeError(f"register {w} on port {port}: {status} {text!r}")


FREE_Z: Final = b'{"model_name":"bench","request_id":"z"}'
PROBES: Final = [
    ("add, no Content-Type", post_request(b"/add", b'{"model_name":"m"}', None)),
    ("add, text/plain", post_request(b"/add", b'{"model_name":"m"}', b"text/plain")),
    ("add, malformed JSON", post_request(b"/add", b'{"model_name":')),
    ("add, empty body", post_request(b"/add", b"")),
    (
        "add, request_id 5",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":5,"worker_id":1,"dp_rank":0,"sequence_hashes":[]}',
        ),
    ),
    (
        "add, no sequence_hashes",
        post_request(b"/add", b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0}'),
    ),
    (
        "add, hash 2^63",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a","worker_id":1,'
            b'"dp_rank":0,"sequence_hashes":[9223372036854775808]}',
        ),
    ),
    (
        "add, hash null",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a","worker_id":1,'
            b'"dp_rank":0,"sequence_hashes":[null]}',
        ),
    ),
    (
        "add, new_isl_tokens -1",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a",'
            b'"worker_id":1,"dp_rank":0,"sequence_hashes":[],'
            b'"new_isl_tokens":-1}',
        ),
    ),
    ("free, +json type", post_request(b"/free", FREE_Z, b"application/x+json")),
    ("free, charset param", post_request(b"/free", FREE_Z, b"application/json; charset=utf-8")),
    (
        "add, worker_id 2^64",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a",'
            b'"worker_id":18446744073709551616,"dp_rank":0,'
            b'"sequence_hashes":[]}',
        ),
    ),
    ("GET /nope", b"GET /nope HTTP/1.1\r\nHost: b\r\n\r\n"),
    ("GET /add", b"GET /add HTTP/1.1\r\nHost: b\r\n\r\n"),
    ("POST /loads", post_request(b"/loads", b"{}")),
    ("DELETE /health", b"DELETE /health HTTP/1.1\r\nHost: b\r\n\r\n"),
]


async def probe(ports: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for name, raw in PROBES:
        row: dict[str, Any] = {"case": name}
        for server, port in ports.items():
            try:
                status, headers, body = await one_shot(port, raw)
                row[server] = {
                    "status": status,
                    "body": body.decode("utf-8", "replace"),
                    "allow": headers.get("allow", ""),
                }
            except Exception as e:  # a server that hangs or drops the case is a result too
                row[server] = {"status": 0, "body": f"<{type(e).__name__}: {e}>", "allow": ""}
        rows.append(row)
    return rows


def versions(dynamo_python: str | None) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("msgspec", "aiohttp", "uvicorn", "starlette", "httptools", "granian", "uvloop"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    if dynamo_python:
        out["ai-dynamo-runtime"] = subprocess.run(
            [
                dynamo_python,
                "-c",
                "from importlib.metadata import version as v;print(v('ai-dynamo-runtime'))",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
    return out


def table(
    results: dict[str, Any],
    servers: list[str],
    modes: list[str],
    endpoints: list[str],
    key: str,
    fmt: str,
) -> list[str]:
    lines = []
    head = f"| mode | endpoint | {' | '.join(servers)} |"
    if key == "rate" and "dynamo" in servers:
        others = [s for s in servers if s not in ("dynamo", "trivial")]
        head += "".join(f" {s}/dynamo |" for s in others)
    else:
        others = []
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for mode in modes:
        for e in endpoints:
            med = {}
            for s in servers:
                vals = [r[mode][e][key] for r in results[s] if e in r.get(mode, {})]
                med[s] = statistics.median(vals) if vals else float("nan")
            cells = [format(med[s], fmt) for s in servers]
            cells += [f"{med[s] / med['dynamo']:.0%}" for s in others]
            lines.append(f"| {mode} | {e} | {' | '.join(cells)} |")
    return lines


async def main_async(args: argparse.Namespace) -> int:
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in CANDIDATES and s != "dynamo":
            raise SystemExit(f"unknown server {s!r}")
    if "dynamo" in servers and not args.dynamo_python:
        print("no --dynamo-python: Dynamo's tracker left out", file=sys.stderr)
        servers.remove("dynamo")
    if args.wrk and not shutil.which("wrk"):
        raise SystemExit("--wrk: no wrk on PATH (Debian: apt-get install wrk)")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    tmp = tempfile.mkdtemp(prefix="http-bench-")
    try:
        for s in servers:
            port = free_port()
            if s == "dynamo":
                cmd = [args.dynamo_python, "-m", "dynamo.slot_tracker", "--port", str(port)]
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--serve", s, "--port", str(port)]
            procs[s] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
            )
            ports[s] = port
        for target in args.target:
            name, _, port_text = target.partition("=")
            ports[name] = int(port_text)
            servers.append(name)
        for s in servers:
            if s in procs:
                await wait_ready(ports[s], procs[s])
            await register_workers(ports[s])

        if args.probe:
            ports = {s: p for s, p in ports.items() if s != "trivial"}
            servers = list(ports)
            rows = await probe(ports)
            if args.json:
                print(json.dumps(rows, indent=1))
                return 0
            ref = "dynamo" if "dynamo" in servers else servers[0]
            for row in rows:
                print(f"{row['case']}:")
                for s in servers:
                    r = row[s]
                    same = (
                        ""
                        if s == ref
                        else (
                            "  [same]"
                            if (r["status"], r["body"], r["allow"])
                            == (row[ref]["status"], row[ref]["body"], row[ref]["allow"])
                            else "  [same status]"
                            if r["status"] == row[ref]["status"]
                            else "  [DIFFERENT STATUS]"
                        )
                    )
                    allow = f" allow={r['allow']}" if r["allow"] else ""
                    print(f"  {s:>10} {r['status']}{allow} {r['body'][:150]}{same}")
            return 0

        modes = args.modes.split(",")
        endpoints = args.endpoints.split(",")
        info = {
            "machine": machine(),
            "versions": versions(args.dynamo_python),
            "argv": sys.argv[1:],
            "servers": servers,
            "ports": ports,
        }
        print(f"# {info['machine']} {info['versions']}", file=sys.stderr)
        results: dict[str, list[Any]] = {s: [] for s in servers}
        wrk: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
        lua = os.path.join(tmp, "free.lua")
        with open(lua, "w") as f:
            f.write(WRK_FREE_LUA)
        for run in range(args.runs):
            order = rotated(servers, run)
            targets = {
                s: (ports[s], procs[s].pid if s in procs else listener_pid(ports[s])) for s in order
            }
            out = await measure_run(targets, f"r{run}", modes, endpoints, args.seconds, args.depth)
            for s in order:
                res = out[s]
                results[s].append(res)
                brief = ", ".join(
                    f"{m}:{e}={res[m][e]['rate']:,.0f}" for m in modes for e in endpoints
                )
                if args.wrk:
                    wrk[s].append(await wrk_check(ports[s], args.seconds, lua))
                    brief += f", wrk c16: {wrk[s][-1]}"
                print(f"run {run + 1} {s}: {brief}", file=sys.stderr)
        info["results"] = results
        if args.wrk:
            info["wrk_c16"] = wrk
        if args.save:
            with open(args.save, "w") as f:
                json.dump(info, f, indent=1)
        if args.json:
            print(json.dumps(info, indent=1))
            return 0
        print(f"machine: {info['machine']}\nversions: {info['versions']}")
        print(
            f"\nmedian calls/s over {args.runs} runs ({args.seconds} s each; "
            f"pipe = {args.depth} in flight)\n"
        )
        print("\n".join(table(results, servers, modes, endpoints, "rate", ",.0f")))
        print("\nserver CPU µs per call (all its threads; median)\n")
        print("\n".join(table(results, servers, modes, endpoints, "server_cpu_us", ".1f")))
        print("\ngenerator CPU µs per call (median)\n")
        print("\n".join(table(results, servers, modes, endpoints, "gen_cpu_us", ".1f")))
        if args.wrk:
            print(
                "\nc16 cross-check with wrk -t1 -c16 (median calls/s; free of an id never added)\n"
            )
            print(f"| endpoint | {' | '.join(servers)} |\n|---|" + "---|" * len(servers))
            for e in ("loads", "free"):
                cells = [f"{statistics.median(r[e] for r in wrk[s]):,.0f}" for s in servers]
                print(f"| {e} | {' | '.join(cells)} |")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        stop(procs.values(), timeout=10)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument(
        "--servers",
        default="aiohttp,starlette,asgi,granian,httptools,trivial,dynamo",
        help="comma-separated: aiohttp, starlette, asgi, granian, httptools, trivial, dynamo",
    )
    p.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYNAMO_PYTHON"),
        help="python of a venv with ai-dynamo-runtime==1.6.1 ($DYNAMO_PYTHON)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="also measure a server already listening on 127.0.0.1:PORT",
    )
    p.add_argument("--modes", default="seq,c16,pipe")
    p.add_argument("--endpoints", default="add,prefill_complete,free,loads")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--depth", type=int, default=32, help="requests in flight when pipelined")
    p.add_argument("--probe", action="store_true", help="the contract's error cases, no load")
    p.add_argument(
        "--wrk",
        action="store_true",
        help="also measure c16 /loads and /free with wrk (a C client), if installed",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", metavar="FILE", help="also write the JSON with every run")
    p.add_argument("--serve", choices=sorted(CANDIDATES), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        run_loop(CANDIDATES[args.serve](args.port))
        return 0
    result: list[int] = []

    async def go() -> None:
        result.append(await main_async(args))

    run_loop(go())
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
