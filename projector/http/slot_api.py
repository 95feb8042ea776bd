"""Dynamo's slot-tracker API as data: request bodies, the events they become, and the answer
each outcome gets (docs/slot-tracker-api.md).

Pure on purpose: the HTTP server decodes a body into one of these Structs, publishes the event
:func:`event_for` makes, waits for the writer's outcome of it, and sends what :func:`answer`
says. So the whole contract (every status and every error text) is testable without a socket,
and the server is only plumbing. Unknown fields are ignored, as axum's extractor ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final

from msgspec import Meta, Struct

from seqstate.events import U32_MAX, AddRequest, Event, Free, MarkPrefillCompleted, WorkerAdded
from seqstate.events import WorkerRemoved as WorkerRemovedEvent

U64_MAX: Final = 2**64 - 1
U64 = Annotated[int, Meta(ge=0)]  # msgspec decodes JSON integers up to 2**64 - 1
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
I64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
USize = Annotated[int, Meta(ge=0)]

OK: Final = {"status": "ok"}


class _Tracker(Struct, kw_only=True):
    """Fields are keyword-only, so a required one may follow ``routing_group``'s default: a
    missing one is a 422, as serde's is."""

    model_name: str
    routing_group: str = "default"

    def __post_init__(self) -> None:
        # msgspec bounds stop at int64: u64 fields get their upper bound here (a 422 too).
        for name in ("worker_id", "new_isl_tokens"):
            if getattr(self, name, 0) > U64_MAX:
                raise ValueError(f"`{name}` is out of range for u64")

    def where(self) -> str:
        return f"model={self.model_name} routing_group={self.routing_group}"


class RegisterBody(_Tracker):
    worker_id: U64
    block_size: U32
    dp_start: U32
    dp_size: U32


class UnregisterBody(_Tracker):
    worker_id: U64


class AddBody(_Tracker):
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: list[I64]
    new_isl_tokens: USize = 0


class RequestBody(_Tracker):
    """``/prefill_complete`` and ``/free``."""

    request_id: str


class PotentialLoadsBody(_Tracker):
    sequence_hashes: list[I64]
    new_isl_tokens: USize = 0


def as_u64(value: int) -> int:
    """A signed i64 sequence hash, reinterpreted bit for bit as the u64 the core keys by."""
    return value & 0xFFFF_FFFF_FFFF_FFFF


def register_problem(body: RegisterBody) -> str | None:
    """The 400s ``/register`` answers before anything is published."""
    if body.block_size == 0:
        return "block_size must be greater than 0"
    if body.dp_size == 0:
        return "dp_size must be greater than 0"
    if body.dp_start + body.dp_size > U32_MAX:
        return f"dp range overflows u32: start={body.dp_start} size={body.dp_size}"
    return None


def event_for(body: Struct) -> Event:
    """The lifecycle event a mutating call publishes."""
    if isinstance(body, RegisterBody):
        return WorkerAdded(
            worker_id=body.worker_id,
            dp_start=body.dp_start,
            dp_size=body.dp_size,
            block_size=body.block_size,
        )
    if isinstance(body, UnregisterBody):
        return WorkerRemovedEvent(worker_id=body.worker_id)
    if isinstance(body, AddBody):
        return AddRequest(
            request_id=body.request_id,
            worker_id=body.worker_id,
            dp_rank=body.dp_rank,
            block_hashes=[as_u64(h) for h in body.sequence_hashes],
            prefill_tokens=body.new_isl_tokens,
            track_prefill_tokens=body.new_isl_tokens > 0,
        )
    raise TypeError(f"no event for {type(body).__name__}")


def request_event(route: str, body: RequestBody, worker_id: int = 0, dp_rank: int = 0) -> Event:
    """``/prefill_complete`` and ``/free`` name no worker: the caller says which holds the
    request (the fold finds it by id alone, but counts a worker that disagrees as
    ``worker_mismatch``, and the event is logged on its worker's subject, where ``inspect``
    reads an active request's events)."""
    if route == "/prefill_complete":
        return MarkPrefillCompleted(
            request_id=body.request_id, worker_id=worker_id, dp_rank=dp_rank
        )
    return Free(request_id=body.request_id, worker_id=worker_id, dp_rank=dp_rank)


def _rank(worker_id: int, dp_rank: int) -> str:
    return f"WorkerWithDpRank {{ worker_id: {worker_id}, dp_rank: {dp_rank} }}"


Answer = tuple[int, object]
# a route's answer to an outcome (with the owner and block size some need); None: none fits
Answering = Callable[[_Tracker, str, tuple[int, int] | None, int | None], Answer | None]


def answer(
    route: str,
    body: _Tracker,
    outcome: str | None,
    *,
    owner: tuple[int, int] | None = None,
    block_size: int | None = None,
) -> Answer:
    """The status and JSON body Dynamo's tracker answers a call whose event had ``outcome``
    (None: the writer refused the event, which the checks before publishing should make
    impossible; answered 500 rather than guessed)."""
    if outcome is None:
        return 500, {"error": "the ledger refused the event (see its dead letters)"}
    answering = _ANSWERS.get(route)
    found = None if answering is None else answering(body, outcome, owner, block_size)
    if found is None:
        raise ValueError(f"{route}: no answer for outcome {outcome!r}")
    return found


def _no_tracker(body: _Tracker) -> Answer:
    return 404, {"error": f"no slot tracker for {body.where()}"}


def _register_answer(
    body: _Tracker, outcome: str, owner: tuple[int, int] | None, block_size: int | None
) -> Answer | None:
    assert isinstance(body, RegisterBody)
    if outcome == "applied":
        return 201, OK
    if outcome == "worker_exists":
        return 409, {"error": f"worker {body.worker_id} already registered for {body.where()}"}
    if outcome == "block_size_mismatch":
        return 409, {
            "error": f"block_size mismatch for {body.where()}: existing={block_size}, "
            f"requested={body.block_size}"
        }
    return None


def _unregister_answer(
    body: _Tracker, outcome: str, owner: tuple[int, int] | None, block_size: int | None
) -> Answer | None:
    assert isinstance(body, UnregisterBody)
    if outcome == "applied":
        return 200, OK
    if outcome in ("unknown_worker", "no_tracker"):
        return 404, {"error": f"worker {body.worker_id} not found for {body.where()}"}
    return None


def _add_answer(
    body: _Tracker, outcome: str, owner: tuple[int, int] | None, block_size: int | None
) -> Answer | None:
    assert isinstance(body, AddBody)
    if outcome in ("applied", "superseded"):  # superseded: its free came first (kept)
        return 201, OK
    if outcome == "no_tracker":
        return _no_tracker(body)
    if outcome == "unknown_worker":
        return 404, {"error": f"Worker {_rank(body.worker_id, body.dp_rank)} not found"}
    if outcome == "duplicate":
        held = "" if owner is None else f" (assigned to worker {_rank(*owner)})"
        return 409, {"error": f"Request {body.request_id} already exists{held}"}
    return None


def _prefill_complete_answer(
    body: _Tracker, outcome: str, owner: tuple[int, int] | None, block_size: int | None
) -> Answer | None:
    if outcome in ("applied", "duplicate"):
        return 200, OK
    if outcome == "no_tracker":
        return _no_tracker(body)
    if outcome == "unknown_request":
        assert isinstance(body, RequestBody)
        return 404, {"error": f"Request {body.request_id} not found"}
    return None


def _free_answer(
    body: _Tracker, outcome: str, owner: tuple[int, int] | None, block_size: int | None
) -> Answer | None:
    if outcome in ("applied", "unknown_request"):
        return 200, OK
    if outcome == "no_tracker":
        return _no_tracker(body)
    return None


# Each route's answers, by outcome: None for an outcome the route never has.
_ANSWERS: Final[dict[str, Answering]] = {
    "/register": _register_answer,
    "/unregister": _unregister_answer,
    "/add": _add_answer,
    "/prefill_complete": _prefill_complete_answer,
    "/free": _free_answer,
}
