"""Where msgspec (the drop-in's decoder) and Dynamo's extractor part ways, body by body.

extractor_error is asked only about bodies msgspec refused, so msgspec must refuse every body
Dynamo refuses (refused_bodies). Some bodies only Dynamo accepts (the drop-in reads them as
Dynamo does), some only Dynamo refuses (error_for_accepted finds them), and valid bodies that
look like those to a cheap check pass both.
"""

from __future__ import annotations

import msgspec
import pytest
from refused_bodies import CASES, PREFIX, _ids
from refused_values import A

from projector.http.serde_errors import error_for_accepted, extractor_error
from projector.http.slot_routes import DECODERS, parse

# msgspec refuses these, Dynamo accepts them (extractor_error: None). The 5000-deep one is a
# RecursionError in msgspec, not a DecodeError: it escapes SlotService.call's except clauses.
ACCEPTED_BY_DYNAMO: list[tuple[str, str, bytes]] = [
    ("characters after the object", "/free", b'{"model_name":"m","request_id":"r"} x'),
    ("a second object", "/free", b'{"model_name":"m","request_id":"r"}{"model_name":1}'),
    ("a second closing brace", "/free", b'{"model_name":"m","request_id":"r"}}'),
    ("invalid UTF-8 after the object", "/free", b'{"model_name":"m","request_id":"r"}\xff'),
    ("positional", "/add", b'["m","g","r",1,0,[1,2],5]'),
    ("positional without the default", "/potential_loads", b'["m","g",[]]'),
    (
        "unknown field: lone surrogate",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\\ud800"}',
    ),
    (
        "unknown field: surrogate pair broken",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\\ud800\\u0041"}',
    ),
    (
        "unknown field: 5000 deep",
        "/free",
        b'{"model_name":"m","request_id":"r","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
    ),
]

# msgspec accepts these, Dynamo refuses them (error_for_accepted finds them).
REFUSED_BY_DYNAMO_ONLY: list[tuple[str, str, bytes, int, str]] = [
    (
        "duplicate field",
        "/free",
        b'{"model_name":"m","model_name":"x","request_id":"r"}',
        422,
        "duplicate field `model_name` at line 1 column 30",
    ),
    (
        "escaped duplicate",
        "/free",
        b'{"model_name":"m","request_id":"r","model\\u005fname":"n"}',
        422,
        "duplicate field `model_name` at line 1 column 52",
    ),
    (
        "hash -0",
        "/add",
        A + b'"sequence_hashes":[-0]}',
        422,
        "sequence_hashes[0]: invalid type: floating point `-0.0`, expected i64 at line 1 column 82",
    ),
    (
        "worker_id -0",
        "/unregister",
        b'{"worker_id":-0,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `-0.0`, expected u64 at line 1 column 15",
    ),
]

# Both accept these; some look like the ones above to a cheap check.
VALID: list[tuple[str, str, bytes]] = [
    ("plain add", "/add", A + b'"sequence_hashes":[-1,9223372036854775807,-9223372036854775808]}'),
    (
        "a UUID request id with -0 in it",
        "/free",
        b'{"model_name":"m","request_id":"5f1c-0a9e-40d1"}',
    ),
    ("a -0 inside a string value", "/free", b'{"model_name":"a:-0,","request_id":"r"}'),
    ("a field name as a value", "/free", b'{"model_name":"request_id","request_id":"r"}'),
    ("unicode names", "/free", '{"model_name":"模型-é","request_id":"r😀"}'.encode()),
    ("escapes in a value", "/free", b'{"model_name":"m\\u00e9\\n","request_id":"r"}'),
    (
        "invalid UTF-8 in an unknown value",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\xff"}',
    ),
    ("negative numbers", "/unregister", b'{"worker_id":0,"model_name":"m","x":[-0.5,-10,-0e1]}'),
]


@pytest.mark.parametrize(("what", "route", "body", "status", "text"), CASES, ids=_ids(CASES))
def test_msgspec_refuses_each_case(
    what: str, route: str, body: bytes, status: int, text: str
) -> None:
    """extractor_error is only asked about bodies msgspec refused."""
    with pytest.raises(msgspec.DecodeError):
        DECODERS[route].decode(body)


# The fields Dynamo reads from each body of ACCEPTED_BY_DYNAMO (an unknown field skipped
# unread, whatever its depth; an array read by position).
READ_AS = {
    "/free": {"model_name": "m", "routing_group": "default", "request_id": "r"},
    "/add": {
        "model_name": "m",
        "routing_group": "g",
        "request_id": "r",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [1, 2],
        "new_isl_tokens": 5,
    },
    "/potential_loads": {
        "model_name": "m",
        "routing_group": "g",
        "sequence_hashes": [],
        "new_isl_tokens": 0,
    },
}


@pytest.mark.parametrize(
    ("what", "route", "body"), ACCEPTED_BY_DYNAMO, ids=_ids(ACCEPTED_BY_DYNAMO)
)
def test_bodies_only_dynamo_accepts(what: str, route: str, body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, RecursionError)):
        DECODERS[route].decode(body)
    assert extractor_error(route, body) is None
    assert msgspec.to_builtins(parse(route, body)) == READ_AS[route]  # what Dynamo reads


@pytest.mark.parametrize(
    ("what", "route", "body", "status", "text"),
    REFUSED_BY_DYNAMO_ONLY,
    ids=_ids(REFUSED_BY_DYNAMO_ONLY),
)
def test_bodies_only_dynamo_refuses(
    what: str, route: str, body: bytes, status: int, text: str
) -> None:
    DECODERS[route].decode(body)
    assert error_for_accepted(route, body) == (status, PREFIX[status] + text)


@pytest.mark.parametrize(("what", "route", "body"), VALID, ids=_ids(VALID))
def test_valid_bodies(what: str, route: str, body: bytes) -> None:
    DECODERS[route].decode(body)
    assert extractor_error(route, body) is None
    assert error_for_accepted(route, body) is None
