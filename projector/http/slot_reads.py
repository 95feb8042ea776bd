"""The slot tracker's reads: ``/loads``, ``/workers`` and ``/potential_loads``.

A read answers from the lease holder's own fold where this process holds every lease it
reads (at once, no task: :meth:`SlotReads.here`), else from a
:class:`~projector.bucket.reader.RegistryView` per namespace, once it reflects every call this
process has answered (read-your-writes, paid by the read that needs it, not by every write:
:meth:`SlotReads.read`). Both build the same rows from a registry's loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from nats.js.client import JetStreamContext

from projector.http.http_server import Encoded
from projector.http.shared_lookup import SharedLookup
from projector.http.slot_api import PotentialLoadsBody, as_u64
from projector.http.slot_routes import Rejected
from projector.http.slot_trackers import Tracker, Trackers, listed
from projector.nats.stream import last_seq_of
from projector.route.outcomes import Outcomes
from projector.settings.config import Config
from projector.write.writer import Writer
from seqstate import LoadRow, PotentialLoadRow

READ_CACHE = 64  # read bodies kept (distinct path and query pairs)


class LoadOut(msgspec.Struct):
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


class WorkerOut(msgspec.Struct):
    worker_id: int
    model_name: str
    routing_group: str
    block_size: int
    dp_start: int
    dp_size: int


def _load_rows(t: Tracker, rows: list[LoadRow]) -> list[LoadOut]:
    """``/loads``' rows of one tracker (the registry's, sorted by worker and rank)."""
    return [
        LoadOut(
            t.model_name,
            t.routing_group,
            row.worker_id,
            row.dp_rank,
            row.active_prefill_tokens,
            row.active_blocks,
        )
        for row in rows
    ]


def _worker_rows(t: Tracker, rows: list[LoadRow], block_size: int) -> list[WorkerOut]:
    """``/workers``' rows of one tracker: a worker's ranks as one range."""
    ranks: dict[int, list[int]] = {}
    for row in rows:
        ranks.setdefault(row.worker_id, []).append(row.dp_rank)
    return [
        WorkerOut(worker_id, t.model_name, t.routing_group, block_size, min(dp), len(dp))
        for worker_id, dp in sorted(ranks.items())
    ]


def _rows(path: str, loads: list[tuple[Tracker, list[LoadRow], int | None]]) -> list[Any]:
    """A GET's body: each tracker's rows (its loads and block size, from a fold or a view)."""
    out: list[Any] = []
    for t, rows, block_size in loads:
        if path == "/loads":
            out.extend(_load_rows(t, rows))
        else:
            out.extend(_worker_rows(t, rows, block_size or 0))
    return out


def _by_name(trackers: list[Tracker]) -> list[Tracker]:
    return sorted(trackers, key=lambda t: (t.model_name, t.routing_group))


class _PotentialSource(Protocol):
    """A fold's registry, or a view of one."""

    def potential_loads(
        self, block_hashes: Sequence[int], isl_tokens: int, now_ns: int
    ) -> list[PotentialLoadRow]: ...


def _potential_answer(
    body: PotentialLoadsBody, source: _PotentialSource | None, now_ns: int
) -> tuple[int, object]:
    """``/potential_loads`` at ``now_ns`` from ``source``; 404 while the tracker has no rank
    (``source`` None)."""
    if source is None:
        return 404, {"error": f"no slot tracker for {body.where()}"}
    hashes = [as_u64(h) for h in body.sequence_hashes]
    return 200, source.potential_loads(hashes, body.new_isl_tokens, now_ns)


class SlotReads:
    """The reads of the trackers ``trackers`` serves."""

    def __init__(self, trackers: Trackers, js: JetStreamContext, *, outcome_wait_s: float):
        self.trackers = trackers
        self.outcome_wait_s = outcome_wait_s
        self._js = js
        # (path, query) -> (the positions of the folds read, the body): see here()
        self._cache: dict[tuple[object, ...], tuple[tuple[tuple[int, int], ...], Encoded]] = {}
        trackers.on_stop.append(self._cache.clear)

    # ---- from this process's own folds, at once -----------------------------------------

    def here(self, path: str, query: dict[str, str]) -> Encoded | None:
        """A GET's body from the writers' folds, if this process folds every tracker it
        names (None: :meth:`read` answers it); encoded once per position of the folds it
        reads (a scheduler polling ``/loads`` between two events reads the same bytes)."""
        found = self._folds(query.get("model_name"), query.get("routing_group"))
        if found is None:
            return None
        if len(found) > 1:
            found.sort(key=lambda f: (f[0].model_name, f[0].routing_group))
        key = (path, tuple(sorted(query.items())) if len(query) > 1 else tuple(query.items()))
        position = tuple([(id(w.state), w.stats.last_seq) for _, w in found])
        cached = self._cache.get(key)
        if cached is not None and cached[0] == position:
            return cached[1]
        loads = [(t, w.state.registry.loads(w.state.now_ns), w.state.block_size) for t, w in found]
        body = Encoded(msgspec.json.encode(_rows(path, loads)))
        if len(self._cache) >= READ_CACHE:
            self._cache.clear()
        self._cache[key] = (position, body)
        return body

    def potential_here(self, body: PotentialLoadsBody) -> tuple[int, object] | None:
        """``/potential_loads`` from this process's fold of its tracker, if it folds it."""
        found = self._folds(body.model_name, body.routing_group)
        if not found:
            return None
        state = found[0][1].state
        registry = state.registry if len(state.registry) else None
        return _potential_answer(body, registry, state.now_ns)

    def _folds(self, model: str | None, group: str | None) -> list[tuple[Tracker, Writer]] | None:
        """The trackers a read names, each with its writer, if this process folds every one
        of them and each fold holds every call this process answered; else None."""
        trackers = self.trackers
        if trackers.unknown(model, group) or (
            trackers.left_out and trackers.left_out_of(model, group)
        ):
            return None
        found = []
        for t in trackers.named(model, group):
            own = trackers.own_fold(t)
            if own is None or own.writer.stats.last_seq < t.answered:
                return None
            found.append((t, own.writer))
        return found

    # ---- from the views, caught up ------------------------------------------------------

    async def read(self, path: str, query: dict[str, str]) -> list[Any]:
        """The body of a GET from the trackers' views."""
        found = await self._matching(query)
        return _rows(path, [(t, t.view.loads(), t.view.block_size) for t in found])

    async def potential(self, namespace: str, body: PotentialLoadsBody) -> tuple[int, object]:
        """``/potential_loads`` from the tracker's view."""
        trackers = self.trackers
        tracker = await trackers.existing(namespace)
        if tracker is None:
            return _potential_answer(body, None, 0)
        trackers.hold(tracker)
        try:
            await self._caught_up(tracker)
            view = tracker.view
            return _potential_answer(body, view if view.loads() else None, view.log_now_ns())
        finally:
            trackers.done_with(tracker)

    async def _matching(self, query: dict[str, str]) -> list[Tracker]:
        """The trackers a read names, caught up; a :class:`Rejected` (503) if this process
        leaves out one of them for want of room (an answer without it would be wrong)."""
        trackers = self.trackers
        model, group = query.get("model_name"), query.get("routing_group")
        named = trackers.unknown(model, group)
        if named is not None:
            await trackers.existing(named)
        left_out = trackers.left_out_of(model, group)
        if left_out:
            raise Rejected(
                503,
                f"this process serves its bound of {trackers.config.max_trackers} slot trackers "
                f"(--max-trackers) and leaves out {len(left_out)} that this read names "
                f"({listed(left_out)}); name one it serves, or call a serve-http with a "
                "higher bound",
            )
        found = _by_name(trackers.named(model, group))
        for tracker in found:
            trackers.hold(tracker)
        try:
            for tracker in found:
                await self._caught_up(tracker)
        finally:
            for tracker in found:
                trackers.done_with(tracker)
        return found

    async def _caught_up(self, tracker: Tracker) -> None:
        """Until the tracker's view reflects every call answered before this read began, by
        this process or any other (read-your-writes across replicas)."""
        await tracker.view.wait_for(await self._read_position(tracker), self.outcome_wait_s)

    async def _read_position(self, tracker: Tracker) -> int:
        """The event a read must reflect: the last one folded where the namespace is folded
        when the read began, as far as deltas name it (a refused event has none).

        Any call answered anywhere was folded by the lease holder first (its own fold answers
        it, or its outcome does). The holder's writer has folded it then; elsewhere the
        namespace's newest stored event is asked for, and its outcome waited for, which comes
        only after every event before it was folded: one lookup for every read that waits
        together (:mod:`.shared_lookup`), none per read.
        """
        config = tracker.config
        target = tracker.answered
        pipeline = tracker.standby.pipeline
        if pipeline is not None and tracker.standby.active.is_set():
            return max(target, pipeline.writer.deltas.appended)
        if tracker.newest is None:
            tracker.newest = SharedLookup(lambda: self._newest_folded(config, tracker.outcomes))
        await tracker.newest.wait()
        return max(target, tracker.outcomes.named)

    async def _newest_folded(self, config: Config, outcomes: Outcomes) -> None:
        """Until the namespace's newest stored event, asked now, is folded (its outcome seen)."""
        stored = await last_seq_of(self._js, config.events_stream, config.events_subjects)
        await outcomes.folded(stored, self.outcome_wait_s)
