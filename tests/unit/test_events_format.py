"""docs/events-format.md's byte-by-byte event is what seqstate writes and reads: a publisher
written from the page (examples/js/publish.mjs) sends what the writer applies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from seqstate import AddRequest, decode_event, encode_event

pytestmark = pytest.mark.core

DOC = Path(__file__).resolve().parents[2] / "docs" / "events-format.md"


def documented() -> bytes:
    block = re.search(r"### Byte by byte.*?```text\n(.*?)```", DOC.read_text(), re.S)
    assert block, "the page's byte-by-byte event"
    hexes = [
        re.match(r"((?:[0-9a-f]{2} )*[0-9a-f]{2})", line) for line in block.group(1).splitlines()
    ]
    return bytes.fromhex(" ".join(m.group(1) for m in hexes if m))


def test_the_pages_event_is_what_encode_event_writes() -> None:
    event = AddRequest(
        request_id="r1",
        worker_id=2**64 - 59,
        block_hashes=[11, 2**64 - 1],
        prefill_tokens=32,
        expected_prefill_ms=12.5,
        router_id="js",
    )
    assert documented() == encode_event(event)
    assert len(documented()) == 134
    assert decode_event(documented()) == event
