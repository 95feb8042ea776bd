"""RequestIndex: which rank owns each live request id, and its LoRA adapter.

Request ids are unique across every rank of the pool: an add for an id that is live anywhere
is a duplicate. Mark and Free find their request here by id alone.
"""

from __future__ import annotations

from collections import Counter

Rank = tuple[int, int]


class RequestIndex:
    __slots__ = ("by_router", "lora", "owner", "router_of")

    def __init__(self) -> None:
        self.owner: dict[str, Rank] = {}
        self.lora: dict[str, str] = {}
        # Which router added each request (when it said), and each router's live requests:
        # a router that goes silent or says goodbye has its own requests freed.
        self.router_of: dict[str, str] = {}
        self.by_router: dict[str, set[str]] = {}

    def set_router(self, request_id: str, router_id: str) -> None:
        self.router_of[request_id] = router_id
        held = self.by_router.get(router_id)
        if held is None:
            self.by_router[router_id] = {request_id}
        else:
            held.add(request_id)

    def drop_router(self, request_id: str) -> None:
        """The request ended: it no longer counts among its router's."""
        router_id = self.router_of.pop(request_id, None)
        if router_id is not None:
            held = self.by_router[router_id]
            held.discard(request_id)
            if not held:
                del self.by_router[router_id]

    def __len__(self) -> int:
        return len(self.owner)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.owner

    def worker_for(self, request_id: str) -> Rank | None:
        return self.owner.get(request_id)

    def lora_for(self, request_id: str) -> str | None:
        return self.lora.get(request_id)

    def try_insert(self, request_id: str, rank: Rank, lora_name: str | None) -> Rank | None:
        """Insert unless the id is live; returns the existing owner on conflict, else None."""
        existing = self.owner.get(request_id)
        if existing is not None:
            return existing
        self.owner[request_id] = rank
        if lora_name is not None:
            self.lora[request_id] = lora_name
        return None

    def set_request(self, request_id: str, rank: Rank, lora_name: str | None) -> None:
        """Unconditional overwrite; clears a stale LoRA mapping when ``lora_name`` is None."""
        self.owner[request_id] = rank
        if lora_name is None:
            self.lora.pop(request_id, None)
        else:
            self.lora[request_id] = lora_name

    def remove(self, request_id: str) -> Rank | None:
        """Idempotent; returns the previous owner."""
        self.lora.pop(request_id, None)
        if self.router_of:
            self.drop_router(request_id)
        return self.owner.pop(request_id, None)

    def remove_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.remove(request_id)

    def remove_worker_requests(self, rank: Rank) -> list[str]:
        removed = [rid for rid, owner in self.owner.items() if owner == rank]
        self.remove_requests(removed)
        return removed

    def active_lora_counts(self) -> dict[str, int]:
        return dict(Counter(self.lora.values()))
