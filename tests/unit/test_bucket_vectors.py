"""docs/bucket-format.md's test vectors are what seqstate computes: each stored load value,
folded by the reader ``seqstate loads`` uses and evaluated at the vector's ``now``, prints the
vector's row byte for byte. A reader in another language is written and checked against those
vectors (examples/js/vectors.mjs), so the page cannot drift from the code without this failing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from projector.bucket.reader import RegistryView

pytestmark = pytest.mark.core

DOC = Path(__file__).resolve().parents[2] / "docs" / "bucket-format.md"
NS = "vec"


def vectors() -> list[tuple[bytes, int, bytes]]:
    """(value, now, row) for each row of the page's "Test vectors" block."""
    block = re.search(r"### Test vectors.*?```text\n(.*?)```", DOC.read_text(), re.S)
    out: list[tuple[bytes, int, bytes]] = []
    if block is None:
        return out  # the count test fails, naming the block; collection goes on
    value = b""
    now = 0
    for line in block.group(1).splitlines():
        label, _, text = line.partition(":")
        if label == "value":
            value = text.strip().encode()
        elif label == "now":
            now = int(text)
        elif label == "row":
            out.append((value, now, text.strip().encode()))
    return out


def test_the_page_has_vectors_past_two_to_the_53() -> None:
    found = vectors()
    assert len(found) == 11, 'the page\'s "Test vectors" block, 11 rows'
    # Worker ids and log times a double cannot hold: the reason the page says how to keep them.
    assert any(json.loads(v)["worker_id"] > 2**53 for v, _, _ in found)
    assert all(json.loads(v)["as_of"] > 2**53 for v, _, _ in found)


@pytest.mark.parametrize(("value", "now", "row"), vectors())
def test_a_vector_is_what_seqstate_loads_prints(value: bytes, now: int, row: bytes) -> None:
    load = json.loads(value)
    view = RegistryView(None, namespace=NS)  # type: ignore[arg-type]
    view.receive(f"{NS}.load.{load['worker_id']}.{load['dp_rank']}", value)
    assert view.unreadable == {}
    rows = view.loads(now)
    assert [msgspec.json.encode(r) for r in rows] == [row]
