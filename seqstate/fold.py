"""The fold of the log: for each stored message, applied (its delta) or refused, and why.

Every reader that folds the events stream (the writer, a replay, ``rebuild``, ``verify``, the
fault tests' reference) hands each stored message, ``(seq, log_time_ns, subject, payload)``, to
a :class:`Fold`, and nothing else decides. They used to decide each on their own, and they
disagreed: the writer refused an event too large for its delta to fit a message (a limit it
read from the server's ``max_payload``), while replay and rebuild booked it, so ``verify`` called
a wrong bucket identical. Now a disagreement would need two folds of this one class.

The rules, in order; the first that refuses decides, with a ``kind`` (the dead letters' bounded
word, a metric's label) and a reason for a person:

1. **size** (``too_large``): a payload over ``max_event_bytes``, a number of the configuration
   (:class:`FoldRules`), never of a live connection. The writer checks at start that the
   server can store the delta of the largest event it takes.
2. **decode** (``undecodable``): any bytes at all; whatever the decoder raises is a refusal
   (the decoder is built never to nest deeper than an event, see :mod:`seqstate.events`).
3. **subject** (``wrong_subject``): a request event (AddRequest, MarkPrefillCompleted, Free,
   AddOutputBlock) belongs on its own rank's subject ``seqstate.events.<ns>.<worker>.<rank>``,
   a router's heartbeat and goodbye on ``seqstate.events.<ns>.routers`` (or, as logs written
   before that subject have them, on control), every other event on
   ``seqstate.events.<ns>.control``; an event elsewhere, or naming another rank than its
   subject, is refused. A router allowed the worker and routers subjects cannot book work on
   another worker, nor remove one.
4. **bounds** (``out_of_bounds``): :meth:`seqstate.bounds.RankBounds.refusal` (ranks, routers,
   and the sums a rank keeps).
5. **apply**: :meth:`seqstate.state.SequenceState.apply`, whose oddities are outcomes.

Dynamo's own replica-sync messages (:mod:`seqstate.dynamo`) are told by their subject alone,
the namespace's capture of an endpoint ``seqstate.events.<ns>.dynamo.<NS>.<C>.<E>`` or
Dynamo's own ``namespace.*.component.*.endpoint.*.active_sequences_events`` (no
configuration, so every fold of a log decides alike; another namespace's capture is on
another subject than its own), and go through the same rules: size (a message refused for
it still counts in its publisher's sequence: it reached the log, it is not lost); decode
(:func:`~seqstate.dynamo.decode_dynamo`, then the seqstate event the message is, as a Dynamo
replica applies it); their subject is their own by shape; bounds, as for seqstate's own
AddRequest; apply. Before the bounds, the message's ``(publisher_id, sequence)`` is counted
(:mod:`seqstate.publishers`): a hole it reveals is the delta's ``hole`` (or said in the
refusal). A message of seqstate's own resync publisher (:func:`~seqstate.dynamo.
resync_publisher_id` of the namespace) is the outcome ``echo`` and changes nothing. Mark and
Free find their request by id, whatever worker they name, as Dynamo's replicas do. The time
is the log's, never the publisher's ``published_at``. A seqstate event on a Dynamo subject, or
a Dynamo message on a seqstate subject, is ``wrong_subject``.

A **record batch** (:mod:`seqstate.batches`: a stored message of many seqstate events) is
refused whole only when it is no batch of this version within its bounds (``too_large`` over
its bound of events or bytes, ``undecodable`` otherwise); else each of its events goes
through rules 1 to 5 in order, on the batch's subject, at the batch's sequence and log time,
as if it were a message of its own: a poison event is refused alone (at its index in the
batch's list of verdicts, its reason naming it), its neighbours apply. So a batch books
nothing a client could not book by publishing its events one by one on that subject: a batch
on a rank's subject holds that rank's request events, on control the control events. A
batch is told by its first bytes (the fold sees the payload, never a header), which no event
and no Dynamo message starts with, so a log without batches folds as before, byte for byte.

:meth:`Fold.__call__` never raises for any message; it is a pure function of the state, the
rules and the message.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from seqstate.batches import HEAD as BATCH_HEAD
from seqstate.batches import BatchTooLarge, decode_batch, is_batch
from seqstate.bounds import RankBounds
from seqstate.deltas import Delta, Hole
from seqstate.dynamo import (
    CAPTURED,
    core_event,
    decode_dynamo,
    is_dynamo_subject,
    resync_publisher_id,
)
from seqstate.events import (
    AddOutputBlock,
    AddRequest,
    Event,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    decode_event,
)
from seqstate.state import SequenceState

# The kinds of refusal: the dead letters count them under these words.
UNDECODABLE: Final = "undecodable"  # not an event: bad bytes, unknown tag, a field out of range
TOO_LARGE: Final = "too_large"  # an event whose delta could never fit a message
WRONG_SUBJECT: Final = "wrong_subject"  # an event on another subject than its own
OUT_OF_BOUNDS: Final = "out_of_bounds"  # an event that would pass a bound of the write model
KINDS: Final = (UNDECODABLE, TOO_LARGE, OUT_OF_BOUNDS, WRONG_SUBJECT)

# What the writer took by default before this rule: nats-server's default max_payload (1 MiB)
# less the room a delta adds to its event (1 KiB) and a message's headers (4 KiB).
MAX_EVENT_BYTES: Final = 1_048_576 - 5 * 1024

CONTROL: Final = "control"
ROUTERS: Final = "routers"
# The events a router publishes on its rank's subject, and those on the routers subject; every
# other goes on the control subject.
WORKER_EVENTS: Final = (AddRequest, MarkPrefillCompleted, Free, AddOutputBlock)
ROUTER_EVENTS: Final = (RouterHeartbeat, RouterGoodbye)
_WORKER_TYPES: Final = frozenset(WORKER_EVENTS)
_ROUTER_TYPES: Final = frozenset(ROUTER_EVENTS)
_UNSEEN: Final[tuple[int, ...]] = (-1,)  # a subject not parsed yet (compared by identity)
_ROUTERS_ROUTE: Final[tuple[int, ...]] = (-2,)  # the routers subject's route
_DYNAMO_ROUTE: Final[tuple[int, ...]] = (-3,)  # a Dynamo lifecycle subject's route
# The first byte of a msgpack array (a seqstate event's envelope) and of a map (Dynamo's).
_ARRAY_HEADS: Final = frozenset(bytes([b]) for b in (*range(0x90, 0xA0), 0xDC, 0xDD))
_MAP_HEADS: Final = frozenset(bytes([b]) for b in (*range(0x80, 0x90), 0xDE, 0xDF))
_RANK_TOKENS: Final = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")
_ROUTES_KEPT: Final = 65_536  # subjects remembered; a flood of invented ones is forgotten


def events_prefix(namespace: str) -> str:
    """What every event subject of ``namespace`` starts with."""
    return f"seqstate.events.{namespace}."


def worker_subject(namespace: str, worker_id: int, dp_rank: int = 0) -> str:
    """The subject of a rank's request events."""
    return f"seqstate.events.{namespace}.{worker_id}.{dp_rank}"


def control_subject(namespace: str) -> str:
    """The subject of the events that name no rank: topology, routers, Ticks."""
    return f"seqstate.events.{namespace}.{CONTROL}"


def routers_subject(namespace: str) -> str:
    """The subject of a router's own lifecycle: kept off control, which is the operator's."""
    return f"seqstate.events.{namespace}.{ROUTERS}"


def subject_of(namespace: str, event: Event) -> str:
    """The subject ``event`` is published on (rule 3; a router's lifecycle is also taken on
    control, where logs written before the routers subject have it)."""
    if isinstance(event, WORKER_EVENTS):
        return worker_subject(namespace, event.worker_id, event.dp_rank)
    if isinstance(event, ROUTER_EVENTS):
        return routers_subject(namespace)
    return control_subject(namespace)


def event_of(subject: str, payload: bytes | bytearray | memoryview) -> Event:
    """The seqstate event a stored message is (a Dynamo message: the event it folds as), for
    a log line; raises :class:`~seqstate.events.EventDecodeError` for bytes that are none."""
    if is_dynamo_subject(subject):
        return core_event(decode_dynamo(payload))
    return decode_event(payload)


def events_of(
    subject: str, payload: bytes | bytearray | memoryview
) -> list[tuple[int | None, Event]]:
    """The seqstate events a stored message is, for a tool: ``[(None, event)]`` of a message
    of one event, ``(index, event)`` of each event of a record batch that decodes (the others
    are passed over); raises :class:`~seqstate.events.EventDecodeError` for bytes that are
    none."""
    if payload[:1] == BATCH_HEAD and is_batch(payload):
        found: list[tuple[int | None, Event]] = []
        for index, item in enumerate(decode_batch(payload)):
            with contextlib.suppress(EventDecodeError):
                found.append((index, event_of(subject, item)))
        return found
    return [(None, event_of(subject, payload))]


@dataclass(frozen=True)
class FoldRules:
    """What a fold decides by, beside the state's own rules (which its snapshots carry).

    ``namespace`` names the subjects events belong on; ``max_event_bytes`` is the size rule;
    ``bounds`` the write model's admission bounds. Every fold of a namespace's log is given
    the same rules (``Config.fold_rules``), so they agree message by message."""

    namespace: str = "default"
    max_event_bytes: int = MAX_EVENT_BYTES
    bounds: RankBounds = field(default_factory=RankBounds)

    def __post_init__(self) -> None:
        if self.max_event_bytes < 1:
            raise ValueError("max_event_bytes must be positive")


class Refusal(NamedTuple):
    """A message the fold did not apply: ``kind`` (one of :data:`KINDS`), the reason for a
    person, and the event when it decoded (for a log line's fields). An event of a record
    batch is refused at its place in the batch's list of verdicts (its index), and its
    reason begins by naming it."""

    kind: str
    reason: str
    event: Event | None = None


Verdict = Delta | Refusal
Route = tuple[int, ...] | None  # a subject's: see Fold._route


class Fold:
    """Folds stored messages into ``state`` by ``rules``; ``fold(seq, log_time_ns, subject,
    payload)`` returns the :class:`Delta` (its ``seq`` set) or the :class:`Refusal`.

    ``state`` may be replaced (a restored snapshot): assign ``fold.state``."""

    __slots__ = (
        "_apply",
        "_limit",
        "_prefix",
        "_refusal",
        "_resync_id",
        "_routes",
        "_state",
        "rules",
    )

    def __init__(self, state: SequenceState, rules: FoldRules | None = None) -> None:
        self.rules = rules = rules if rules is not None else FoldRules()
        self._limit = rules.max_event_bytes
        self._prefix = events_prefix(rules.namespace)
        self._refusal = rules.bounds.refusal
        self._resync_id = resync_publisher_id(rules.namespace)
        # subject -> (worker, rank) of a rank's subject, () of the control subject, None of
        # any other: parsed once per subject, not per message.
        self._routes: dict[str, tuple[int, ...] | None] = {}
        self.state = state

    @property
    def state(self) -> SequenceState:
        return self._state

    @state.setter
    def state(self, state: SequenceState) -> None:
        self._state = state
        self._apply = state.apply

    def __call__(
        self, seq: int, log_time_ns: int, subject: str, payload: bytes
    ) -> Verdict | list[Verdict]:
        """Apply one stored message, or say why not: its verdict, or for a record batch
        (:mod:`seqstate.batches`) one verdict per event, in order. Never raises."""
        route = self._routes.get(subject, _UNSEEN)
        if route is _UNSEEN:
            route = self._route(subject)
        if payload[:1] == BATCH_HEAD and is_batch(payload):
            return self._batch(seq, log_time_ns, subject, route, payload)
        if len(payload) > self._limit:
            return self._too_large(route, log_time_ns, payload)
        if route is _DYNAMO_ROUTE:
            return self._dynamo(seq, log_time_ns, subject, payload)
        return self._event(seq, log_time_ns, subject, route, payload)

    def _event(self, seq: int, at_ns: int, subject: str, route: Route, payload: bytes) -> Verdict:
        """Rules 2 to 5 for one seqstate event (alone, or of a batch)."""
        try:
            event = decode_event(payload)
        except EventDecodeError as bad:
            return self._undecodable(subject, payload, str(bad))
        except Exception as odd:  # whatever a decoder could still raise: never fatal
            return Refusal(UNDECODABLE, f"malformed event bytes: {type(odd).__name__}: {odd}")
        if type(event) in _WORKER_TYPES:  # an isinstance of a Struct class costs ~80 ns each
            if (
                not route
                or route[0] != event.worker_id  # type: ignore[union-attr]
                or route[1] != event.dp_rank  # type: ignore[union-attr]
            ):
                return self._misrouted(subject, event)
        elif type(event) in _ROUTER_TYPES:
            if route != () and route != _ROUTERS_ROUTE:
                return self._misrouted(subject, event)
        elif route != ():
            return self._misrouted(subject, event)
        why = self._refusal(self._state, event)
        if why:
            return Refusal(OUT_OF_BOUNDS, f"refused: {why}", event)
        delta = self._apply(event, at_ns)
        delta.seq = seq
        return delta

    def _batch(
        self, seq: int, at_ns: int, subject: str, route: Route, payload: bytes
    ) -> Verdict | list[Verdict]:
        """A record batch: refused whole if it is no batch of this version within its
        bounds; else each event by rules 1 to 5 on the batch's subject, in order, at the
        batch's sequence and log time. A refusal names its event's index."""
        try:
            items = decode_batch(payload)
        except BatchTooLarge as big:
            return Refusal(TOO_LARGE, str(big))
        except EventDecodeError as bad:
            return Refusal(UNDECODABLE, str(bad))
        except Exception as odd:  # whatever a decoder could still raise: never fatal
            return Refusal(UNDECODABLE, f"malformed record batch: {type(odd).__name__}: {odd}")
        verdicts: list[Verdict] = []
        limit = self._limit
        dynamo = route is _DYNAMO_ROUTE
        for index, item in enumerate(items):
            if len(item) > limit:
                verdict: Verdict = self._too_large(route, at_ns, item)
            elif dynamo:  # a Dynamo message, decided exactly as it is alone
                verdict = self._dynamo(seq, at_ns, subject, item)
            elif item[:1] == BATCH_HEAD:
                verdict = Refusal(UNDECODABLE, "a record batch inside a record batch")
            else:
                verdict = self._event(seq, at_ns, subject, route, item)
            if type(verdict) is Refusal:
                verdict = verdict._replace(  # type: ignore[union-attr]
                    reason=f"event {index} of the batch: {verdict.reason}"  # type: ignore[union-attr]
                )
            else:
                delta: Delta = verdict  # type: ignore[assignment]
                delta.index = index
            verdicts.append(verdict)
        return verdicts

    def _too_large(
        self, route: tuple[int, ...] | None, log_time_ns: int, payload: bytes
    ) -> Refusal:
        """Rule 1. A Dynamo message refused for its size still took its place in its
        publisher's sequence: counted as heard, so the next one reveals no hole it is not."""
        reason = (
            f"refused: an event of {len(payload)} bytes; its delta would not fit a message "
            f"(at most {self._limit} bytes of event)"
        )
        if route is _DYNAMO_ROUTE:
            try:
                message = decode_dynamo(payload)
            except Exception:  # its bytes are no Dynamo message: nothing to count
                return Refusal(TOO_LARGE, reason)
            if message.publisher_id != self._resync_id:
                hole = self._state.publishers.heard(
                    message.publisher_id, message.sequence, log_time_ns
                )
                reason += _hole_text(hole)
        return Refusal(TOO_LARGE, reason)

    def _route(self, subject: str) -> tuple[int, ...] | None:
        routes = self._routes
        if len(routes) >= _ROUTES_KEPT:
            routes.clear()
        route: tuple[int, ...] | None = None
        if subject.startswith(self._prefix):
            rest = subject[len(self._prefix) :]
            if rest == CONTROL:
                route = ()
            elif rest == ROUTERS:
                route = _ROUTERS_ROUTE
            else:
                match = _RANK_TOKENS.fullmatch(rest)
                if match is not None:
                    route = (int(match[1]), int(match[2]))
                elif is_dynamo_subject(subject):  # the namespace's capture of an endpoint
                    route = _DYNAMO_ROUTE
        elif is_dynamo_subject(subject) and not subject.startswith("seqstate."):
            route = _DYNAMO_ROUTE  # Dynamo's own subject (another namespace's capture: None)
        routes[subject] = route
        return route

    def _dynamo(self, seq: int, log_time_ns: int, subject: str, payload: bytes) -> Verdict:
        """A Dynamo replica-sync message: decoded, counted, bounded, applied as its event."""
        try:
            message = decode_dynamo(payload)
        except EventDecodeError as bad:
            return self._not_dynamo(subject, payload, str(bad))
        except Exception as odd:  # whatever a decoder could still raise: never fatal
            return Refusal(UNDECODABLE, f"malformed Dynamo message: {type(odd).__name__}: {odd}")
        state = self._state
        if message.publisher_id == self._resync_id:
            delta = state.echo(log_time_ns)
            delta.seq = seq
            return delta
        event = core_event(message)
        hole = state.publishers.heard(message.publisher_id, message.sequence, log_time_ns)
        why = self._refusal(state, event)
        if why:
            return Refusal(OUT_OF_BOUNDS, f"refused: {why}{_hole_text(hole)}", event)
        delta = self._apply(event, log_time_ns)
        delta.seq = seq
        if hole is not None:
            delta.hole = hole
        return delta

    def _not_dynamo(self, subject: str, payload: bytes, reason: str) -> Refusal:
        """Bytes on a Dynamo subject that are no Dynamo message: a seqstate event is on the
        wrong subject, anything else undecodable."""
        if payload[:1] not in _ARRAY_HEADS:  # an event is an array: no second decode
            return Refusal(UNDECODABLE, reason)
        try:
            event = decode_event(payload)
        except Exception:
            return Refusal(UNDECODABLE, reason)
        return self._misrouted(subject, event)

    def _undecodable(self, subject: str, payload: bytes, reason: str) -> Refusal:
        """Bytes on a seqstate subject that are no seqstate event: a Dynamo message is on the
        wrong subject, anything else undecodable."""
        if payload[:1] not in _MAP_HEADS:  # a Dynamo message is a map: no second decode
            return Refusal(UNDECODABLE, reason)
        try:
            message = decode_dynamo(payload)
        except Exception:
            return Refusal(UNDECODABLE, reason)
        event = core_event(message)
        return Refusal(
            WRONG_SUBJECT,
            f"refused: a Dynamo {message.op} of publisher {message.publisher_id} on subject "
            f"{_shown(subject)!r}; the namespace's Dynamo messages belong on "
            f"'{self._prefix}{CAPTURED}.<NS>.<COMPONENT>.<ENDPOINT>'",
            event,
        )

    def _misrouted(self, subject: str, event: Event) -> Refusal:
        own = subject_of(self.rules.namespace, event)
        name = type(event).__name__
        if isinstance(event, WORKER_EVENTS):
            what = f"{name} of worker {event.worker_id} rank {event.dp_rank}"
        else:
            what = name
        return Refusal(
            WRONG_SUBJECT,
            f"refused: {what} on subject {_shown(subject)!r}; it belongs on {own!r}",
            event,
        )


def _hole_text(hole: Hole | None) -> str:
    """What a refusal adds when the message revealed a hole in its publisher's sequence."""
    if hole is None:
        return ""
    return (
        f" (and {hole.missing} message(s) of Dynamo publisher {hole.publisher_id} before it, "
        f"from sequence {hole.first_missing}, never reached the log)"
    )


def _shown(subject: str) -> str:
    return subject if len(subject) <= 200 else subject[:200] + "…"
