"""The slot tracker's routes and what a call must be before anything is stored: its route,
its method, its content type and its body, as Dynamo's axum and serde_json decide them.

Every call, whichever way it is then answered (the lease holder's own fold or the deltas),
is checked here, once: :func:`route` says either the answer at once or the parsed call.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import msgspec

from projector.http.serde_errors import (
    PARSE_PREFIX,
    accepted_fields,
    error_for_accepted,
    extractor_error,
)
from projector.http.slot_api import (
    AddBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestBody,
    UnregisterBody,
)
from seqstate.errors import SeqstateError

DECODERS: dict[str, msgspec.json.Decoder] = {  # type: ignore[type-arg]
    "/register": msgspec.json.Decoder(RegisterBody),
    "/unregister": msgspec.json.Decoder(UnregisterBody),
    "/add": msgspec.json.Decoder(AddBody),
    "/prefill_complete": msgspec.json.Decoder(RequestBody),
    "/free": msgspec.json.Decoder(RequestBody),
    "/potential_loads": msgspec.json.Decoder(PotentialLoadsBody),
}
READS = frozenset({"/loads", "/workers", "/potential_loads"})
ROUTES: dict[str, str] = {
    **dict.fromkeys(DECODERS, "POST"),
    "/loads": "GET",
    "/workers": "GET",
    "/health": "GET",
}
EMPTY_ID = "request_id: must not be empty (the ledger keeps no request without an id)"

Body = RegisterBody | UnregisterBody | AddBody | RequestBody


class Rejected(SeqstateError):
    """A call refused before anything is stored: a body (``answer`` is serde_json's, word for
    word), or a tracker this process has no room for."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.answer: tuple[int, object] = (status, {"error": error})


def parse(path: str, body: bytes) -> Any:
    """The body of a call to ``path`` as Dynamo's serde_json reads it, or :class:`Rejected`:
    msgspec decodes it, and the few bodies the two read differently are settled by serde's
    rules (serde_errors)."""
    decoder = DECODERS[path]
    try:
        parsed = decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        problem = extractor_error(path, body)
        if problem is not None:
            raise Rejected(*problem) from None
        try:  # one of the few bodies serde reads and msgspec does not
            return msgspec.convert(accepted_fields(path, body), decoder.type)
        except (ValueError, RecursionError, msgspec.ValidationError) as exc:
            raise Rejected(400, f"{PARSE_PREFIX}{exc}") from None
    problem = error_for_accepted(path, body)
    if problem is not None:
        raise Rejected(*problem)
    if getattr(parsed, "request_id", None) == "":
        raise Rejected(422, EMPTY_ID)  # serde takes it; the log keeps no nameless request
    return parsed


@lru_cache(maxsize=64)  # a client sends the same one again and again: said once
def is_json(content_type: str) -> bool:
    """axum's test: ``application/json`` or any ``application/*+json``, parameters aside."""
    mime = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class Read:
    """A GET that reads trackers (``/loads``, ``/workers``): it has nothing to store."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


_READS = {path: Read(path) for path in ("/loads", "/workers")}


def route(
    method: str, path: str, content_type: str | None, body: bytes
) -> tuple[int, object] | Read | Body | PotentialLoadsBody | None:
    """What a call is: an answer at once (a wrong route, method or body), a :class:`Read`,
    a parsed POST, or None for ``/health`` (answered by whoever serves)."""
    wanted = ROUTES.get(path)
    if wanted is None:
        return 404, {"error": "route not found"}
    if method == "HEAD" and wanted == "GET":  # as axum routes it: a GET without its body
        method = "GET"
    if method != wanted:
        return 405, {"error": "method not allowed"}
    if path == "/health":
        return None
    if wanted == "GET":
        return _READS[path]
    if content_type is None or not is_json(content_type):
        return 415, {"error": "Expected request with `Content-Type: application/json`"}
    try:
        parsed: Body | PotentialLoadsBody = parse(path, body)
    except Rejected as rejected:
        return rejected.answer
    return parsed


def allowed(path: str) -> str | None:
    """A route's ``Allow`` header, as axum lists it."""
    wanted = ROUTES.get(path)
    return None if wanted is None else "GET,HEAD" if wanted == "GET" else wanted


def reads(path: str) -> bool:
    """A call that must see the answers of every call before it on its connection."""
    return path in READS
