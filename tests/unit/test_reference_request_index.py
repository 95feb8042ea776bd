"""Reference catalogue 9.4 (Dynamo ``request_maps.rs``), ported onto :class:`RequestIndex`.

All four tests are ported with the catalogue's names and numbers, on the ``RequestIndex``
directly (Dynamo's ``try_insert_request`` is ``try_insert``, which returns the existing owner
instead of ``Err(existing)`` and None on success; ``remove_request`` is ``remove``).

Skipped: nothing. Departures from Dynamo: none.
"""

from __future__ import annotations

import pytest

from seqstate.request_index import RequestIndex

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

WORKER_A = (1, 0)
WORKER_B = (2, 0)


def test_duplicate_insert_returns_existing_worker() -> None:
    index = RequestIndex()
    assert index.try_insert("req-1", (1, 0), "adapter") is None

    assert index.try_insert("req-1", (2, 0), None) == (1, 0)

    assert index.worker_for("req-1") == (1, 0)
    assert index.lora_for("req-1") == "adapter"
    assert len(index) == 1


def test_remove_request_is_idempotent() -> None:
    index = RequestIndex()
    index.set_request("req-1", (1, 0), "adapter")

    assert index.remove("req-1") == (1, 0)
    assert index.remove("req-1") is None

    assert len(index) == 0
    assert index.worker_for("req-1") is None
    assert index.lora_for("req-1") is None
    assert index.active_lora_counts() == {}


def test_set_request_without_lora_clears_stale_lora_mapping() -> None:
    index = RequestIndex()
    index.set_request("req-1", (1, 0), "adapter")

    index.set_request("req-1", (2, 0), None)

    assert index.worker_for("req-1") == (2, 0)
    assert index.lora_for("req-1") is None
    assert index.active_lora_counts() == {}


def test_remove_worker_requests_clears_both_maps() -> None:
    index = RequestIndex()
    index.set_request("req-a", WORKER_A, "adapter-a")
    index.set_request("req-b", WORKER_B, "adapter-b")
    index.set_request("req-c", WORKER_A, None)

    removed = index.remove_worker_requests(WORKER_A)

    assert sorted(removed) == ["req-a", "req-c"]
    assert index.worker_for("req-a") is None
    assert index.worker_for("req-c") is None
    assert index.lora_for("req-a") is None
    assert index.worker_for("req-b") == WORKER_B
    assert index.lora_for("req-b") == "adapter-b"
    assert index.active_lora_counts() == {"adapter-b": 1}
    assert len(index) == 1
