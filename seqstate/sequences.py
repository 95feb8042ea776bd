"""ActiveSequences: the authoritative state of one worker rank.

It owns the rank's live requests, their block references and the prefill tracker, and the
rank's expiry throttle. Every mutation takes ``now_ns`` from the caller (the event's log
time), so two folds of one log agree to the byte.
"""

from __future__ import annotations

import heapq

from seqstate.blocks import BlockTracker
from seqstate.loads import RankLoad
from seqstate.prefill import PrefillTracker

NS_PER_S = 1_000_000_000
EXPIRY_CHECK_INTERVAL_NS = 30 * NS_PER_S


class RequestState:
    """One live request on a rank. ``marked`` remembers that prefill completion was seen;
    ``slot`` is the rank's slot it holds (see :class:`ActiveSequences`)."""

    __slots__ = ("added_ns", "expected_output_tokens", "hashes", "marked", "outputs", "slot")

    def __init__(
        self,
        hashes: list[int],
        added_ns: int,
        expected_output_tokens: int | None,
        marked: bool,
        outputs: list[float] | None = None,
        slot: int = 0,
    ) -> None:
        self.slot = slot
        self.hashes = hashes
        self.added_ns = added_ns
        self.expected_output_tokens = expected_output_tokens
        self.marked = marked
        self.outputs = outputs


class ActiveSequences:
    """Requests, blocks and prefill of one ``(worker_id, dp_rank)``.

    Each live request holds a slot: the lowest number no other live request of the rank
    holds. The read model names a request by its slot, so a Free or an expiry costs the
    reader one small integer, and the bucket's per-request keys are reused instead of piling
    up. Lowest-free allocation depends only on which slots are held, so a restored rank
    (which knows its live requests' slots) allocates exactly as the original would.
    """

    __slots__ = (
        "blocks",
        "expiry_ns",
        "free_slots",
        "last_expiry_check_ns",
        "next_slot",
        "prefill",
        "requests",
    )

    def __init__(self, created_ns: int, expiry_ns: int | None) -> None:
        self.free_slots: list[int] = []  # a heap of the slots below next_slot no request holds
        self.next_slot = 0
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
    ) -> RequestState:
        """Book a request (the caller has ruled out duplicates); returns its state."""
        held, _ = self.blocks.acquire(hashes)
        if prefill_tokens > 0 and not marked:
            self.prefill.insert(request_id, prefill_tokens, prefill_duration_ns, now_ns)
        if self.free_slots:
            slot = heapq.heappop(self.free_slots)
        else:
            slot = self.next_slot
            self.next_slot = slot + 1
        state = RequestState(held, now_ns, expected_output_tokens, marked, None, slot)
        self.requests[request_id] = state
        return state

    def restore_slots(self) -> None:
        """Derive the free slots from the live requests' slots (after a restore)."""
        held = {state.slot for state in self.requests.values()}
        self.next_slot = max(held) + 1 if held else 0
        self.free_slots = [slot for slot in range(self.next_slot) if slot not in held]

    def mark_prefill_completed(self, request_id: str, now_ns: int) -> bool:
        """Returns False if this request's completion had already been seen."""
        state = self.requests[request_id]
        if state.marked:
            return False
        state.marked = True
        self.prefill.remove(request_id, now_ns)
        return True

    def free(self, request_id: str, now_ns: int) -> int:
        """Remove a live request; returns the slot it held."""
        state = self.requests.pop(request_id)
        if not state.marked:
            self.prefill.remove(request_id, now_ns)
        self.blocks.release(state.hashes, state.outputs)
        heapq.heappush(self.free_slots, state.slot)
        return state.slot

    def add_output_block(self, request_id: str, decay_fraction: float | None) -> None:
        state = self.requests[request_id]
        if state.outputs is None:
            state.outputs = []
        self.blocks.add_output(state.outputs)
        if decay_fraction is not None:
            self.blocks.set_exclusive_fraction(state.hashes, state.outputs, decay_fraction)

    def expire(
        self,
        now_ns: int,
        router_of: dict[str, str] | None = None,
        live_routers: dict[str, int] | None = None,
    ) -> tuple[list[str], list[int]]:
        """Dynamo's throttled stale-request sweep, on log time.

        Runs only if at least 30 s passed since this rank's last check; frees every request
        added strictly more than the expiry duration before ``now_ns``, except those of a live
        router (in ``live_routers``, found through ``router_of``): a router that heartbeats
        vouches for its long requests. Returns the expired ids and the slots they held.
        """
        expiry_ns = self.expiry_ns
        if expiry_ns is None or now_ns - self.last_expiry_check_ns < EXPIRY_CHECK_INTERVAL_NS:
            return [], []
        self.last_expiry_check_ns = now_ns
        cutoff = now_ns - expiry_ns
        expired: list[str] = []
        released: list[int] = []
        # Requests are in add order and add times never decrease: stop at the first young one.
        vouched = live_routers if live_routers and router_of else None
        for request_id, state in self.requests.items():
            if state.added_ns >= cutoff:
                break
            if vouched is not None and router_of is not None:
                router_id = router_of.get(request_id)
                if router_id is not None and router_id in vouched:
                    continue
            expired.append(request_id)
        for request_id in expired:
            released.append(self.free(request_id, now_ns))
        return expired, released

    def check_invariants(self) -> None:
        """Prefill ids within request ids; block counts match the live requests."""
        self.prefill.check_invariants()
        for request_id in self.prefill.prefills:
            assert request_id in self.requests, f"prefill {request_id!r} has no request"
            assert not self.requests[request_id].marked
        states = list(self.requests.values())
        held = [s.slot for s in states]
        assert len(set(held)) == len(held), "two requests hold one slot"
        assert sorted(self.free_slots) == [
            slot for slot in range(self.next_slot) if slot not in set(held)
        ], "free slots disagree with the held ones"
        self.blocks.check_invariants(
            [s.hashes for s in states], [s.outputs for s in states if s.outputs]
        )
