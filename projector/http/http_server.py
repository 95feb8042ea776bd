"""The HTTP/1.1 transport of ``seqstate serve-http``: httptools' parser on an asyncio Protocol.

Why not a server library: measured on this machine with nothing behind them (BENCHMARKS.md,
"HTTP layer"), aiohttp, Starlette on uvicorn, a bare ASGI app on uvicorn and granian reach
23-51% of Dynamo's calls/s at 16 connections (granian excepted, which collapses when
pipelined) before a single NATS round trip is added; a Protocol on httptools (the parser
uvicorn itself uses, kept by the uvloop authors) reaches 149-211%. The durable path needs that
headroom. What a library would have done is kept small and explicit here:

- requests on one connection take effect one after another and are answered in order (HTTP/1.1
  pipelining), as hyper serves axum's: a call sees every effect of the calls before it on its
  connection (a pipelined add after a register finds the tracker). A call is *begun* once the
  one before it has begun (for a mutation: its event is ordered, queued on the lease holder's
  one connection or stored, so the log holds them in order), and a read once every call
  before it is answered; what is left of each call (the writer's fold of its event) is
  awaited by all of them at once. Connections run concurrently;
- no task, future or callback per call (issue 23: on this path they were a large part of a
  call's cost): a :class:`Call` is a small object the handler tells ``begun()`` and
  ``answer()``, and the connection moves on from there. It runs on uvloop's transports as on
  asyncio's;
- at most ``MAX_IN_FLIGHT`` calls per connection: beyond that the connection stops being read
  (TCP backpressure), never buffered without bound;
- a body over ``MAX_BODY`` bytes is 413 (axum's default limit, 2 MiB); a request that does not
  parse is 400 and the connection closes; ``Connection: close`` and HTTP/1.0 close after the
  response;
- with a bearer token (``serve(..., token=...)``), a call without ``Authorization: Bearer
  <token>`` is 401 before anything else is looked at (its route, its body, which is not even
  kept): the slot tracker's API books and frees capacity, so whoever can reach the port must
  not be able to use it unless the operator says so. The token is compared in constant time
  (SHA-256 digests of the two, so not even its length leaks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections import deque
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qsl

import httptools
import msgspec

log = logging.getLogger("seqstate.http")

MAX_BODY = 2 * 1024 * 1024
MAX_IN_FLIGHT = 64
Answer = tuple[int, object]  # status, JSON payload (None: an empty body)


class Handler(Protocol):
    def submit(self, call: Call) -> None:
        """Start ``call``: :meth:`Call.begun` once its effects are ordered (its event stored,
        or queued where nothing can overtake it), :meth:`Call.answer` once answered (which
        implies begun). Either may be called before ``submit`` returns."""

    def reads(self, path: str) -> bool:
        """Whether a call must wait for the answers of those before it to begin."""

    def allowed(self, path: str) -> str | None:
        """The ``Allow`` header of a route (None: no such route)."""


UNAUTHORIZED = {"error": "unauthorized: this server wants 'Authorization: Bearer <token>'"}
CHALLENGE = 'Bearer realm="seqstate"'


class Encoded:
    """A JSON body encoded already (a read answered from a cache): written as it is."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


def response(
    status: int,
    payload: object,
    *,
    close: bool,
    allow: str | None = None,
    challenge: str | None = None,
) -> bytes:
    if payload is None:
        body = b""
    elif type(payload) is Encoded:
        body = payload.data
    else:
        body = msgspec.json.encode(payload)
    parts = [_STATUS_LINES[status], b"content-length: %d\r\n" % len(body)]
    if payload is not None:
        parts.append(b"content-type: application/json\r\n")
    if allow is not None:
        parts.append(f"allow: {allow}\r\n".encode())
    if challenge is not None:
        parts.append(f"www-authenticate: {challenge}\r\n".encode())
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    parts.append(body)
    return b"".join(parts)


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def _credential(authorization: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value (the scheme's case does
    not matter, RFC 7235), or None for any other scheme."""
    scheme, _, credential = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credential.strip()


WAITING, SUBMITTED, BEGUN, ANSWERED = range(4)


class Call:
    """One request on a connection, from its parse to its response's bytes.

    No task, future or callback is made per call: the handler calls :meth:`begun` and
    :meth:`answer`, and the connection moves on from there."""

    __slots__ = (
        "body",
        "close",
        "conn",
        "content_type",
        "data",
        "method",
        "path",
        "query",
        "state",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        path: str,
        query: dict[str, str],
        content_type: str | None,
        body: bytes,
        close: bool,
    ) -> None:
        self.conn = conn
        self.method = method
        self.path = path
        self.query = query
        self.content_type = content_type
        self.body = body
        self.close = close
        self.state = WAITING
        self.data = b""

    def begun(self) -> None:
        if self.state == SUBMITTED:
            self.state = BEGUN
            self.conn.not_begun -= 1
            self.conn.advance()

    def answer(self, status: int, payload: object) -> None:
        if self.state == ANSWERED:
            return
        allow = self.conn.handler.allowed(self.path) if status == 405 else None
        data = response(status, payload, close=self.close, allow=allow)
        self.data = data[: data.index(b"\r\n\r\n") + 4] if self.method == "HEAD" else data
        conn = self.conn
        if self.state == SUBMITTED:
            conn.not_begun -= 1
        if self.state != WAITING:
            conn.not_answered -= 1
        self.state = ANSWERED
        conn.advance()


class _Connection(asyncio.Protocol):
    def __init__(self, handler: Handler, token_digest: bytes | None = None) -> None:
        self.handler = handler
        self.token_digest = token_digest  # None: every call is let in
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.calls: deque[Call] = deque()  # every call not yet written, in order
        self.waiting: deque[Call] = deque()  # the calls not submitted yet: always a suffix
        self.not_begun = 0  # submitted calls not begun yet
        self.not_answered = 0  # submitted calls not answered yet
        self._advancing = False
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.content_type: str | None = None
        self.authorization: bytes | None = None
        self.authorizations = 0  # Authorization headers seen: more than one is refused
        self.authorised = self.token_digest is None
        self.body: list[bytes] = []
        self.size = 0
        self.too_large = False
        self.close_after = False

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio class

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply_now(400, {"error": "upgrades are not supported"}, close=True)
        except httptools.HttpParserError:
            self._reply_now(400, {"error": "malformed HTTP request"}, close=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.clear()
        self.waiting.clear()
        self.transport = None

    # ---- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered == b"connection" and value.lower() == b"close":
            self.close_after = True
        elif lowered == b"authorization":
            self.authorization = value
            self.authorizations += 1

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() == "1.0" and not self.parser.should_keep_alive():
            self.close_after = True
        if self.token_digest is not None and self.authorizations == 1:
            assert self.authorization is not None
            credential = _credential(self.authorization)
            self.authorised = credential is not None and hmac.compare_digest(
                _digest(credential), self.token_digest
            )

    def on_body(self, body: bytes) -> None:
        if not self.authorised:
            return  # answered 401 whatever it holds: not worth a byte of memory
        self.size += len(body)
        if self.size > MAX_BODY:
            self.too_large = True
        elif not self.too_large:
            self.body.append(body)

    def on_message_complete(self) -> None:
        close = self.close_after
        if not self.authorised:
            head_only = self.parser.get_method() == b"HEAD"
            data = response(401, UNAUTHORIZED, close=close, challenge=CHALLENGE)
            self._queue_now(data[: data.index(b"\r\n\r\n") + 4] if head_only else data, close)
            return
        if self.too_large:
            self._reply_now(
                413,
                {"error": "Failed to buffer the request body: length limit exceeded"},
                close=close,
            )
            return
        url = self.url
        if b"?" in url or b"#" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            path = parsed.path.decode("utf-8", "replace")
            query = dict(parse_qsl((parsed.query or b"").decode("utf-8", "replace")))
        else:  # the common case: a plain path, no parse needed
            path, query = url.decode("utf-8", "replace"), {}
        method = self.parser.get_method().decode("ascii", "replace")
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        call = Call(self, method, path, query, self.content_type, body, close)
        self.calls.append(call)
        self.waiting.append(call)
        self._limit()
        self.advance()

    # ---- answering in order -----------------------------------------------------------------

    def advance(self) -> None:
        """Write what is answered at the front, then submit what may begin now: a call once
        every call before it has begun (so their effects are ordered), a read once every
        call before it is answered. Re-entered by a handler that answers at once: the outer
        loop goes on instead."""
        if self._advancing:
            return
        self._advancing = True
        try:
            progress = True
            while progress:
                self._write_answered()
                progress = False
                waiting = self.waiting
                if (
                    waiting
                    and self.not_begun == 0
                    and (self.not_answered == 0 or not self.handler.reads(waiting[0].path))
                    and self.transport is not None
                ):
                    call = waiting.popleft()
                    call.state = SUBMITTED
                    self.not_begun += 1
                    self.not_answered += 1
                    try:
                        self.handler.submit(call)
                    except Exception:  # a bug must not take the connection's other calls along
                        log.exception("call %s %s failed", call.method, call.path)  # no body
                        call.answer(500, {"error": "internal error"})
                    progress = True
        finally:
            self._advancing = False

    def _write_answered(self) -> None:
        calls, transport = self.calls, self.transport
        wrote = False
        while calls and calls[0].state == ANSWERED and transport is not None:
            call = calls.popleft()
            transport.write(call.data)
            wrote = True
            if call.close:
                transport.close()
                self.transport = None
                self.waiting.clear()
                return
        if wrote and self.paused and len(calls) < MAX_IN_FLIGHT // 2 and transport is not None:
            transport.resume_reading()
            self.paused = False

    def _limit(self) -> None:
        if len(self.calls) >= MAX_IN_FLIGHT and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True

    def _reply_now(self, status: int, payload: object, *, close: bool) -> None:
        self._queue_now(response(status, payload, close=close), close)

    def _queue_now(self, data: bytes, close: bool) -> None:
        """A reply that needs no handler (401, 413, 400): it has no effect to order."""
        call = Call(self, "", "", {}, None, b"", close)
        call.state = ANSWERED
        call.data = data
        self.calls.append(call)
        self._limit()
        self.advance()


async def serve(
    handler: Handler, host: str, port: int, *, token: bytes | None = None
) -> asyncio.Server:
    """Listen on ``host:port``; every connection's calls go to ``handler``, or, with a
    ``token``, those that carry it as ``Authorization: Bearer <token>`` (others are 401)."""
    loop = asyncio.get_running_loop()
    digest = None if token is None else _digest(token)
    return await loop.create_server(
        lambda: _Connection(handler, digest), host, port, reuse_address=True
    )


async def close(server: asyncio.Server) -> None:
    server.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(server.wait_closed(), 5)
