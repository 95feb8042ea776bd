"""What one publish call of :class:`~projector.route.publisher.RouterPublisher` knows of its
messages (their sequences, their failed attempts), and what it says when it fails.

Apart from the publisher because it owns no connection: an event's msg-id, its sequence or the
reasons it was not stored are the call's; the publisher only sends and hears the acks.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Sequence
from urllib.parse import quote

import nats.js.errors

from projector.nats.failures import describe
from seqstate import Event
from seqstate.errors import SeqstateError
from seqstate.events import MAX_ROUTER_ID

# Kept as they are in a msg-id: printable ASCII but "%", the escape. A header value is trimmed
# and its CR/LF turned into spaces on the way out, so " r" and "r", or "a\nb" and "a b", would
# otherwise share msg-ids: the second router's events refused as duplicates, or lost on a retry.
_MSG_ID_SAFE = string.punctuation.replace("%", "")
SHOWN_ID_CHARS = 60  # of an id in an error message


class EventTooLarge(SeqstateError, ValueError):
    """An event over the one size rule (:mod:`projector.wire.sizes`): the writer would not
    apply it, or the server could not store its delta."""


class PublishError(SeqstateError, RuntimeError):
    """An event could not be stored on the stream; the message names the request and msg-id.

    Raised by :meth:`RouterPublisher.publish_many`, ``sequences`` holds the stream sequence of
    every event of the call in the given order, ``None`` for each one not stored (the one named
    and any other that failed); else it is ``None``. ``taken_at``: when the event's msg-id was
    already used (a first attempt acknowledged as a duplicate), the stream sequence holding it;
    ``squatted``: that message came in through the Dynamo capture.
    """

    taken_at: int | None = None
    squatted: bool = False

    def __init__(
        self,
        message: str,
        *,
        msg_id: str,
        request_id: str | None,
        sequences: list[int | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.msg_id = msg_id
        self.request_id = request_id
        self.sequences = sequences


# What a send or an ack wait can raise while the server is away or the client gave up on it:
# the client's own errors, and the socket's (TimeoutError is an OSError too). A publish turns
# each into a retry and, at the end, a PublishError: a router handles one exception, not ours
# plus nats-py's.
class Round:
    """One attempt at some events of a call (:meth:`RouterPublisher.publish` is a call of one).

    Every event sent gets a reply token of its own; the publisher's reply callback settles it
    (``seqs``/``errors`` of the call, by index) and the timer expires the ones not acknowledged
    within the timeout. ``sent`` lists (deadline, token, index) in send order, so deadlines
    increase along it and the timer only ever looks at its unsettled front.
    """

    __slots__ = ("call", "cursor", "done", "first", "open", "sending", "sent", "timer")

    def __init__(self, call: PublishCall, first: bool, done: asyncio.Future[None]) -> None:
        self.call = call
        self.first = first  # the first attempt: a duplicate ack means a msg-id collision
        self.done = done
        self.open = 0  # sent and not settled
        self.sending = True
        self.sent: list[tuple[float, int, int]] = []
        self.cursor = 0
        self.timer: asyncio.TimerHandle | None = None


class PublishCall:
    """What one call knows about its messages, by index in the order sent: each message one
    event, or a record batch of ``members`` (the indices of its events in the given order;
    ``events[i]`` is its first, the one an error names)."""

    __slots__ = (
        "errors",
        "events",
        "fatal",
        "members",
        "msg_ids",
        "payloads",
        "refusals",
        "seqs",
        "subjects",
        "taken",
    )

    def __init__(
        self,
        events: list[Event],
        subjects: list[str],
        payloads: list[bytes],
        msg_ids: list[str],
        members: list[list[int]] | None = None,
    ) -> None:
        self.members = members  # None: one event per message, in the given order
        self.events = events
        self.subjects = subjects
        self.payloads = payloads
        self.msg_ids = msg_ids
        self.seqs: list[int | None] = [None] * len(events)
        self.errors: dict[int, list[str]] = {}  # the failed attempts of each event
        self.fatal: dict[int, PublishError] = {}  # not to be retried (a msg-id collision)
        self.refusals: dict[int, int] = {}  # the error acks of each event (see REFUSED_RETRIES)
        self.taken: dict[int, int] = {}  # a first attempt acked duplicate: the seq holding it

    def request_id(self, i: int) -> str | None:
        return getattr(self.events[i], "request_id", None)

    def weight(self, i: int) -> int:
        """The events message ``i`` carries: the slots it takes on the wire."""
        return 1 if self.members is None else len(self.members[i])

    def per_event(self, seqs: Sequence[int | None]) -> list[int | None]:
        """The messages' sequences as each event's, in the given order."""
        members = self.members
        if members is None:
            return list(seqs)
        out: list[int | None] = [None] * sum(len(m) for m in members)
        for seq, indices in zip(seqs, members, strict=True):
            for n in indices:
                out[n] = seq
        return out


def quoted_router_id(router_id: str) -> str:
    """``router_id`` as its msg-ids carry it (percent-encoded); ValueError naming why it
    cannot be one (a command checks it before it reads or sends anything)."""
    if not router_id:
        raise ValueError("router_id must not be empty")
    if len(router_id) > MAX_ROUTER_ID:
        raise ValueError(
            f"router_id {shown(router_id)}: at most {MAX_ROUTER_ID} characters "
            "(what a RouterHeartbeat carries)"
        )
    try:
        return quote(router_id, safe=_MSG_ID_SAFE)
    except UnicodeEncodeError:
        raise ValueError(f"router_id {shown(router_id)}: not encodable as UTF-8") from None


def refused_by_permissions(call: PublishCall, i: int) -> PublishError:
    """Event ``i`` of ``call`` was refused by the server's permissions: said so, not retried."""
    return not_stored(
        call,
        i,
        f'NATS refused a publish to "{call.subjects[i]}" (permissions violation: this user may '
        "not publish it)",
    )


def not_stored(call: PublishCall, i: int, why: str) -> PublishError:
    """Event ``i`` of ``call`` cannot be stored, for a reason no retry changes."""
    request_id = call.request_id(i)
    return PublishError(
        f"{event_named(call.events[i], request_id)}: msg-id {call.msg_ids[i]} not stored: {why}",
        msg_id=call.msg_ids[i],
        request_id=request_id,
    )


def attempts_said(errors: list[str]) -> str:
    """The failed attempts' reasons, a run of the same one said once with its count."""
    runs: list[tuple[str, int]] = []
    for error in errors:
        if runs and runs[-1][0] == error:
            runs[-1] = (error, runs[-1][1] + 1)
        else:
            runs.append((error, 1))
    return "; ".join(text if n == 1 else f"{text}, {n} times" for text, n in runs) or "?"


def event_named(event: Event, request_id: str | None) -> str:
    name = type(event).__name__
    return f"{name} for request {shown(request_id)}" if request_id is not None else name


def shown(text: str) -> str:
    """An id as an error message shows it: quoted, escaped (one line), at most
    ``SHOWN_ID_CHARS`` of it, and its length when longer."""
    if len(text) <= SHOWN_ID_CHARS:
        return repr(text)
    return f"{text[:SHOWN_ID_CHARS]!r}… ({len(text):,} characters)"


def describe_attempt(exc: BaseException) -> str:
    """A failed attempt, as :func:`projector.nats.failures.describe` names it (a full stream,
    JetStream storage full); a timeout here is an ack that never came."""
    if isinstance(exc, TimeoutError):
        return TIMED_OUT
    return describe(exc)


TIMED_OUT = "ack timed out"
NO_STREAM = describe_attempt(nats.js.errors.NoStreamResponseError())
