"""``http_servers.py``'s candidates: minimal servers of the slot tracker's shape, one per HTTP
library, with nothing behind them (no NATS, no state), so that each library's own ceiling shows.

Each is run in a child process (``http_servers.py --serve KIND --port P``) on uvloop. They
share the contract's shapes: the bodies decoded and type-checked with msgspec into the
contract's types, the errors judged and worded as axum's extractors do.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Annotated, Any, Final

import msgspec

from projector.http.slot_reads import LoadOut

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


class Error(msgspec.Struct):
    error: str


ENCODER: Final = msgspec.json.Encoder()
OK: Final = b'{"status":"ok"}'
JSON_CT: Final = "application/json"
LOAD_ROWS: Final = [LoadOut("bench", "default", w, 0, 384 * (w % 3), 24 * w) for w in range(16)]
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
