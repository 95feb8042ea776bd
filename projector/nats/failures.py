"""What a failed NATS request says in a log line or an error: one place, so a full disk is named.

nats-py's JetStream errors carry their meaning in fields (``code``, ``err_code``,
``description``) and none in their arguments, so ``repr`` shows ``ServiceUnavailableError()``:
a server out of storage was logged that way, for as long as the writer retried, and never
named. :func:`describe` says what the server said, with its error code, and names the
conditions an operator must act on, with what to do: JetStream's storage (the server's or the
account's) is full, a stream has reached a limit of its own, or JetStream is off (nothing
answers its API: nats-py says ``ServiceUnavailableError: code=None``).

A server whose disk fills under it answers a write with nothing at all: the write times out,
like one lost on the wire. :func:`unstored` asks the stream, once, whether it still answers;
if it does, the silence is named as the likely full disk it is.

Which failures are worth asking again is said here too. A request in flight when the server
dies never gets its answer, so each attempt has a short timeout and is repeated
(:func:`retrying`: safe for reads, and for publishes with a msg-id); a consumer rides out a
restart of a few seconds instead of failing over a request it could simply ask again. A
cluster with a node restarting answers that no peer can take a new stream: :func:`placing`
asks again for the seconds that takes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client

from projector.aio.retry import with_backoff
from seqstate.errors import SeqstateError

T = TypeVar("T")

# JetStream's error codes for a write it cannot store. A limit of the stream's own ("maximum
# messages exceeded", bytes, messages per subject, with the discard policy new) comes as the
# generic "store failed"; the server's or the account's storage running out as one of the
# others (10023 is what a full max_file_store answers a publish with).
STREAM_LIMIT = 10077
NO_STORAGE = 10023  # insufficient resources
STORAGE_EXCEEDED = 10047  # insufficient storage resources available
MEMORY_EXCEEDED = 10028  # insufficient memory resources available
ACCOUNT_LIMITS = 10002  # resource limits exceeded for account
OUT_OF_STORAGE = frozenset({NO_STORAGE, STORAGE_EXCEEDED, MEMORY_EXCEEDED, ACCOUNT_LIMITS})
STORAGE_FULL = "JetStream storage full"
STORAGE_ADVICE = (
    "free disk space on the server, or raise its JetStream limit (max_file_store, "
    "max_memory_store, or the account's)"
)
JETSTREAM_OFF = (
    "JetStream is off on this NATS server (nothing answers its API for this account): start "
    "nats-server with -js, or give its config a jetstream {} block (and the account "
    "jetstream: enabled); a server out of storage turns it off too, and says so in its log"
)
NO_ANSWER = "no answer in time"
PROBE_S = 1.0  # how long the stream has to answer the question that names a silent write


class JetStreamOff(SeqstateError, ConnectionError):
    """The NATS server (or this account) has no JetStream: no stream, bucket or snapshot."""

    def __init__(self) -> None:
        super().__init__(JETSTREAM_OFF)


def storage_full(exc: BaseException) -> bool:
    """The server (or the account) has no JetStream storage left for this write: a limit's
    error code, or the disk's own words (an object store's write passes them on)."""
    return isinstance(exc, nats.js.errors.APIError) and (
        exc.err_code in OUT_OF_STORAGE or "no space left on device" in (exc.description or "")
    )


def jetstream_off(exc: BaseException) -> bool:
    """Nothing answered a JetStream API request: nats-py turns the server's "no responders"
    into a ServiceUnavailableError without a JetStream error code (an error the JetStream API
    sends, a full disk's included, has one)."""
    return isinstance(exc, JetStreamOff) or (
        isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.err_code is None
    )


async def unstored(nc: Client, stream: str, *, timed_out: bool = False) -> str | None:
    """Why a write to ``stream`` was not stored, as the server tells when asked once (for at
    most ``PROBE_S``) about the stream, or None if it tells nothing more. ``timed_out``: the
    write had no answer at all, else "no responders" (no stream took its subject).

    No answer to the question either: nothing more is known (a server away, an election).
    Nothing answers it: JetStream is off. No such stream: said. The stream answers: after a
    timeout, the server took the write and stored nothing, which is what a server whose disk
    is full does (it logs 'no space left on device', and tells the client nothing)."""
    try:
        await nc.jetstream(timeout=PROBE_S).stream_info(stream)
    except nats.js.errors.NotFoundError:
        return f"stream {stream} does not exist"
    except Exception as exc:
        return JETSTREAM_OFF if jetstream_off(exc) else None
    if not timed_out:
        return None
    return (
        f"stream {stream} answers but stored nothing: {STORAGE_FULL}? (a server whose disk is "
        f"full says so only in its log: 'no space left on device'); {STORAGE_ADVICE}"
    )


def describe(exc: BaseException) -> str:
    """One line for a failed request: what the server said, a full disk or stream named."""
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return NO_ANSWER
    if jetstream_off(exc):
        return JETSTREAM_OFF
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code is not None:
        said = f"{exc.description} (JetStream error {exc.err_code})"
        if storage_full(exc):
            return f"{STORAGE_FULL}: {said}; {STORAGE_ADVICE}"
        if exc.err_code == STREAM_LIMIT and "exceeded" in (exc.description or ""):
            return f"the stream is full: {said}"
        return said
    if isinstance(exc, SeqstateError):  # ours: its message is the whole sentence
        return str(exc) or type(exc).__name__
    if isinstance(exc, nats.js.errors.APIError):  # no JetStream error code: the status only
        return f"{type(exc).__name__} (status {exc.code}): {exc.description or 'no description'}"
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text and text != name else name


def refusal(exc: BaseException) -> str:
    """Why a publish was not stored, in one bounded word (a metric's label): ``stream_full``
    (a limit of the stream's own), ``storage_full`` (the server's or the account's),
    ``no_answer`` (no ack in time), or ``other``."""
    if storage_full(exc):
        return "storage_full"
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code == STREAM_LIMIT:
        return "stream_full"
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return "no_answer"
    return "other"


async def explain(nc: Client, exc: BaseException, stream: str) -> str:
    """:func:`describe` for a failed write to ``stream``; when it had no answer, or no stream
    answered it, with what the stream says of itself (:func:`unstored`): a full disk, JetStream
    off, no such stream."""
    said = describe(exc)
    timed_out = isinstance(exc, TimeoutError | nats.errors.TimeoutError)
    if not (timed_out or isinstance(exc, nats.js.errors.NoStreamResponseError)):
        return said
    more = await unstored(nc, stream, timed_out=timed_out)
    if more is None:
        return said
    return more if more == JETSTREAM_OFF else f"{said}; {more}"


ATTEMPT_TIMEOUT_S = 2.0  # per attempt: a request in flight when the server died never returns
RETRY_FOR_S = 60.0
NO_PEERS = 10005  # "no suitable peers for placement": a cluster with a node not (yet) back
PLACEMENT_WAIT_S = 30.0


async def retrying(
    call: Callable[[], Awaitable[T]], what: str, retry_for_s: float = RETRY_FOR_S
) -> T:
    """``await call()``, again after a timeout or a NATS error, for ``retry_for_s`` seconds."""
    return await with_backoff(
        call,
        again=lambda exc: isinstance(exc, TimeoutError | nats.errors.Error),
        within_s=retry_for_s,
        say=lambda exc, pause: f"{what} failed, retrying in {pause:.2f}s: {describe(exc)}",
    )


async def placing(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``await call()``, a request that places a stream on a cluster's peers: again while the
    cluster answers that no peer can take it (a node restarting, or not yet current after
    rejoining: seconds), for ``PLACEMENT_WAIT_S``; every other answer at once."""
    said: list[bool] = []

    def say(exc: BaseException, pause: float) -> str | None:
        if said:
            return None
        said.append(True)
        return f"{what}: {describe(exc)}; waiting for the cluster's peers"

    return await with_backoff(
        call,
        again=lambda exc: isinstance(exc, nats.js.errors.APIError) and exc.err_code == NO_PEERS,
        within_s=PLACEMENT_WAIT_S,
        say=say,
        first_pause_s=0.1,
    )
