"""The error texts Dynamo's slot tracker answers for a request body it cannot extract.

Dynamo's HTTP server is axum: its ``Json`` extractor runs serde_json, through
serde_path_to_error, over the body into a ``#[derive(Deserialize)]`` struct, and answers the
error's text, ``<path>: <serde_json message> at line L column C``: a 400 for a syntax or EOF
error, a 422 for a data error. msgspec refuses the same bodies with other words, and the texts
are part of the drop-in's contract (docs/slot-tracker-api.md), so a refused body is walked
again as serde_json walks it (:mod:`.serde_reader`), to the row of :data:`.serde_cases.CASES`
it ends in: serde's text and its position rule. Values are shown in Rust's words
(:mod:`.rust_text`).

msgspec and serde do not refuse quite the same bodies. Dynamo accepts, where msgspec refuses:
anything after the body's first value (axum's extractor never checks for trailing
characters); a positional array (a derived struct reads one field by field); an unknown
field's string with a lone surrogate escape; an unknown field nested deeper than msgspec can
go. :func:`extractor_error` answers None for those, and :func:`accepted_fields` reads them as
serde does. Dynamo refuses, where msgspec accepts: a field given twice, an integer written
``-0``, and invalid UTF-8 in an unknown field's key; :func:`error_for_accepted` finds those
cheaply on the success path.
"""

from __future__ import annotations

import json
import re
from typing import Final

from projector.http.serde_cases import DATA_PREFIX, PARSE_PREFIX, STRUCTS, Refusal
from projector.http.serde_reader import Reader

__all__ = [
    "DATA_PREFIX",
    "PARSE_PREFIX",
    "STRUCTS",
    "accepted_fields",
    "error_for_accepted",
    "extractor_error",
]


def extractor_error(route: str, body: bytes) -> tuple[int, str] | None:
    """The status (400 or 422) and the error text Dynamo's tracker answers ``body`` on
    ``route`` with; None if Dynamo accepts the body (for a body msgspec refused, one of the
    cases the module's docstring lists)."""
    try:
        Reader(body).request(STRUCTS[route])
    except Refusal as refusal:
        return refusal.status, refusal.text(body)
    return None


# An integer written -0, as a value: serde_json reads it as the float -0.0, refused by every
# integer field (msgspec reads 0). A match in a string only costs the full scan.
_NEGATIVE_ZERO: Final = re.compile(rb"[:\[,][ \t\n\r]*-0[ \t\n\r]*[,\]}]")
_QUOTED: Final = {
    route: tuple(f'"{field.name}"'.encode() for field in struct.fields)
    for route, struct in STRUCTS.items()
}


def error_for_accepted(route: str, body: bytes) -> tuple[int, str] | None:
    """For a body msgspec accepted: the error Dynamo answers it with, or None if Dynamo
    accepts it too.

    Each body msgspec accepts and serde refuses has something rare in it: a field's quoted
    name twice, or a backslash (a key may spell a field's name with escapes); a ``-0`` value;
    bytes that are not UTF-8. The scan of :func:`extractor_error` runs only on those, so the
    common body costs a few substring counts, one regex search and, if it is not ASCII, a
    UTF-8 check.
    """
    suspect = (
        b"\\" in body
        or any(body.count(quoted) > 1 for quoted in _QUOTED[route])
        or _NEGATIVE_ZERO.search(body) is not None
        or not _is_utf8(body)
    )
    return extractor_error(route, body) if suspect else None


def accepted_fields(route: str, body: bytes) -> dict[str, object]:
    """The fields Dynamo reads from a body it accepts and msgspec refused (the cases the
    module's docstring lists; :func:`extractor_error` said None), ready for
    ``msgspec.convert``: each known field's value as serde read it (by name, or by position
    from an array), unknown fields skipped unread whatever their depth, and what follows the
    body's first value ignored."""
    reader = Reader(body)
    reader.request(STRUCTS[route])
    return {name: json.loads(raw) for name, raw in reader.fields.items()}


def _is_utf8(body: bytes) -> bool:
    if body.isascii():
        return True
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
