"""Connecting to NATS: one place that dials, so every command reports a failure the same way.

``connect`` is a client that reconnects forever for a service (writer, projector, ``run``) and
gives up quickly for a one-shot command; either way its callbacks log instead of printing
tracebacks. ``nats_for`` starts an embedded nats-server when no URL is configured. It signs in
with the credentials of the URL or of the ``nats_*`` settings (user and password, token, NKEY
seed file, credentials file), and takes its reply inboxes under its own prefix
(:func:`projector.nats.security.inbox_prefix`), never under ``_INBOX.``, where Dynamo's
processes read. Nothing here shows a password, a token, a seed or a JWT: URLs and
the client's errors go through :mod:`projector.nats.security` first.

A subject the server refuses this user (a permissions violation) is no reply at all to a
request: nats-py reports the server's ``-ERR`` to the error callback and the request waits for
its timeout, which ``ensure`` used to report, seconds later, as "JetStream is not available".
:func:`refused_or` runs some work on a client of :func:`connect` and ends it with
:class:`PermissionRefused`, one line naming the subject, as soon as the server says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client

from projector.nats.client_internals import MendedClient, TlsNotOffered, install
from projector.nats.security import (
    auth_options,
    client_tls,
    config_secrets,
    connect_settings_from_env,
    inbox_prefix,
)
from projector.nats.server import NatsServer, PortTaken
from projector.settings.config import Config
from projector.settings.redaction import redact, scrub, secrets_in, server_urls
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate")

# A one-shot command that has no connection after this long says why and exits.
ONE_SHOT_CONNECT_S = 4.0
# nats-py reports each failed attempt within connect_timeout (3 s) per step (TCP, TLS, CONNECT)
# plus reconnect_time_wait: a dial without news for this long is stuck (see _dial).
STALLED_S = 15.0
# nats-py calls the error callback once per message a slow subscription drops: a consumer far
# behind made a line per message (1.1 million lines, 266 MB, in 57 s). They are counted and
# said at most once per this many seconds.
SLOW_CONSUMER_EVERY_S = 10.0


class ConnectError(SeqstateError, ConnectionError):
    """NATS could not be reached (or refused us); the message says where and why."""


class PermissionRefused(SeqstateError, PermissionError):
    """The server refused this user a subject (a permissions violation): no retry can fix it.
    The message names the subject, the user and what was being done."""


T = TypeVar("T")
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')
# The tokens of JetStream's API subjects, upper-cased as the server spells them (nats-py
# lower-cases the server's -ERR text: the subject is shown as the client sent it).
_API_TOKENS = frozenset(
    {
        "$js", "api", "info", "stream", "names", "list", "create", "update", "delete", "purge",
        "msg", "get", "direct", "consumer", "durable", "next", "fc", "ack", "$kv", "$o", "$srv",
        "ping", "stats",
    }
)  # fmt: skip


def _as_sent(subject: str, names: Iterable[str]) -> str:
    """The refused subject as the client spelled it: API tokens upper-cased, the stream and
    bucket names of ``names`` restored (the server's message reaches us lower-cased)."""
    spelled = {name.lower(): name for name in names}
    api = subject.startswith("$")
    return ".".join(
        spelled.get(token, token.upper() if api and token in _API_TOKENS else token)
        for token in subject.split(".")
    )


def describe_violation(
    text: str, *, user: str | None = None, doing: str = "", names: Iterable[str] = ()
) -> str:
    """One line for the server's permissions violation ``text`` (nats-py's words)."""
    found = _VIOLATION.search(text.lower())
    if found is None:
        what = text.removeprefix("nats: ")
    else:
        op, subject = found.groups()
        what = f'a {op} to "{_as_sent(subject, names)}"'
    who = f" for user {user!r}" if user else ""
    while_ = f" while {doing}" if doing else ""
    return f"NATS refused {what} (permissions violation{who}){while_}"


def describe_refusal(
    text: str, *, user: str | None = None, names: Iterable[str] = (), inbox: str = ""
) -> str:
    """One line for a permissions violation that ended a command: what the user lacks the
    permission to do (read a stream, write a bucket, take its replies...), then the subject
    refused. ``inbox``: the client's inbox prefix, named as such when it is what is refused."""
    found = _VIOLATION.search(text.lower())
    if found is None:
        return describe_violation(text, user=user, names=names)
    op, subject = found.groups()
    who = f"user {user!r}" if user else "this user"
    if inbox and op != "publish" and subject.startswith(inbox.lower() + "."):
        sent = inbox + subject[len(inbox) :]
        needed = (
            f"take its replies under the inbox prefix {inbox} (--nats-inbox-prefix: give one "
            "this user may subscribe to)"
        )
    else:
        sent = _as_sent(subject, names)
        needed = _needed_for(op, sent)
    return (
        f"{who} lacks the permission to {needed}: NATS refused a {op} to "
        f'"{sent}" (permissions violation)'
    )


# JetStream API requests that read a stream (its info, messages, consumers), and those that
# create or change one: the stream's name is the token after the prefix.
_READS = (
    "STREAM.INFO.", "STREAM.MSG.GET.", "DIRECT.GET.", "CONSUMER.CREATE.",
    "CONSUMER.DURABLE.CREATE.", "CONSUMER.INFO.", "CONSUMER.DELETE.", "CONSUMER.MSG.NEXT.",
    "CONSUMER.LIST.", "CONSUMER.NAMES.",
)  # fmt: skip
_CHANGES = ("STREAM.CREATE.", "STREAM.UPDATE.")
_ASKS = {"INFO": "ask JetStream for the account's info", "STREAM.NAMES": "list the streams"}


def _needed_for(op: str, subject: str) -> str:
    """What a refused ``op`` (publish, subscription) to ``subject`` was for, in words."""
    tokens = subject.split(".")
    if op != "publish":
        return f"subscribe to {subject}"
    if subject.startswith("$JS.API."):
        api = subject[len("$JS.API.") :]
        for prefixes, verb in ((_READS, "read"), (_CHANGES, "create or update")):
            prefix = next((p for p in prefixes if api.startswith(p)), None)
            if prefix is not None:
                return f"{verb} {_resource(api[len(prefix) :].split('.')[0])}"
        return _ASKS.get(api, f"use JetStream's API ({api})")
    if len(tokens) > 2 and tokens[0] in ("$KV", "$O"):
        return f"write {'bucket' if tokens[0] == '$KV' else 'object store'} {tokens[1]}"
    if len(tokens) > 2 and tokens[0] == "$JS" and tokens[1] in ("ACK", "FC"):
        return f"read {_resource(tokens[2])}"
    return f"publish to {subject}"


def _resource(stream: str) -> str:
    """A stream as the user knows it: a bucket, an object store, or a stream."""
    for prefix, kind in (("KV_", "bucket"), ("OBJ_", "object store")):
        if stream.startswith(prefix):
            return f"{kind} {stream[len(prefix) :]}"
    return f"stream {stream}"


def tls_asked_for(url: str, tls: ssl.SSLContext | None) -> bool:
    """A TLS setting (a CA, a client certificate) or a ``tls://`` server in ``url``."""
    return tls is not None or any(s.lower().startswith("tls://") for s in server_urls(url))


def _is_auth_refusal(exc: BaseException) -> bool:
    return "authorization violation" in str(exc).lower() or isinstance(
        exc, nats.errors.AuthorizationError
    )


def is_permanent(exc: BaseException) -> bool:
    """A refusal no retry can fix: wrong credentials, a certificate we do not trust, or no
    TLS where TLS was asked for."""
    return _is_auth_refusal(exc) or isinstance(exc, ssl.SSLError | TlsNotOffered)


def describe_failure(
    exc: BaseException | None,
    url: str,
    *,
    signed_in: bool = False,
    secrets: frozenset[str] = frozenset(),
) -> str:
    """One line for a failed connection, naming the server without its secrets.

    ``signed_in``: the settings (not the URL) gave credentials; ``secrets``: theirs, to hide.
    """
    shown = redact(url)
    if exc is None:
        why = f"cannot reach NATS at {shown}: no connection within {ONE_SHOT_CONNECT_S:.0f} s"
    elif isinstance(exc, TlsNotOffered):
        why = (
            f"NATS at {shown} offers no TLS, but TLS was asked for (a tls:// URL or a "
            "SEQSTATE_TLS_* setting): not connecting in cleartext"
        )
    elif isinstance(exc, TimeoutError):
        why = f"cannot reach NATS at {shown}: no answer in time"
    elif _is_auth_refusal(exc) and (signed_in or secrets_in(url)):
        why = f"NATS at {shown} refused the credentials (authorization violation)"
    elif _is_auth_refusal(exc):
        why = (
            f"NATS at {shown} requires credentials (authorization violation): set "
            "SEQSTATE_NATS_USER and SEQSTATE_NATS_PASSWORD, SEQSTATE_NATS_TOKEN, "
            "SEQSTATE_NATS_NKEY_SEED or SEQSTATE_NATS_CREDS (or use a URL "
            "with them)"
        )
    elif isinstance(exc, ssl.SSLCertVerificationError):
        reason = exc.verify_message or str(exc)
        why = (
            f"the TLS certificate of NATS at {shown} is not trusted ({reason}): set "
            "SEQSTATE_TLS_CA to the CA file that signed it"
        )
    elif isinstance(exc, ssl.SSLError) and "CERTIFICATE_REQUIRED" in str(exc.reason):
        why = (
            f"NATS at {shown} requires a client certificate: set SEQSTATE_TLS_CERT and "
            "SEQSTATE_TLS_KEY"
        )
    elif isinstance(exc, ssl.SSLError):
        why = f"TLS handshake with NATS at {shown} failed: {exc.reason or exc}"
    else:
        why = f"cannot reach NATS at {shown}: {exc or type(exc).__name__}"
    return scrub(why, url, secrets)


def _quiet_tls_eof(record: logging.LogRecord) -> bool:
    """asyncio warns at every TLS connection nats-py closes (nats-io/nats.py#727): harmless."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()


class SlowConsumerLog:
    """Says a subscription dropping messages (a slow consumer) once per interval, with a count.

    nats-py reports every message it drops, and a consumer that has fallen behind drops them
    by the hundred thousand: each report is counted, and a line (a warning) is said at the
    first one and then at most once every ``every_s``, with how many were dropped since the
    last line and on which subjects. ``clock``: seconds, monotonic (a test's own).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = SLOW_CONSUMER_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self.dropped = 0  # every message reported dropped, in all
        self.lines = 0  # lines said
        self._log = logger
        self._clock = clock
        self._since = 0  # dropped since the last line
        self._subjects: set[str] = set()
        self._said_at: float | None = None

    def dropped_one(self, subject: str) -> None:
        """One message dropped on ``subject``: counted, and said if the interval has passed."""
        self.dropped += 1
        self._since += 1
        if len(self._subjects) < 3:
            self._subjects.add(subject)
        now = self._clock()
        if self._said_at is None or now - self._said_at >= self.every_s:
            self._say(now)

    def flush(self) -> None:
        """Say what was dropped since the last line, if anything (at close)."""
        if self._since:
            self._say(self._clock())

    def _say(self, now: float) -> None:
        window = "" if self._said_at is None else f" in the last {now - self._said_at:.0f}s"
        self._log.warning(
            "nats: slow consumer, %d message(s) dropped%s (on %s; %d in all): the client "
            "could not keep up with a subscription",
            self._since,
            window,
            ", ".join(sorted(self._subjects)),
            self.dropped,
        )
        self.lines += 1
        self._said_at = now
        self._since = 0
        self._subjects.clear()


class _Callbacks:
    """nats-py's callbacks: while dialing they collect errors, afterwards they log them."""

    def __init__(
        self,
        url: str,
        *,
        service: bool,
        signed_in: bool = False,
        secrets: frozenset[str] = frozenset(),
    ) -> None:
        self.slow = SlowConsumerLog(log)
        self.url = url
        self.service = service
        self.signed_in = signed_in
        self.secrets = secrets
        self.dialing = True
        self.closing = False
        self.errors: list[BaseException] = []
        self.refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.progress = asyncio.Event()  # set at each error nats-py reports while dialing
        # Those waiting in refused_or: each gets the next permissions violation's text.
        self.violation_waiters: set[asyncio.Future[str]] = set()
        # The subjects refused a publish so far (lower-cased, as nats-py reports them), the
        # newest REFUSED_KEPT: a publisher asks before it retries (was_refused).
        self.refused_subjects: dict[str, None] = {}
        # Set when the client is closed not by us (a refusal of its credentials): why.
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.client: weakref.ref[Client] | None = None  # once dialed
        # A command that ends at its first permissions violation (connect's fail_on_refusal):
        # its task, cancelled with the violation's text kept for the error it then raises.
        self.command: asyncio.Task[Any] | None = None
        self.violation: str | None = None

    async def on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.slow.dropped_one(exc.subject)
            return
        if not self.dialing:
            text = scrub(str(exc) or type(exc).__name__, self.url, self.secrets)
            found = _VIOLATION.search(text.lower())
            if found is not None and found.group(1) == "publish":
                self.refused_subjects[found.group(2)] = None
                while len(self.refused_subjects) > REFUSED_KEPT:
                    del self.refused_subjects[next(iter(self.refused_subjects))]
            waiting = [w for w in self.violation_waiters if not w.done()]
            if waiting and found is not None:
                for waiter in waiting:  # each reports it in its own words: no second line
                    waiter.set_result(text)
                return
            command = self.command
            if found is not None and command is not None and not command.done():
                if self.violation is None:  # the first one ends the command; said once
                    self.violation = text
                    command.cancel()
                return
            log.warning("nats: %s", text)
            return
        self.errors.append(exc)
        self.progress.set()
        if is_permanent(exc):
            if not self.refused.done():
                self.refused.set_result(exc)
        elif self.service and len(self.errors) == 1:
            log.warning("%s; retrying", self.describe(exc))

    def describe(self, exc: BaseException | None) -> str:
        return describe_failure(exc, self.url, signed_in=self.signed_in, secrets=self.secrets)

    async def on_disconnect(self) -> None:
        if not self.closing:
            log.warning("nats: disconnected, reconnecting")

    async def on_reconnect(self) -> None:
        log.info("nats: reconnected")

    async def on_closed(self) -> None:
        if self.dialing or self.closing or self.lost.done():
            return
        nc = None if self.client is None else self.client()
        error = None if nc is None else nc.last_error
        why = scrub(str(error) if error else "closed", self.url, self.secrets)
        self.lost.set_result(why)


async def _watch(dialing: asyncio.Future[Client], callbacks: _Callbacks, until: float) -> None:
    """Until the dial ends, is refused, stalls (``STALLED_S`` without news) or time is up."""
    loop = asyncio.get_running_loop()
    while not dialing.done() and not callbacks.refused.done() and loop.time() < until:
        callbacks.progress.clear()
        news = asyncio.ensure_future(callbacks.progress.wait())
        either: set[asyncio.Future[Any]] = {dialing, callbacks.refused, news}
        try:
            await asyncio.wait(
                either,
                timeout=min(STALLED_S, until - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            news.cancel()
        if news.cancelled() or not news.done():
            return  # no news: stalled (or connected, refused, out of time: the loop's test)


async def _dial(
    url: str, callbacks: _Callbacks, tls: ssl.SSLContext | None, auth: dict[str, Any]
) -> Client:
    """The first connection, or a ConnectError as soon as it is clear there will be none.

    nats-py retries a failed first connection, and after a failed TLS handshake its clean-up
    awaits a socket the handshake had taken over, forever (nats-io/nats.py#718): an untrusted
    certificate hung ``seqstate status`` until it was killed. So a permanent refusal (see
    :func:`is_permanent`) abandons the dial at once; a dial that stalls (a TLS handshake that
    timed out) is abandoned and, for a service, started again; a one-shot command dials for
    at most ``ONE_SHOT_CONNECT_S``, a service until it connects.
    """
    loop = asyncio.get_running_loop()
    until = loop.time() + (ONE_SHOT_CONNECT_S if not callbacks.service else float("inf"))
    options: dict[str, Any] = {**auth, "tls": tls} if tls is not None else dict(auth)
    require_tls = tls_asked_for(url, tls)
    while True:
        client = MendedClient(require_tls=require_tls)
        dialing = asyncio.ensure_future(
            _connected(
                client,
                server_urls(url),
                connect_timeout=3,
                allow_reconnect=True,
                max_reconnect_attempts=-1 if callbacks.service else 3,
                reconnect_time_wait=0.5,
                error_cb=callbacks.on_error,
                disconnected_cb=callbacks.on_disconnect,
                reconnected_cb=callbacks.on_reconnect,
                closed_cb=callbacks.on_closed,
                **options,
            )
        )
        try:
            await _watch(dialing, callbacks, until)
        finally:
            if not dialing.done():
                dialing.cancel()
                await asyncio.wait({dialing}, timeout=2)  # nats-py may swallow a cancellation
        if not dialing.cancelled() and dialing.exception() is None:
            callbacks.dialing = False
            return dialing.result()
        if callbacks.refused.done() or loop.time() >= until or not callbacks.service:
            raise ConnectError(callbacks.describe(_cause(dialing, callbacks)))
        log.warning(
            "nats: no progress connecting to %s for %.0f s; dialing again", redact(url), STALLED_S
        )


async def _connected(client: Client, servers: list[str], **options: Any) -> Client:
    """``nats.connect`` with a client of our own making (:class:`MendedClient`)."""
    await client.connect(servers, **options)
    return client


def _cause(dialing: asyncio.Future[Client], callbacks: _Callbacks) -> BaseException | None:
    """The error worth reporting: a permanent refusal, else the last error seen."""
    if callbacks.refused.done():
        return callbacks.refused.result()
    if callbacks.errors:
        return callbacks.errors[-1]
    return None if dialing.cancelled() else dialing.exception()


# The callbacks of each client connect() made, for refused_or and was_refused.
_WATCHED: weakref.WeakKeyDictionary[Client, _Callbacks] = weakref.WeakKeyDictionary()
REFUSED_KEPT = 64


async def closed_for_good(nc: Client) -> str:
    """Waits until ``nc`` (a client of :func:`connect`) is closed by anything but its own
    end, which no reconnect follows (the server refused its credentials): why, in one line.
    A service that cannot go on without NATS exits then, rather than serve on without it.
    Never returns for a client :func:`connect` did not make."""
    callbacks = _WATCHED.get(nc)
    if callbacks is None:
        await asyncio.get_running_loop().create_future()  # never set
    assert callbacks is not None
    return await asyncio.shield(callbacks.lost)


def was_refused(nc: Client, subject: str) -> bool:
    """Whether the server refused ``nc`` a publish to ``subject`` (a permissions violation
    it reported). Only for a client :func:`connect` made; False for any other."""
    callbacks = _WATCHED.get(nc)
    return callbacks is not None and subject.lower() in callbacks.refused_subjects


async def refused_or(
    nc: Client,
    work: Awaitable[T],
    *,
    user: str | None = None,
    doing: str = "",
    names: Iterable[str] = (),
    lacks: bool = False,
) -> T:
    """``work``'s result, or :class:`PermissionRefused` as soon as the server reports a
    permissions violation on ``nc`` while it runs (``work`` is then cancelled).

    Without this, a refused request is only a timeout. ``user``, ``doing`` and ``names`` (the
    stream and bucket names it may name) make the message; ``lacks``: in a command's words,
    what the user lacks the permission to do (:func:`describe_refusal`), as a command's client
    says it. A client that :func:`connect` did not make is not watched, and ``work`` simply
    runs.
    """
    callbacks = _WATCHED.get(nc)
    task = asyncio.ensure_future(work)
    if callbacks is None:
        return await task
    violation: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    callbacks.violation_waiters.add(violation)
    try:
        either: set[asyncio.Future[Any]] = {task, violation}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        if lacks:
            raise PermissionRefused(describe_refusal(violation.result(), user=user, names=names))
        raise PermissionRefused(
            describe_violation(violation.result(), user=user, doing=doing, names=names)
        )
    finally:
        callbacks.violation_waiters.discard(violation)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: the violation is what we report


@contextlib.asynccontextmanager
async def connect(
    url: str,
    *,
    service: bool,
    config: Config | None = None,
    fail_on_refusal: bool = False,
) -> AsyncIterator[Client]:
    """A client that reconnects forever if ``service``, logging instead of printing tracebacks.

    TLS and credentials come from ``config``'s ``tls_*`` and ``nats_*`` settings; without a
    config, from ``SEQSTATE_TLS_*`` and ``SEQSTATE_NATS_*`` (so a router or a scheduler using
    RouterPublisher or RegistryView connects as the CLI does). Credentials in ``url`` still
    work; a setting wins over them.

    ``fail_on_refusal`` (a command's client): the first permissions violation the server
    reports ends the block at once with :class:`PermissionRefused`, saying what the user lacks
    the permission to do (a refused JetStream API request is otherwise only a timeout, "nats:
    timeout", seconds later). Otherwise the violation is logged and the client goes on.
    """
    install()  # every client of ours takes any subject (start-up, before the first dial)
    settings = config if config is not None else connect_settings_from_env()
    tls = client_tls(settings)
    auth = {**auth_options(settings), "inbox_prefix": inbox_prefix(settings, url)}
    asyncio_log = logging.getLogger("asyncio")
    if _quiet_tls_eof not in asyncio_log.filters:
        asyncio_log.addFilter(_quiet_tls_eof)
    callbacks = _Callbacks(
        url,
        service=service,
        signed_in=settings.has_credentials,
        secrets=frozenset(config_secrets(settings)),
    )
    nc = await _dial(url, callbacks, tls, auth)
    _WATCHED[nc] = callbacks
    callbacks.client = weakref.ref(nc)
    if fail_on_refusal:
        callbacks.command = asyncio.current_task()
    try:
        yield nc
    except asyncio.CancelledError:
        if callbacks.violation is None:
            raise
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # the cancellation was ours: the refusal is what ends it
        names = _resource_names(config) if config is not None else ()
        raise PermissionRefused(
            describe_refusal(
                callbacks.violation,
                user=settings.nats_user,
                names=names,
                inbox=str(auth["inbox_prefix"]),
            )
        ) from None
    finally:
        callbacks.command = None  # a violation while draining is no longer the command's
        callbacks.closing = True
        with contextlib.suppress(Exception):
            await nc.drain()
        callbacks.slow.flush()


async def close_at_once(nc: Client) -> None:
    """Close a client of :func:`connect` without draining it (its exit then has nothing left to
    do): for a process whose reads were called off, since a subscription one leaves behind (a
    snapshot's chunks half read) holds a drain for nats-py's 30 s."""
    callbacks = _WATCHED.get(nc)
    if callbacks is not None:
        callbacks.closing = True  # not a disconnection to report
    await nc.close()


@contextlib.asynccontextmanager
async def nats_for(
    config: Config, store_dir: Path | None, port: int = -1
) -> AsyncIterator[tuple[Client, str]]:
    """Connect to ``config.nats_url``, or start an embedded server when it is unset.

    The embedded server listens on ``port`` so its URL stays the same across restarts; a port
    taken is refused (:class:`~projector.nats.server.PortTaken`), since the URL a user was told
    would reach the other server there: a publish to it "succeeded" and the run saw nothing.
    ``port`` 0 is any free port. Yields the client and the server's URL as it may be shown (its
    secrets masked): callers only log it.
    """
    if config.nats_url:
        async with connect(config.nats_url, service=True, config=config) as nc:
            yield nc, redact(config.nats_url)
        return
    if store_dir is None:
        raise ConnectError("NATS_URL is not set (use --nats-url or NATS_URL)")
    # The server dies with this process (a SIGKILLed run left it holding the store).
    server = NatsServer(store_dir, port=port, die_with_parent=True)
    try:
        await asyncio.to_thread(server.start)
    except PortTaken as exc:
        url = f"nats://{server.host}:{port}"
        raise PortTaken(
            f"{exc}: another server listens there (NATS_URL={url} would reach it, not this "
            "run); --port N (SEQSTATE_PORT=N) picks another port, --port 0 any free one"
        ) from None
    try:
        log.info(
            "embedded nats-server at %s (export NATS_URL=%s), JetStream in %s",
            server.url,
            server.url,
            store_dir,
        )
        async with connect(server.url, service=True, config=config) as nc:
            yield nc, server.url
    finally:
        await asyncio.to_thread(server.stop)


def _resource_names(config: Config) -> list[str]:
    from projector.nats.resources import resource_names  # it provisions through this module

    return resource_names(config)


def require_url(config: Config) -> str:
    if not config.nats_url:
        raise ConnectError("NATS_URL is not set (use --nats-url or NATS_URL)")
    return config.nats_url
