"""serve-http's listening sockets: how many connections it holds, and what happens beyond.

Accepted here rather than by ``loop.create_server``, for two things no event loop does:

- at most ``limit`` connections are served at once. One more is still accepted, answered at
  once with a refusal that names the bound (a 503), and closed, without a byte of its request
  being parsed; those served meanwhile are untouched, and once some close, new ones are
  served again. A refused connection lingers a moment so that its client reads the answer
  rather than a reset (at most ``LINGERING`` at once: beyond, it is closed at once);
- a process out of file descriptors (EMFILE on accept) neither stops listening nor answers in
  silence. uvloop (libuv) then accepts and closes each waiting connection without a word,
  asyncio logs an error with a traceback every second; here a spare descriptor is given up to
  accept the connection, answer it 503 (out of file descriptors) and close it, then taken
  back. Were even that impossible, the listener rests ``REST_S`` and tries again: the
  connections wait in the kernel's backlog meanwhile.

Each kind of refusal is logged at its first, then at most once every ``LOG_EVERY_S`` with how
many since, never once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import cast

from projector.settings.logs import Quiet

log = logging.getLogger("seqstate.http")

BACKLOG = 511  # connections the kernel holds for us not accepted yet (nginx's, redis's)
ACCEPTS = 64  # accepted at most per readiness of a socket: others' events run in between
LINGERING = 64  # refused connections left to read their answer at once, at most
LINGER_S = 2.0  # a refused connection's client has this long to read its answer and close
REST_S = 0.5  # out of resources, and no spare descriptor: the listener rests this long
LOG_EVERY_S = 10.0  # at most one line per this many seconds for each kind of refusal
RESERVED_FDS = 64  # the process's own descriptors: NATS, the metrics port, the loop's, stdio
OUT_OF_FDS = "this server is out of file descriptors: try again later"

Release = Callable[[], None]  # a connection's: called once it is closed


class Tally:
    """One kind of refusal, said in the log at its first, then at most once every
    ``LOG_EVERY_S``: a line with how many there were since the last one (:class:`Quiet`)."""

    def __init__(self, first: str, more: str) -> None:
        self.first, self.more = first, more  # ``more`` takes the count and the seconds
        self._held = 0
        self._quiet = Quiet(LOG_EVERY_S, self._say_held)

    def add(self, *args: object) -> None:
        """One more; ``args`` fill ``first`` if it is said now."""
        if self._quiet.now():
            log.warning(self.first, *args)
        else:
            self._held += 1

    def say(self) -> None:
        """Say those held now (at a stop)."""
        self._quiet.flush()

    def _say_held(self, span_s: float) -> None:
        held, self._held = self._held, 0
        log.warning(self.more, held, span_s)


class _Refusal(asyncio.Protocol):
    """A connection answered at once and closed: what its client sends is dropped unread."""

    def __init__(self, answer: bytes, listener: Listener) -> None:
        self.answer = answer
        self.listener = listener
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.WriteTransport, base)  # uvloop's is no asyncio class
        transport.write(self.answer)
        listener = self.listener
        if listener.lingering >= LINGERING or not transport.can_write_eof():
            transport.close()
            return
        listener.lingering += 1
        transport.write_eof()  # the client reads the answer, then our end's close
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # its request: never parsed, only let drain so that the close is no reset

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.listener.lingering -= 1


class Listener:
    """Listening sockets whose connections are accepted by hand (see the module's docstring).

    ``serve_one(release)`` makes the protocol of a connection within the bound; it calls
    ``release()`` once that connection is closed. ``refusal(why)`` is the answer's bytes."""

    def __init__(
        self,
        sockets: list[socket.socket],
        serve_one: Callable[[Release], asyncio.Protocol],
        refusal: Callable[[str], bytes],
        limit: int,
    ) -> None:
        self.sockets = sockets
        self.serve_one = serve_one
        self.limit = limit
        self.open = 0  # connections served now
        self.lingering = 0  # refused ones still open
        self.loop = asyncio.get_running_loop()
        self._full = refusal(
            f"too many connections: this server holds at most {limit} at once "
            "(--http-max-connections); try again once one closes"
        )
        self._out_of_fds = refusal(OUT_OF_FDS)
        self.over_bound = Tally(
            f"refused a connection: {limit} are open, the bound (--http-max-connections); "
            "each one more is answered 503 and closed",
            "refused %d more connections over the bound in the last %.0f s",
        )
        self.out_of_fds = Tally(
            "cannot accept connections: %s (%d open); while it lasts, each one is answered "
            "503 and closed, or waits in the backlog",
            "cannot accept connections: %d more times in the last %.0f s",
        )
        self._spare: int | None = _spare()
        self._resting: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._closed = self.loop.create_future()

    @property
    def port(self) -> int:
        """The port of the first socket (``--http-port 0``: the one the kernel chose)."""
        return int(self.sockets[0].getsockname()[1])

    def start(self) -> None:
        for sock in self.sockets:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _stop_reading(self) -> None:
        for sock in self.sockets:
            self.loop.remove_reader(sock.fileno())

    async def serve_forever(self) -> None:
        """Until :meth:`close`."""
        await asyncio.shield(self._closed)

    async def close(self) -> None:
        """Stop listening (connections open go on until they close)."""
        if self._closed.done():
            return
        self._stop_reading()
        if self._resting is not None:
            self._resting.cancel()
        for sock in self.sockets:
            sock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        self.over_bound.say()
        self.out_of_fds.say()
        self._closed.set_result(None)
        for task in list(self._connecting):
            with contextlib.suppress(BaseException):
                await task

    # ---- accepting --------------------------------------------------------------------------

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(ACCEPTS):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # gone before it was accepted
            except OSError as exc:
                refused: bool | None = False
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # Linux says so, waiting or not
                    refused = self._refuse_with_spare(sock)
                    if refused is None:
                        return  # none was waiting
                self.out_of_fds.add(exc.strerror or exc, self.open)
                if not refused or self._spare is None:
                    self._rest()
                    return
                continue
            self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        slot = _Slot(self)
        protocol: asyncio.Protocol
        if self.open >= self.limit:
            self.over_bound.add()
            protocol = _Refusal(self._full, self)
        else:
            slot.take()
            protocol = self.serve_one(slot.release)
        task = self.loop.create_task(self._connect(conn, protocol, slot))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket, protocol: asyncio.Protocol, slot: _Slot) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, conn)
        except Exception as exc:  # the client left at once, say
            log.debug("a connection could not be set up: %s", exc)
            conn.close()
            slot.release()

    def _refuse_with_spare(self, sock: socket.socket) -> bool | None:
        """Out of descriptors: give up the spare one to accept a waiting connection, answer
        it and close it, then take the spare back. None if none was waiting; False if even
        then none could be accepted."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            self._spare = _spare()
            return None
        except OSError:
            return False  # the spare is taken back once the listener has rested
        with conn:
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.send(self._out_of_fds)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):  # drained: a close with unread bytes is a reset
                    pass
        self._spare = _spare()
        return True

    def _rest(self) -> None:
        """Stop accepting for ``REST_S``: the waiting connections stay in the backlog."""
        if self._resting is not None or self._closed.done():
            return
        self._stop_reading()

        def wake() -> None:
            self._resting = None
            if self._spare is None:
                self._spare = _spare()
            if not self._closed.done():
                self.start()

        self._resting = self.loop.call_later(REST_S, wake)


class _Slot:
    """A connection's place among the ``limit``: given back once, whatever closes it."""

    __slots__ = ("held", "listener")

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.held = False

    def take(self) -> None:
        self.held = True
        self.listener.open += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.listener.open -= 1


def _spare() -> int | None:
    """A descriptor held in reserve for a moment without any (None: none left)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


async def listen(
    host: str,
    port: int,
    serve_one: Callable[[Release], asyncio.Protocol],
    refusal: Callable[[str], bytes],
    limit: int,
) -> Listener:
    """Listen on every address of ``host`` (as ``loop.create_server`` binds them) at ``port``;
    raises ``OSError`` when one cannot be bound."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    fit_descriptors(limit)
    listener = Listener(sockets, serve_one, refusal, limit)
    listener.start()
    return listener


def fit_descriptors(limit: int) -> None:
    """Make room for ``limit`` connections among the process's file descriptors: its soft
    limit is raised (up to the hard one) if it is below what they need, as Go's runtime and
    nginx's ``worker_rlimit_nofile`` do; a hard limit too low for them is said once."""
    needed = limit + LINGERING + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if wanted > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft < needed:
        log.warning(
            "--http-max-connections %d needs about %d file descriptors, and this process may "
            "open %d (ulimit -n): beyond them, a connection is answered 503 (out of file "
            "descriptors) and closed",
            limit,
            needed,
            soft,
        )
