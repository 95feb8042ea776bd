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
- no task, future or callback per call (on this path they were a large part of a
  call's cost): a :class:`Call` is a small object the handler tells ``begun()`` and
  ``answer()``, and the connection moves on from there. It runs on uvloop's transports as on
  asyncio's;
- at most ``MAX_IN_FLIGHT`` calls per connection, and about ``WRITE_HIGH`` bytes of answers
  its client has not read: beyond either the connection stops being read (TCP backpressure),
  and beyond the second its calls stop being begun, until they drain; never buffered without
  bound, and other connections are served on. The bodies of calls read but not begun yet
  (pipelined behind others) are bounded too: ``MAX_QUEUED`` bytes per connection, and
  ``MAX_QUEUED_TOTAL`` over every connection (a connection that queues nothing always reads
  on); past either, reading waits until calls begin and their bodies are let go;
- every part of a request is bounded as it arrives, before it is kept: a URL over ``MAX_URL``
  is 414, headers over ``MAX_HEADERS`` 431 (and so are a chunked body's size lines and
  trailer), a body over ``MAX_BODY`` 413 (axum's default
  limit, 2 MiB; with its ``Content-Length`` it is refused before it is read); a request that
  does not parse is 400. Each refusal is a JSON error, and the connection closes after it;
- a head must arrive within ``HEAD_TIMEOUT_S`` (slowloris), a body within ``BODY_TIMEOUT_S``
  (408); a connection idle for ``IDLE_TIMEOUT_S`` is closed, one that reads none of its
  answers for ``SEND_TIMEOUT_S`` aborted; ``Connection: close`` and HTTP/1.0 close after the
  response;
- at most ``max_connections`` connections at once (:mod:`projector.http.listener`): one more
  is answered 503 and closed unread, and running out of file descriptors neither stops the
  listening nor goes unsaid;
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
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qsl

import httptools
import msgspec

from projector.http.listener import LINGER_S, Listener, listen
from projector.settings.config import DEFAULT_HTTP_MAX_CONNECTIONS
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.http")

# What one request may be (the most trusted servers' practice: bound everything, name each
# refusal, close the connection after it). nginx's and hyper's limits are of these sizes.
MAX_URL = 8 * 1024  # the request target: 414 over it
MAX_HEADERS = 16 * 1024  # every header line, "name: value\r\n": 431 over it
MAX_HEAD = MAX_URL + MAX_HEADERS + 8 * 1024  # what a head may take on the wire: 431 over it
# A body: axum's default limit. A 1M-token prompt's /add (62,500 i64 hashes) is ~1.3 MB.
MAX_BODY = 2 * 1024 * 1024
MAX_IN_FLIGHT = 64
MAX_QUEUED = 4 * 1024 * 1024  # bodies of a connection's calls read but not yet begun
MAX_QUEUED_TOTAL = 64 * 1024 * 1024  # the same over every connection of the process
PIECE = 4096  # a head is parsed this many bytes at a time, and counted in between
WRITE_HIGH = 64 * 1024  # answers not read by the client beyond this: its requests wait
HEAD_TIMEOUT_S = 5.0  # a request's head (the first: from the connection's opening)
BODY_TIMEOUT_S = 30.0  # a request's body, from its head's first byte
IDLE_TIMEOUT_S = 120.0  # nothing in flight; over reqwest's 90 s pool idle timeout
SEND_TIMEOUT_S = 60.0  # answers not read at all for this long: the connection is aborted
HEADERS_TOO_LARGE = f"the request's headers are over {MAX_HEADERS} bytes"
FRAMING_TOO_LARGE = (
    f"the request's chunked framing (a chunk's size line, or the trailer after the last chunk) "
    f"is over {MAX_HEADERS} bytes"
)
TOO_LARGE = "Failed to buffer the request body: length limit exceeded"  # axum's words
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

    __slots__ = ("data", "ok")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.ok = b""  # its whole 200 response once made (a read answered again and again)


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


def response(
    status: int,
    payload: object,
    *,
    close: bool,
    allow: str | None = None,
    challenge: str | None = None,
) -> bytes:
    if type(payload) is Encoded and status == 200 and not close:  # allow, challenge: never
        if not payload.ok:
            payload.ok = _STATUS_LINES[200] + b"content-length: %d\r\n%b\r\n%b" % (
                len(payload.data),
                b"content-type: application/json\r\n",
                payload.data,
            )
        return payload.ok
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


class _QueuedBodies:
    """The bytes of bodies read but not yet begun, over every connection of the process, and
    the connections that wait for them to go down before they read on."""

    __slots__ = ("total", "waiting")

    def __init__(self) -> None:
        self.total = 0
        self.waiting: set[_Connection] = set()

    def release(self, size: int) -> None:
        self.total -= size
        if self.waiting and self.total <= MAX_QUEUED_TOTAL:
            woken, self.waiting = self.waiting, set()
            for conn in woken:
                conn._maybe_resume()


_QUEUED = _QueuedBodies()


class _Refused(SeqstateError):
    """Raised in a parser callback to stop the parse: the connection's refusal says why."""


HEAD, BODY, BETWEEN = range(3)  # where a connection is in its current request
TARGETS_KEPT = 256  # request targets whose parse is remembered (a scheduler polls one URL)
_targets: dict[bytes, tuple[str, dict[str, str]]] = {}


def _target(url: bytes) -> tuple[str, dict[str, str]]:
    """A request target's path and query. A poller asks the same URL over and over
    (``/loads?model_name=...``): its parse is remembered, and each call gets a copy of the
    query (a handler may keep it)."""
    known = _targets.get(url)
    if known is not None:
        return known[0], known[1].copy()
    if b"?" in url or b"#" in url or not url.startswith(b"/"):
        parsed = httptools.parse_url(url)
        path = parsed.path.decode("utf-8", "replace")
        query = dict(parse_qsl((parsed.query or b"").decode("utf-8", "replace")))
    else:  # the common case: a plain path, no parse needed
        path, query = url.decode("utf-8", "replace"), {}
    if len(_targets) >= TARGETS_KEPT:
        _targets.clear()
    _targets[url] = (path, query)
    return path, query.copy()


class _Connection(asyncio.Protocol):
    def __init__(
        self, handler: Handler, token_digest: bytes | None, release: Callable[[], None]
    ) -> None:
        self.handler = handler
        self.release = release  # its place among the connections served, given back at close
        self.token_digest = token_digest  # None: every call is let in
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.calls: deque[Call] = deque()  # every call not yet written, in order
        self.waiting: deque[Call] = deque()  # the calls not submitted yet: always a suffix
        self.queued = 0  # the bytes of their bodies (also counted in _QUEUED.total)
        self.not_begun = 0  # submitted calls not begun yet
        self.not_answered = 0  # submitted calls not answered yet
        self._advancing = False
        self._feeding = False  # parsing what was read: answers are written after it
        self.paused = False  # not reading: too many calls in flight, or output not drained
        self.reading = True  # the transport's own state (paused or not)
        self.writing_paused = False  # the transport's buffer is over its high-water mark
        self.write_paused_at = 0.0
        self.held: bytes | None = None  # received, not parsed yet (arrived as we paused)
        self.resuming = False
        self.refused = False  # a refusal is queued: nothing more is read
        self.phase = HEAD  # the first request's head is timed from the connection
        self.since = self.loop.time()  # when the current request's first byte came
        self.head_bytes = 0  # received while a head is incomplete (over-counted by a piece)
        self.requests = 0  # requests parsed: an idle connection is one that adds none
        self.idle_mark = -1
        self.idle_since = 0.0
        self.watchdog: asyncio.TimerHandle | None = None
        self.timers: list[asyncio.TimerHandle] = []  # the closing's: cancelled once closed
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.content_type: str | None = None
        self.content_length: int | None = None
        self.authorization: bytes | None = None
        self.authorizations = 0  # Authorization headers seen: more than one is refused
        self.authorised = self.token_digest is None
        self.body: list[bytes] = []
        self.size = 0
        self.header_bytes = 0
        self.framing = 0  # a chunked body's bytes since its last chunk that are not its data
        self.close_after = False

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio class
        transport.set_write_buffer_limits(high=WRITE_HIGH)  # type: ignore[attr-defined]
        self.watchdog = self.loop.call_later(HEAD_TIMEOUT_S, self._watch)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # answered already: the rest is not read, only let drain until the close
        self._feed(data)

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client does not read what
        it is sent. Its calls are not begun, nor its requests read, until it does (TCP
        backpressure): beyond the mark wait only the answers of calls begun already (one
        read at most: a read begins once every call before it is answered)."""
        self.writing_paused = True
        self.write_paused_at = self.loop.time()
        self._pause()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.advance()  # the calls read meanwhile
        self._maybe_resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        self.calls.clear()
        self._drop_waiting()
        self.held = None
        self.transport = None
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        for timer in self.timers:
            timer.cancel()

    # ---- reading, bounded -------------------------------------------------------------------

    def _feed(self, data: bytes | memoryview) -> None:
        """Parse ``data``; the answers it gets at once (pipelined reads) go out in one write
        at the end, not one each."""
        self._feeding = True
        try:
            self._parse(data)
        finally:
            self._feeding = False
        self._write_answered()

    def _parse(self, data: bytes | memoryview) -> None:
        """Parse ``data`` a piece at a time: a head's bytes are counted as they come, so none
        grows past ``MAX_HEAD`` in the parser (httptools keeps a header it has not finished);
        a body of a known length is fed to its end. Once reading is paused, what is left is
        held until it resumes: the calls in flight stay bounded."""
        parser = self.parser
        while data:
            if self.phase == BODY and self.content_length is not None:
                limit = self.content_length - self.size
            else:
                limit = PIECE
            if len(data) > limit:
                if type(data) is bytes:
                    data = memoryview(data)  # sliced without a copy
                piece, data = data[:limit], data[limit:]
            else:  # the common case: one request, or the rest of a body
                piece, data = data, b""
            in_body = self.phase == BODY  # a body's bytes are not a head's, even the last
            size = self.size
            try:
                parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                self._refuse(400, "upgrades are not supported")
                return
            except httptools.HttpParserError:
                if not self.refused:
                    self._refuse(400, "malformed HTTP request")
                return
            if not in_body and self.phase != BODY:
                self.head_bytes += len(piece)
                if self.head_bytes > MAX_HEAD:  # the URL is not (on_url): its headers are
                    self._refuse(431, HEADERS_TOO_LARGE)
                    return
            elif in_body and self.content_length is None and self.phase == BODY:
                # A chunked body: what is not its data (chunk size lines with their extensions,
                # the trailer) is counted as a head is, since httptools keeps a trailer's
                # header it has not finished, grown a piece at a time (over by a piece at most)
                self.framing += len(piece) - (self.size - size)
                if self.framing > MAX_HEADERS:
                    self._refuse(431, FRAMING_TOO_LARGE)
                    return
            if self.paused and data:
                self.held = bytes(data)
                return

    def _refuse(self, status: int, error: str) -> None:
        """Answer ``status`` once the calls before it are answered, and close: nothing more
        is read from this connection (a client may still be sending what was refused)."""
        self.refused = True
        self.held = None
        self._pause()
        self._queue_now(response(status, {"error": error}, close=True), True)

    def _refusal(self, status: int, error: str) -> _Refused:
        self._refuse(status, error)
        return _Refused(error)

    def _pause(self) -> None:
        self.paused = True
        if self.reading and self.transport is not None:
            self.transport.pause_reading()
            self.reading = False

    def _maybe_resume(self) -> None:
        if self.paused and not self.resuming and self._may_read():
            self.resuming = True
            self.loop.call_soon(self._resume)

    def _may_read(self) -> bool:
        if self.queued and _QUEUED.total > MAX_QUEUED_TOTAL:
            _QUEUED.waiting.add(self)  # others' bodies first: woken when they go down
            return False
        return (
            not self.writing_paused
            and len(self.calls) < MAX_IN_FLIGHT // 2
            and self.queued < MAX_QUEUED // 2
            and not self.refused
            and self.transport is not None
        )

    def _resume(self) -> None:
        """Read again: what was held first. The client waited for us, so the request it is
        in the middle of is timed afresh."""
        self.resuming = False
        if not self.paused or not self._may_read():
            return
        self.paused = False
        self.since = self.loop.time()
        held, self.held = self.held, None
        if held:
            self._feed(held)
        if not self.paused and not self.reading and self.transport is not None:
            self.transport.resume_reading()
            self.reading = True

    # ---- timeouts ---------------------------------------------------------------------------

    def _watch(self) -> None:
        """Every few seconds at most, while the connection lives: a head not complete within
        ``HEAD_TIMEOUT_S`` of its first byte (of the connection, for the first request) or a
        body not within ``BODY_TIMEOUT_S`` is 408 (a client that sent nothing is closed
        silently); a connection with nothing in flight for ``IDLE_TIMEOUT_S`` is closed; one
        whose output has not drained for ``SEND_TIMEOUT_S`` is aborted. Time spent paused by
        us is not the client's: the clocks start again when reading does."""
        self.watchdog = None
        transport = self.transport
        if transport is None:
            return
        now = self.loop.time()
        if self.writing_paused and now - self.write_paused_at >= SEND_TIMEOUT_S:
            log.info("closing a connection that has not read its answers for %g s", SEND_TIMEOUT_S)
            transport.abort()
            return
        wait = HEAD_TIMEOUT_S
        if self.refused or self.paused:
            pass
        elif self.phase == HEAD or self.phase == BODY:
            limit = HEAD_TIMEOUT_S if self.phase == HEAD else BODY_TIMEOUT_S
            wait = self.since + limit - now
            if wait <= 0:
                if self.phase == HEAD and self.requests == 0 and self.head_bytes == 0:
                    transport.close()  # it never sent a byte: nothing to answer
                    return
                part = "head" if self.phase == HEAD else "body"
                self._refuse(408, f"the request's {part} did not arrive within {limit:g} s")
                wait = HEAD_TIMEOUT_S
        elif not self.calls:  # between requests, nothing owed (perhaps a few stray CRLFs)
            if self.idle_mark != self.requests:
                self.idle_mark, self.idle_since = self.requests, now
            wait = self.idle_since + IDLE_TIMEOUT_S - now
            if wait <= 0:
                transport.close()
                return
        self.watchdog = self.loop.call_later(min(wait, HEAD_TIMEOUT_S), self._watch)

    # ---- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()
        self.phase = HEAD
        self.since = self.loop.time()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL:
            raise self._refusal(414, f"the request's URL is over {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        if self.header_bytes > MAX_HEADERS:
            raise self._refusal(431, HEADERS_TOO_LARGE)
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered == b"content-length":
            with contextlib.suppress(ValueError):  # the parser refuses a malformed one
                self.content_length = int(value)
        elif lowered == b"connection" and value.lower() == b"close":
            self.close_after = True
        elif lowered == b"authorization":
            self.authorization = value
            self.authorizations += 1

    def on_headers_complete(self) -> None:
        self.phase = BODY
        if self.parser.get_http_version() == "1.0" and not self.parser.should_keep_alive():
            self.close_after = True
        if self.token_digest is not None and self.authorizations == 1:
            assert self.authorization is not None
            credential = _credential(self.authorization)
            self.authorised = credential is not None and hmac.compare_digest(
                _digest(credential), self.token_digest
            )
        if self.authorised and (self.content_length or 0) > MAX_BODY:
            raise self._refusal(413, TOO_LARGE)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if not self.authorised:
            return  # answered 401 whatever it holds: not worth a byte of memory
        if self.size > MAX_BODY:  # a chunked body: its length was not told in advance
            raise self._refusal(413, TOO_LARGE)
        self.body.append(body)

    def on_chunk_complete(self) -> None:
        self.framing = 0

    def on_message_complete(self) -> None:
        self.phase = BETWEEN
        self.head_bytes = 0
        self.requests += 1
        close = self.close_after
        if not self.authorised:
            head_only = self.parser.get_method() == b"HEAD"
            data = response(401, UNAUTHORIZED, close=close, challenge=CHALLENGE)
            self._queue_now(data[: data.index(b"\r\n\r\n") + 4] if head_only else data, close)
            return
        path, query = _target(self.url)
        method = self.parser.get_method().decode("ascii", "replace")
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        call = Call(self, method, path, query, self.content_type, body, close)
        self.calls.append(call)
        self.waiting.append(call)
        self.queued += len(body)
        _QUEUED.total += len(body)
        self._limit()
        self.advance()

    # ---- answering in order -----------------------------------------------------------------

    def advance(self) -> None:
        """Submit what may begin now: a call once every call before it has begun (so their
        effects are ordered), a read once every call before it is answered; then write what
        is answered at the front, in one write (pipelined reads answered at once go out
        together; the parser takes no request after one that closes the connection).
        Re-entered by a handler that answers at once: the outer loop goes on instead."""
        if self._advancing:
            return
        self._advancing = True
        try:
            progress = True
            while progress:
                progress = False
                waiting = self.waiting
                if (
                    waiting
                    and not self.writing_paused  # its answers wait to be read: so do its calls
                    and self.not_begun == 0
                    and (self.not_answered == 0 or not self.handler.reads(waiting[0].path))
                    and self.transport is not None
                ):
                    call = waiting.popleft()
                    if call.body:  # the handler has it from here: no longer queued
                        self.queued -= len(call.body)
                        _QUEUED.release(len(call.body))
                    call.state = SUBMITTED
                    self.not_begun += 1
                    self.not_answered += 1
                    try:
                        self.handler.submit(call)
                    except Exception:  # a bug must not take the connection's other calls along
                        log.exception("call %s %s failed", call.method, call.path)  # no body
                        call.answer(500, {"error": "internal error"})
                    progress = True
            if not self._feeding:  # else once the data read is parsed
                self._write_answered()
        finally:
            self._advancing = False
        if self.paused:  # a call begun lets its body go: perhaps reading may go on
            self._maybe_resume()

    def _write_answered(self) -> None:
        """Every answer at the front in one write: pipelined calls answered together cost one
        send, not one each."""
        calls, transport = self.calls, self.transport
        if transport is None or not calls or calls[0].state != ANSWERED:
            return
        out = []
        closing = False
        while calls and calls[0].state == ANSWERED:
            call = calls.popleft()
            out.append(call.data)
            if call.close:
                closing = True
                break
        transport.write(out[0] if len(out) == 1 else b"".join(out))
        if closing:
            self._close_after(transport)
            return
        if self.paused:
            self._maybe_resume()

    def _close_after(self, transport: asyncio.Transport) -> None:
        """Close once written. After a refusal the client may still be sending: its bytes
        are read and dropped for up to ``LINGER_S`` after our end is shut, so that it reads
        the answer rather than a reset. A client that reads none of it within
        ``SEND_TIMEOUT_S`` is cut off: a close waits for the written bytes to be taken."""
        self.transport = None
        self._drop_waiting()
        self.timers.append(self.loop.call_later(SEND_TIMEOUT_S, transport.abort))
        if not self.refused or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()
        self.timers.append(self.loop.call_later(LINGER_S, transport.close))

    def _limit(self) -> None:
        if len(self.calls) >= MAX_IN_FLIGHT or self.queued >= MAX_QUEUED:
            self._pause()
        elif self.queued and _QUEUED.total > MAX_QUEUED_TOTAL:
            self._pause()
            _QUEUED.waiting.add(self)  # woken when the bodies of all go down

    def _drop_waiting(self) -> None:
        """The calls not begun will never be: their bodies are let go."""
        self.waiting.clear()
        queued, self.queued = self.queued, 0
        _QUEUED.waiting.discard(self)
        if queued:
            _QUEUED.release(queued)

    def _queue_now(self, data: bytes, close: bool) -> None:
        """A reply that needs no handler (401, 413, 400): it has no effect to order."""
        call = Call(self, "", "", {}, None, b"", close)
        call.state = ANSWERED
        call.data = data
        self.calls.append(call)
        self._limit()
        self.advance()


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    token: bytes | None = None,
    max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS,
) -> Listener:
    """Listen on ``host:port``; every connection's calls go to ``handler``, or, with a
    ``token``, those that carry it as ``Authorization: Bearer <token>`` (others are 401).
    At most ``max_connections`` are served at once: one more is answered 503 and closed."""
    digest = None if token is None else _digest(token)
    return await listen(
        host,
        port,
        lambda release: _Connection(handler, digest, release),
        lambda why: response(503, {"error": why}, close=True),
        max_connections,
    )


async def close(server: Listener) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(server.close(), 5)
