"""ActiveSequences: the authoritative state of one worker rank.

It owns the rank's live requests, their block references and the prefill tracker, and the
rank's expiry throttle. Every mutation takes ``now_ns`` from the caller (the event's log
time), so two folds of one log agree to the byte.
"""

from __future__ import annotations

from seqstate.blocks import BlockTracker
from seqstate.loads import RankLoad
from seqstate.prefill import PrefillTracker

NS_PER_S = 1_000_000_000
EXPIRY_CHECK_INTERVAL_NS = 30 * NS_PER_S


class RequestState:
    """One live request on a rank. ``marked`` remembers that prefill completion was seen."""

    __slots__ = ("added_ns", "expected_output_tokens", "hashes", "marked", "outputs")

    def __init__(
        self,
        hashes: list[int],
        added_ns: int,
        expected_output_tokens: int | None,
        marked: bool,
        outputs: list[float] | None = None,
    ) -> None:
        self.hashes = hashes
        self.added_ns = added_ns
        self.expected_output_tokens = expected_output_tokens
        self.marked = marked
        self.outputs = outputs


class ActiveSequences:
    """Requests, blocks and prefill of one ``(worker_id, dp_rank)``."""

    __slots__ = ("blocks", "expiry_ns", "last_expiry_check_ns", "prefill", "requests")

    def __init__(self, created_ns: int, expiry_ns: int | None) -> None:
        self.requests: dict[str, RequestState] = {}
        self.blocks = BlockTracker()
        self.prefill = PrefillTracker()
        self.expiry_ns = expiry_ns
        self.last_expiry_check_ns = created_ns

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def load(self) -> RankLoad:
        return RankLoad(self.blocks.active_blocks, len(self.requests), self.prefill.snapshot())

    def active_tokens(self, now_ns: int) -> int:
        return self.prefill.snapshot().active_tokens(now_ns)

    def add(
        self,
        request_id: str,
        hashes: list[int],
        prefill_tokens: int,
        prefill_duration_ns: int | None,
        expected_output_tokens: int | None,
        marked: bool,
        now_ns: int,
    ) -> list[int]:
        """Book a request (the caller has ruled out duplicates); returns newly present hashes."""
        held, stored = self.blocks.acquire(hashes)
        if prefill_tokens > 0 and not marked:
            self.prefill.insert(request_id, prefill_tokens, prefill_duration_ns, now_ns)
        self.requests[request_id] = RequestState(held, now_ns, expected_output_tokens, marked)
        return stored

    def mark_prefill_completed(self, request_id: str, now_ns: int) -> bool:
        """Returns False if this request's completion had already been seen."""
        state = self.requests[request_id]
        if state.marked:
            return False
        state.marked = True
        self.prefill.remove(request_id, now_ns)
        return True

    def free(self, request_id: str, now_ns: int) -> list[int]:
        """Remove a live request; returns the prompt hashes that became absent."""
        state = self.requests.pop(request_id)
        if not state.marked:
            self.prefill.remove(request_id, now_ns)
        return self.blocks.release(state.hashes, state.outputs)

    def add_output_block(self, request_id: str, decay_fraction: float | None) -> None:
        state = self.requests[request_id]
        if state.outputs is None:
            state.outputs = []
        self.blocks.add_output(state.outputs)
        if decay_fraction is not None:
            self.blocks.set_exclusive_fraction(state.hashes, state.outputs, decay_fraction)

    def expire(self, now_ns: int) -> tuple[list[str], list[int]]:
        """Dynamo's throttled stale-request sweep, on log time.

        Runs only if at least 30 s passed since this rank's last check; frees every request
        added strictly more than the expiry duration before ``now_ns``. Returns the expired
        ids and the hashes that became absent.
        """
        expiry_ns = self.expiry_ns
        if expiry_ns is None or now_ns - self.last_expiry_check_ns < EXPIRY_CHECK_INTERVAL_NS:
            return [], []
        self.last_expiry_check_ns = now_ns
        cutoff = now_ns - expiry_ns
        expired: list[str] = []
        removed: list[int] = []
        # Requests are in add order and add times never decrease: stop at the first young one.
        for request_id, state in self.requests.items():
            if state.added_ns >= cutoff:
                break
            expired.append(request_id)
        for request_id in expired:
            removed.extend(self.free(request_id, now_ns))
        return expired, removed

    def check_invariants(self) -> None:
        """Prefill ids within request ids; block counts match the live requests."""
        self.prefill.check_invariants()
        for request_id in self.prefill.prefills:
            assert request_id in self.requests, f"prefill {request_id!r} has no request"
            assert not self.requests[request_id].marked
        states = list(self.requests.values())
        self.blocks.check_invariants(
            [s.hashes for s in states], [s.outputs for s in states if s.outputs]
        )
