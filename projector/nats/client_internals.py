"""Every use of nats-py's private API, in one module: what a nats-py release may change.

nats-py keeps underscored the state this project needs where its public API falls short: the
client's pending buffer (serve-http's publish without a coroutine), a subscription's queue (a
delivery handed over without a task hop), the JetStream context's client and API prefix, the
server's INFO, and the methods of the client mended for a long-running service (the opening
INFO, a server's ``-ERR``, a late PONG, a subject that is not UTF-8, an error ack of
``publish_async``). Nothing outside this module names one of them (a unit test scans
``projector/`` for it), so a new nats-py breaks here or nowhere: ``tests/unit/
test_client_internals.py`` checks each name below against the installed nats-py (kind and
signature), and that its version is the minor this was tested on (``TESTED_ON``, the minor
pyproject.toml pins).

The patch of nats-py's ``Client`` class (:func:`install`) is put in place at start-up, never as
a side effect of an import: by the CLI's ``main`` before any command runs, by
:func:`projector.nats.connection.connect` before it dials (every client of the library's entry
points: the writer, the projector, the pipeline, serve-http, a router's publisher), and by
:meth:`projector.nats.consumer.OrderedConsumer.start`, for a client of the caller's making.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.protocol.parser import PERMISSIONS_ERR

from seqstate.errors import SeqstateError

# The nats-py minor every name here was checked against (pyproject.toml pins it).
TESTED_ON = (2, 16)

# The -ERR texts (lower-cased) that refuse the credentials, as nats.go lists them: no
# reconnect mends those, every other -ERR that ends a connection is reconnected from.
AUTH_ERRORS = (
    "authorization violation",
    "user authentication expired",
    "user authentication revoked",
    "account authentication expired",
)

# The private names, by owner, that this module relies on (the shape test checks each).
BUILD_MESSAGE_PARAMETERS = ["self", "sid", "subject", "reply", "data", "headers"]
CLIENT_METHODS = (
    "_build_message",
    "_process_info",
    "_process_err",
    "_process_pong",
    "_process_op_err",
)
CLIENT_STATE = (
    "_server_info",
    "_pongs",
    "_pongs_received",
    "_pings_outstanding",
    "_error_cb",
)
PENDING_BUFFER = ("_pending", "_pending_data_size", "_max_pending_size", "_flush_queue")
SIGNING = ("_signature_cb", "_user_jwt_cb", "_user_credentials", "_nkeys_seed", "_nkeys_seed_str")
JETSTREAM_STATE = ("_nc", "_prefix", "_async_reply_prefix", "_publish_async_futures")
SUBSCRIPTION_STATE = ("_pending_queue", "_pending_size")
PUSH_SUBSCRIPTION_STATE = ("_stream", "_consumer")
KEY_WATCHER_STATE = ("_sub",)


class TlsNotOffered(SeqstateError, nats.errors.Error):
    """TLS was asked for (a ``tls://`` URL, a TLS setting) and the server offers none."""

    def __str__(self) -> str:
        return "the server offers no TLS"


# ---- the patch put in place at start-up ------------------------------------------------------


def _utf8(raw: bytes) -> bytes:
    return raw.decode(errors="replace").encode()


def install() -> None:
    """Make nats-py's read loop take a message whose subject is not UTF-8 (idempotent).

    nats-py decodes each delivery's subject strictly, in its read loop: one message published
    raw on ``seqstate.events.<ns>.\\xff.0`` raised there, and the connection silently stopped
    handing messages over, to the writer and to every subscription on it, at every restart.
    Decoded with replacement characters instead (as the fast replay reader decodes it), such
    a subject meets no event's own, and the fold refuses it (``wrong_subject``) on every path
    alike. Put in place only where the client has the method as this knows it."""
    original = getattr(Client, "_build_message", None)
    if original is None or getattr(original, "_seqstate_tolerant", False):
        return
    if list(inspect.signature(original).parameters) != BUILD_MESSAGE_PARAMETERS:
        return

    def build(
        self: Client,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: dict[str, str] | None,
    ) -> Any:
        try:
            return original(self, sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            return original(self, sid, _utf8(subject), _utf8(reply), data, headers)

    build._seqstate_tolerant = True  # type: ignore[attr-defined]
    Client._build_message = build  # type: ignore[method-assign]


def installed() -> bool:
    """Whether :func:`install` has put its patch in place."""
    return bool(getattr(Client._build_message, "_seqstate_tolerant", False))


# ---- the client, mended for a long-running service -------------------------------------------


class MendedClient(Client):
    """nats-py's client, mended where it fails a long-running service: TLS whenever TLS was
    asked for, a server's ``-ERR`` reconnected from, a late PONG taken in.

    nats-py upgrades to TLS only when the server's INFO says ``tls_required``: against a
    server that does not (a plain one, or an impostor), a ``tls://`` URL and a CA went on in
    cleartext and sent CONNECT, the password in it. Here, with ``require_tls``, the INFO that
    opens each connection is checked before anything is sent: a server offering no TLS is a
    :class:`TlsNotOffered` (nats-py reports it to the error callback, which gives up on it),
    and one that offers TLS without requiring it is upgraded all the same.
    """

    def __init__(self, *, require_tls: bool) -> None:
        super().__init__()
        self.require_tls = require_tls

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        # nats-py calls this with the opening INFO, which it also keeps as ``_server_info``,
        # after reading it and before it decides on TLS and sends CONNECT.
        if self.require_tls and initial_connection:
            if not (info.get("tls_required") or info.get("tls_available")):
                raise TlsNotOffered()
            info["tls_required"] = True  # nats-py's cue to upgrade before CONNECT
            self._server_info["tls_required"] = True
        await super()._process_info(info, initial_connection)

    async def _process_err(self, err_msg: str) -> None:
        """A server's ``-ERR`` (lower-cased by nats-py's parser): one that ends the connection
        is a lost connection, so the client reconnects as after any other.

        nats-py closes the client for good at any ``-ERR`` but a stale connection or a
        permissions violation: one publish on a subject longer than the server's control
        line ("maximum control line exceeded"), or over its payload limit, left a service
        with a closed client and no reconnect, answering on without NATS. Only a refusal of
        the credentials still closes it (nats-py's way: no reconnect can mend it), and a
        service exits then.
        """
        if any(refusal in err_msg for refusal in AUTH_ERRORS) or PERMISSIONS_ERR in err_msg:
            await super()._process_err(err_msg)
            return
        error = nats.errors.Error(err_msg.strip(" '"))  # logged as "nats: <the server's words>"
        await self._error_cb(error)
        await self._process_op_err(error)

    async def _process_pong(self) -> None:
        """The PONG of a flush that timed out or was cancelled: its ping's place is taken all
        the same, its future left as it is.

        nats-py keeps one future per PING sent and sets the oldest's result at each PONG; a
        flush that gave up cancelled its future but left it in the queue, and its late PONG
        raised InvalidStateError in the read loop, which then stopped reading for good: every
        later request and ack timed out on a connection nats-py still called connected."""
        pongs = self._pongs
        if pongs and pongs[0].done():
            pongs.pop(0)
            self._pongs_received += 1
            self._pings_outstanding = 0
            return
        await super()._process_pong()


def server_info(nc: Client) -> dict[str, Any]:
    """The INFO the server sent when ``nc`` connected (empty before)."""
    return getattr(nc, "_server_info", None) or {}


def signs_with_keys(nc: Client) -> bool:
    """Whether ``nc`` signs in with an NKEY seed or a credentials file (a signature per
    connection, which a reader of its own cannot give)."""
    return any(getattr(nc, name, None) is not None for name in SIGNING)


# ---- publish_async with its error acks delivered ---------------------------------------------


class AckedJetStream(JetStreamContext):
    """A JetStream context whose ``publish_async`` futures fail with their error ack.

    nats-py reads an ack that carries an error by raising it from the callback of its reply
    subscription (nats-io/nats.py#985): the publish's future stays pending until its caller
    gives up, and the error goes to the client's error callback instead. On a full disk the
    projector logged ``ServiceUnavailableError`` once per key written, then "flush failed: no
    answer in time". Here the error fails the future, so a flush fails at once with what the
    server said."""

    async def _handle_async_reply(self, msg: Msg) -> None:
        try:
            await super()._handle_async_reply(msg)
        except nats.js.errors.APIError as exc:
            prefix = getattr(self, "_async_reply_prefix", None)
            futures = getattr(self, "_publish_async_futures", {})
            future = futures.get(msg.subject[len(prefix) :]) if prefix else None
            if future is None:
                raise  # not a reply this version of nats-py keeps as we know: as before
            if not future.done():
                future.set_exception(exc)


def acked_jetstream(nc: Client) -> JetStreamContext:
    return AckedJetStream(nc)


# ---- a JetStream context's client and API ----------------------------------------------------


def client_of(js: JetStreamContext) -> Client:
    """The client ``js`` was made from (nats-py has no public accessor)."""
    nc: Client = js._nc
    return nc


def api_prefix(js: JetStreamContext) -> str:
    """The subject prefix of ``js``'s JetStream API (``$JS.API``, or a domain's)."""
    prefix: str = js._prefix
    return prefix


class _Watcher(Protocol):
    async def stop(self) -> None: ...


def consumer_of(sub: Any) -> tuple[str | None, str | None]:
    """``(stream, consumer)`` of a JetStream push subscription, as nats-py keeps them (Nones
    for another subscription)."""
    return getattr(sub, "_stream", None), getattr(sub, "_consumer", None)


def subscription_of(watcher: _Watcher) -> Subscription | None:
    """The subscription a KV watch (``KeyValue.watch``'s) reads through."""
    return getattr(watcher, "_sub", None)


# ---- the client's pending buffer: a publish without a coroutine ------------------------------


def queues_commands(nc: Client) -> bool:
    """Whether ``nc`` keeps the pending buffer :func:`queue_command` appends to."""
    return all(hasattr(nc, name) for name in PENDING_BUFFER) and isinstance(
        getattr(nc, "_pending", None), list
    )


def queue_command(nc: Client, command: bytes, payload_size: int) -> None:
    """Append a protocol ``command`` (carrying ``payload_size`` bytes of payload) to ``nc``'s
    pending buffer, for its flusher to write on its next turn, as ``nc.publish`` does: counted
    in the client's statistics, refused as ``nc.publish`` refuses it when disconnected with the
    reconnect buffer full."""
    size = nc._pending_data_size + len(command)
    limit = nc._max_pending_size
    if not nc.is_connected and (limit <= 0 or size > limit):  # as nc.publish: no buffering
        raise nats.errors.OutboundBufferLimitError
    nc._pending.append(command)
    nc._pending_data_size = size
    stats = nc.stats
    stats["out_msgs"] += 1
    stats["out_bytes"] += payload_size
    queue = nc._flush_queue
    if nc.is_connected and queue is not None and queue.empty():
        # One future per flush, not per message: the flusher sets it once written.
        queue.put_nowait(asyncio.get_running_loop().create_future())


# ---- a subscription's queue: deliveries handed over as they are read -------------------------


class QueueLike(Protocol):
    def put_nowait(self, msg: Msg) -> None: ...


def keeps_queue(sub: Subscription) -> bool:
    """Whether ``sub`` keeps the queue and byte count :func:`swap_queue` replaces."""
    return isinstance(getattr(sub, "_pending_queue", None), asyncio.Queue) and isinstance(
        getattr(sub, "_pending_size", None), int
    )


def swap_queue(sub: Subscription, sink: QueueLike) -> asyncio.Queue[Msg] | None:
    """Put ``sink`` where nats-py's reader queues ``sub``'s messages; the queue it replaces
    (None, and nothing changed, where this nats-py's subscription is not the one this knows)."""
    if not keeps_queue(sub):
        return None
    queued: asyncio.Queue[Msg] = sub._pending_queue
    sub._pending_queue = sink  # type: ignore[assignment]
    return queued


def settle(sub: Subscription, size: int) -> None:
    """Take ``size`` bytes off what nats-py counts as pending for ``sub`` (its slow-consumer
    check): a message handed over at once stays pending nowhere."""
    sub._pending_size -= size
