"""The error texts of Dynamo's slot tracker for bodies its extractor refuses, byte for byte.

Every case (refused_bodies) was sent to the 1.6.1 wheel (``python -m dynamo.slot_tracker``),
and its status and text are the wheel's answer, copied verbatim. Beyond these, the module was
compared with the wheel on about 140 000 generated bodies (random objects, arrays, numbers,
strings and byte-level mutations of them) with no difference, and ``rust_debug`` on every
code point. The table of Rust structs whose fields the texts name matches slot_api's.
"""

from __future__ import annotations

import msgspec
import pytest
from refused_bodies import CASES, PREFIX, _ids

from projector.http.serde_errors import STRUCTS, extractor_error
from projector.http.slot_routes import DECODERS


@pytest.mark.parametrize(("what", "route", "body", "status", "text"), CASES, ids=_ids(CASES))
def test_dynamo_text(what: str, route: str, body: bytes, status: int, text: str) -> None:
    assert extractor_error(route, body) == (status, PREFIX[status] + text)


@pytest.mark.parametrize("route", sorted(STRUCTS))
def test_fields_are_slot_apis(route: str) -> None:
    """The Rust structs' table names the fields slot_api's Structs decode, with the same ones
    optional."""
    info = msgspec.inspect.type_info(DECODERS[route].type)
    assert isinstance(info, msgspec.inspect.StructType)
    ours = {field.name: field.required for field in info.fields}
    assert ours == {field.name: field.required for field in STRUCTS[route].fields}
