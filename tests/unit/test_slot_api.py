"""The slot-tracker contract as data: bodies decode as Dynamo's extractor decodes them, each
call becomes its event, and each outcome gets Dynamo's status and error text
(docs/slot-tracker-api.md)."""

from __future__ import annotations

import msgspec
import pytest

from projector.http.slot_api import (
    AddBody,
    RegisterBody,
    RequestBody,
    UnregisterBody,
    answer,
    event_for,
    register_problem,
    request_event,
)
from seqstate import AddRequest, Free, MarkPrefillCompleted, WorkerAdded, WorkerRemoved

ADD = msgspec.json.Decoder(AddBody)
REGISTER = msgspec.json.Decoder(RegisterBody)
WHERE = "model=m/1 routing_group=default"


def add_body(**fields: object) -> bytes:
    body = {
        "model_name": "m/1",
        "request_id": "r",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [1, -1],
        **fields,
    }
    return msgspec.json.encode({k: v for k, v in body.items() if v is not None})


def test_an_add_becomes_its_event_with_hashes_as_u64_and_the_isl_as_the_prefill_hint() -> None:
    body = ADD.decode(add_body(new_isl_tokens=120, unknown="ignored"))
    assert body.routing_group == "default"
    assert event_for(body) == AddRequest(
        request_id="r", worker_id=1, block_hashes=[1, 2**64 - 1], prefill_tokens=120
    )
    untracked = event_for(ADD.decode(add_body()))
    assert isinstance(untracked, AddRequest) and untracked.track_prefill_tokens is False


@pytest.mark.parametrize(
    "fields",
    [
        {"sequence_hashes": None},  # required, [] allowed
        {"sequence_hashes": [2**63]},  # i64 only
        {"sequence_hashes": [1.5]},
        {"sequence_hashes": ["1"]},
        {"new_isl_tokens": -1},
        {"request_id": 7},
        {"worker_id": 2**64},
        {"dp_rank": 2**32},
    ],
)
def test_type_errors_are_validation_errors(fields: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        ADD.decode(add_body(**fields))


def test_register_checks_its_ranges_before_publishing() -> None:
    def problem(**fields: int) -> str | None:
        body = {
            "worker_id": 4,
            "model_name": "m",
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 1,
            **fields,
        }
        return register_problem(REGISTER.decode(msgspec.json.encode(body)))

    assert problem() is None
    assert problem(block_size=0) == "block_size must be greater than 0"
    assert problem(dp_size=0) == "dp_size must be greater than 0"
    assert problem(dp_start=4294967295, dp_size=1) == (
        "dp range overflows u32: start=4294967295 size=1"
    )
    assert problem(dp_start=4294967294, dp_size=1) is None
    fields = {"worker_id": 4, "model_name": "m", "block_size": 16, "dp_start": 3, "dp_size": 2}
    body = REGISTER.decode(msgspec.json.encode(fields))
    assert event_for(body) == WorkerAdded(worker_id=4, dp_start=3, dp_size=2, block_size=16)


def test_each_outcome_gets_dynamos_status_and_text() -> None:
    reg = RegisterBody(model_name="m/1", worker_id=4, block_size=32, dp_start=0, dp_size=1)
    assert answer("/register", reg, "applied") == (201, {"status": "ok"})
    assert answer("/register", reg, "worker_exists") == (
        409,
        {"error": f"worker 4 already registered for {WHERE}"},
    )
    assert answer("/register", reg, "block_size_mismatch", block_size=16) == (
        409,
        {"error": f"block_size mismatch for {WHERE}: existing=16, requested=32"},
    )
    unreg = UnregisterBody(model_name="m/1", worker_id=4)
    assert event_for(unreg) == WorkerRemoved(worker_id=4)
    assert answer("/unregister", unreg, "applied") == (200, {"status": "ok"})
    for outcome in ("unknown_worker", "no_tracker"):
        assert answer("/unregister", unreg, outcome) == (
            404,
            {"error": f"worker 4 not found for {WHERE}"},
        )
    add = ADD.decode(add_body(dp_rank=2))
    assert (
        answer("/add", add, "applied")
        == answer("/add", add, "superseded")
        == (201, {"status": "ok"})
    )
    assert answer("/add", add, "no_tracker") == (404, {"error": f"no slot tracker for {WHERE}"})
    unknown = "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 2 } not found"
    assert answer("/add", add, "unknown_worker") == (404, {"error": unknown})
    assert answer("/add", add, "duplicate", owner=(7, 3)) == (
        409,
        {
            "error": (
                "Request r already exists (assigned to worker WorkerWithDpRank { worker_id: 7, "
                "dp_rank: 3 })"
            )
        },
    )
    req = RequestBody(model_name="m/1", request_id="r")
    assert request_event("/prefill_complete", req) == MarkPrefillCompleted(
        request_id="r", worker_id=0
    )
    assert request_event("/free", req) == Free(request_id="r", worker_id=0)
    for outcome in ("applied", "duplicate"):  # idempotent
        assert answer("/prefill_complete", req, outcome) == (200, {"status": "ok"})
    assert answer("/prefill_complete", req, "unknown_request") == (
        404,
        {"error": "Request r not found"},
    )
    for outcome in ("applied", "unknown_request"):  # a free of an unknown id is 200
        assert answer("/free", req, outcome) == (200, {"status": "ok"})
    for route in ("/prefill_complete", "/free"):
        assert answer(route, req, "no_tracker") == (404, {"error": f"no slot tracker for {WHERE}"})
    assert answer("/free", req, None)[0] == 500
    with pytest.raises(ValueError, match="no answer"):
        answer("/free", req, "worker_exists")
