"""Scheduler: choose a rank by Dynamo's cost, book it, and see your own bookings at once.

``async with Scheduler(nc, namespace="prod", router_id="sched-a") as sched:`` holds a
:class:`~projector.RegistryView` (what every router has booked, 14-27 ms behind the log) and a
:class:`~projector.RouterPublisher` (its own events, with the publisher's guarantees: stored
once, or :class:`~projector.PublishError`), and between them an overlay
(:mod:`projector.schedule.overlay`) of the events the view does not show yet.

- :meth:`Scheduler.choose` is synchronous and local: Dynamo's cost
  (:func:`seqstate.cost.dynamo_cost`) over the view plus the overlay, then Dynamo's selection
  (:func:`seqstate.cost.select`: the cheapest, ties broken at random; or a softmax with a
  temperature). A burst decided in one go spreads as Dynamo's router spreads it; replicas
  that hear each other prefer shares of the ranks (:meth:`Scheduler.share`).
- :meth:`Scheduler.add` counts the booking before it is even sent, so the next ``choose`` sees
  it; :meth:`mark_prefill_completed` and :meth:`free` name the request alone, as a router does.
- Peers: by default the scheduler also follows the namespace's worker events as the log stores
  them (an ordered consumer from the view's position on), so two replicas see each other's
  bookings about a millisecond after they are stored, not when the view shows them. Each is
  dropped when the view passes its sequence, like one's own. A client not allowed to read the
  events stream goes on without (a warning says so), seeing peers through the view alone.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from projector.aio.lifetime import Started
from projector.bucket.reader import RegistryView, Staleness
from projector.nats.stream import drop_subscription, log_time_ns
from projector.route.publisher import RouterPublisher
from projector.schedule.overlay import Overlay, Pending, RankDelta
from projector.settings.config import Config
from seqstate import AddRequest, EventDecodeError, Free, MarkPrefillCompleted, decode_event
from seqstate.batches import decode_batch, is_batch
from seqstate.cost import CostRow, CostWeights, dynamo_cost, select
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.scheduler")

Rank = tuple[int, int]
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: Dynamo's default
PEERS_REMEMBERED = 65_536
# Peers are the routers whose worker events a scheduler followed in the last PEER_WINDOW_S.
PEER_WINDOW_S = 10.0


class NoCandidates(SeqstateError, LookupError):
    """``choose`` had no rank to choose from: no worker known to the view, and none given."""


class UnknownRequest(SeqstateError, KeyError):
    """A Mark or Free for a request this scheduler did not book and its view does not show."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateRequest(SeqstateError, ValueError):
    """An add for a request id this scheduler holds already (the writer would refuse it)."""


@dataclass(slots=True)
class _Booked:
    rank: Rank
    hashes: Sequence[int]
    prefill: int  # tokens still prefilling, as this scheduler counts them (0 once marked)


class Scheduler(Started):
    """A KV-aware scheduler's state: the view, its own events, its peers'; see the module."""

    def __init__(
        self,
        nc: Client,
        *,
        router_id: str,
        namespace: str | None = None,
        config: Config | None = None,
        block_size: int | None = None,
        weights: CostWeights | None = None,
        temperature: float = 0.0,
        spread: bool = True,
        peers: bool = True,
        seed: int | None = None,
        initial_timeout: float = 30.0,
        **publisher_options: Any,
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be positive")
        if not temperature >= 0.0 or temperature == float("inf"):
            raise ValueError(f"temperature={temperature}: must be finite and not negative")
        config = (config or Config()).with_namespace(namespace)
        self.config = config
        self.namespace = config.namespace
        self.router_id = router_id
        self.view = RegistryView(nc, config=config, initial_timeout=initial_timeout)
        self.publisher = RouterPublisher(
            nc, router_id=router_id, config=config, **publisher_options
        )
        self.block_size = block_size  # None: the namespace's (``view.block_size``), else 16
        self._guessed = False  # the fallback to 16 was said
        self.weights = weights or CostWeights()
        self.temperature = temperature
        self.spread = spread  # replicas prefer shares of the ranks (see ``share``)
        self._peers_heard: dict[str, float] = {}  # router id -> monotonic time last heard
        self._share: tuple[int, int] | None = None
        self._share_until = 0.0
        self.peers = peers
        self.following = False  # the peers' events are followed (see ``peers``)
        self.peer_events = 0  # peers' events counted in the overlay
        self._nc = nc
        self._rng = random.Random(seed)
        self._overlay = Overlay(self.view.registry)
        self._booked: dict[str, _Booked] = {}
        self._peer_booked: OrderedDict[str, _Booked] = OrderedDict()
        self._feed: JetStreamContext.PushSubscription | None = None
        self._unlisten: Callable[[], None] | None = None
        self._js: JetStreamContext | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> Scheduler:
        """The view's current values, the router's first heartbeat, then the peers' events."""
        # Events the view shows leave the overlay as the view moves, not in ``choose``: a
        # burst after a quiet spell would otherwise pay for hundreds of them in one decision.
        self._unlisten = self.view.on_change(lambda view: self._overlay.prune(view.applied_seq))
        await self.view.start()
        try:
            await self.publisher.start()
            if self.peers:
                await self._follow()
        except BaseException:
            await self.view.stop()
            self._unlisten()
            raise
        return self

    async def stop(self, *, goodbye: bool = True) -> None:
        """Stop following; with ``goodbye`` (as :meth:`RouterPublisher.close`) the writer frees
        at once every request this scheduler's router id still holds."""
        feed, self._feed = self._feed, None
        if feed is not None and self._js is not None:
            await drop_subscription(self._js, feed)
        self.following = False
        try:
            await self.publisher.close(goodbye=goodbye)
        finally:
            await self.view.stop()
            if self._unlisten is not None:
                self._unlisten()
                self._unlisten = None

    # ---- choosing ---------------------------------------------------------------------------

    def choose(
        self,
        block_hashes: Sequence[int],
        isl_tokens: int,
        candidates: Iterable[Rank] | None = None,
        *,
        overlaps: Mapping[Rank, int] | None = None,
        now_ns: int | None = None,
    ) -> Rank:
        """The rank to send this request to: ``(worker_id, dp_rank)``.

        ``block_hashes``: the prompt's block hashes; ``isl_tokens``: the whole prompt's tokens
        (Dynamo's ISL: the credit for cached blocks is taken off by the cost). ``candidates``:
        the ranks allowed (None: every rank the view knows; a rank it does not know yet counts
        as idle). ``overlaps``: cached blocks per rank from your own KV indexer, else the
        prompt's prefix active on each rank is the credit. Raises :class:`NoCandidates`.
        """
        query = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        rows, block_size = self._view_rows(query, isl_tokens, candidates, overlaps, now_ns)
        if not rows:
            raise NoCandidates(
                f"namespace {self.namespace!r}: no rank to choose from (no worker in the "
                "registry, and no candidates given)"
            )
        if len(rows) == 1:
            row = rows[0]
        else:
            pending = self._overlay.ranks
            if pending:  # only the cost: a decision builds no rows
                costs = []
                for r in rows:
                    delta = pending.get((r.worker_id, r.dp_rank))
                    if delta is None:
                        costs.append(r.cost)
                    else:
                        costs.append(
                            self._adjust(r, delta, query, isl_tokens, overlaps, block_size)[0]
                        )
            else:
                costs = [r.cost for r in rows]
            share = self.share() if self.spread else None
            if share is not None:
                count, mine = share
                # Another replica's share: dearer by what this request adds to an idle rank, so
                # it is taken only when this one's own ranks are busier by more than a booking.
                n = len(query)
                extra = dynamo_cost(self.weights, block_size, isl_tokens, 0, 0, n, 0)[0]
                costs = [c if j % count == mine else c + extra for j, c in enumerate(costs)]
            row = rows[select(costs, self.temperature, self._rng.random())]
        return row.worker_id, row.dp_rank

    def share(self) -> tuple[int, int] | None:
        """``(replicas, this one's place)``: this scheduler and the peers it heard within
        ``PEER_WINDOW_S``, their router ids sorted; None alone.

        Replicas deciding at the same instant cannot see each other's choices: on one view,
        each would send its part of a burst to the same cheapest ranks. So each prefers a
        share of the ranks (every ``replicas``-th in the rows' order, from its place), and
        takes another's only when its own are busier by more than what the request adds to
        an idle rank: the shares interleave as one scheduler's choices would, and a replica
        whose share fills up still spills over (BENCHMARKS.md, "Routing")."""
        now = time.monotonic()
        if now < self._share_until:
            return self._share  # looked up at most once a second, and when a peer appears
        peers = self._peers_heard
        for router in [r for r, at in peers.items() if now - at >= PEER_WINDOW_S]:
            del peers[router]
        names = sorted({*peers, self.router_id})
        self._share = (len(names), names.index(self.router_id)) if peers else None
        self._share_until = now + 1.0
        return self._share

    def costs(
        self,
        block_hashes: Sequence[int],
        isl_tokens: int,
        candidates: Iterable[Rank] | None = None,
        *,
        overlaps: Mapping[Rank, int] | None = None,
        now_ns: int | None = None,
    ) -> list[CostRow]:
        """Each candidate rank's cost row (see :class:`seqstate.cost.CostRow`), this
        scheduler's own events and its peers' counted; what :meth:`choose` chooses from."""
        query = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        rows, block_size = self._view_rows(query, isl_tokens, candidates, overlaps, now_ns)
        pending = self._overlay.ranks
        if not pending:
            return rows
        out = []
        for row in rows:
            delta = pending.get((row.worker_id, row.dp_rank))
            if delta is None:
                out.append(row)
            else:
                adjusted = self._adjust(row, delta, query, isl_tokens, overlaps, block_size)
                out.append(CostRow(row.worker_id, row.dp_rank, *adjusted))
        return out

    def _view_rows(
        self,
        query: list[int],
        isl_tokens: int,
        candidates: Iterable[Rank] | None,
        overlaps: Mapping[Rank, int] | None,
        now_ns: int | None,
    ) -> tuple[list[CostRow], int]:
        """The view's rows (and idle ones for candidates it does not know), and the block
        size they were costed with."""
        view = self.view
        self._overlay.prune(view.applied_seq)
        wanted = None if candidates is None else list(dict.fromkeys(candidates))
        block_size = self._block_size()
        rows = view.costs(
            query,
            isl_tokens,
            wanted,
            block_size=block_size,
            weights=self.weights,
            overlaps=overlaps,
            now_ns=now_ns,
        )
        if wanted is not None and len(rows) < len(wanted):
            rows = self._with_idle(rows, wanted, query, isl_tokens, overlaps, block_size)
        return rows, block_size

    def _adjust(
        self,
        row: CostRow,
        delta: RankDelta,
        query: list[int],
        isl_tokens: int,
        overlaps: Mapping[Rank, int] | None,
        block_size: int,
    ) -> tuple[float, int, int, float, int, int, int]:
        """``row`` with the rank's pending events counted: the fields of a CostRow after its
        rank (cost, overlap, active overlap, prefill blocks, prefill tokens, decode blocks,
        requests)."""
        seen = row.active_overlap_blocks
        depth = self._overlay.depth((row.worker_id, row.dp_rank), query, seen)
        decode = row.potential_decode_blocks + delta.blocks + seen - depth
        prefill = row.potential_prefill_tokens - isl_tokens + delta.prefill
        requests = row.active_requests + delta.requests
        decode = decode if decode > 0 else 0
        prefill = prefill if prefill > 0 else 0
        requests = requests if requests > 0 else 0
        credited = depth if overlaps is None else row.overlap_blocks
        cost, prefill_blocks = dynamo_cost(
            self.weights, block_size, isl_tokens, prefill, credited, decode, requests
        )
        return cost, credited, depth, prefill_blocks, prefill + isl_tokens, decode, requests

    def _with_idle(
        self,
        rows: list[CostRow],
        wanted: list[Rank],
        query: list[int],
        isl_tokens: int,
        overlaps: Mapping[Rank, int] | None,
        block_size: int,
    ) -> list[CostRow]:
        """Rows for the candidates the view does not know yet (a worker with nothing booked,
        or not in the bucket yet): idle, as Dynamo counts a worker it has not seen busy. A rank
        whose value does not decode stays out (``view.unreadable``)."""
        have = {(r.worker_id, r.dp_rank) for r in rows}
        unreadable = self.view.unreadable
        for rank in wanted:
            if rank in have or rank in unreadable:
                continue
            credited = 0 if overlaps is None else overlaps.get(rank, 0)
            cost, prefill_blocks = dynamo_cost(
                self.weights, block_size, isl_tokens, 0, credited, len(query), 0
            )
            rows.append(
                CostRow(
                    rank[0], rank[1], cost, credited, 0, prefill_blocks, isl_tokens, len(query), 0
                )
            )
        rows.sort(key=lambda r: (r.worker_id, r.dp_rank))
        return rows

    def _block_size(self) -> int:
        """The one given, else the namespace's (a registration's), else Dynamo's default."""
        size = self.block_size or self.view.block_size
        if size is None:
            if not self._guessed:
                self._guessed = True
                log.warning(
                    "scheduler %s: namespace %r has no registered block size; costs use "
                    "Dynamo's default, %d tokens (pass block_size=, or register workers with "
                    "one: seqstate worker add --block-size)",
                    self.router_id,
                    self.namespace,
                    DEFAULT_BLOCK_SIZE,
                )
            return DEFAULT_BLOCK_SIZE
        return size

    # ---- booking ----------------------------------------------------------------------------

    async def add(
        self,
        request_id: str,
        *,
        worker_id: int,
        dp_rank: int = 0,
        block_hashes: Iterable[int] = (),
        prefill_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        expected_output_tokens: int | None = None,
        track_prefill_tokens: bool = True,
        lora_name: str | None = None,
    ) -> int:
        """Book ``request_id`` on ``(worker_id, dp_rank)``; returns its stream sequence.

        Counted by :meth:`choose` from the moment of the call, before the ack. A request
        that fails to publish (:class:`PublishError`, or a bad field raising before anything
        is sent) is not counted. ``prefill_tokens``: the tokens this rank must prefill, the
        prompt minus what it has cached (Dynamo's ``initial_effective_prefill_tokens``).
        """
        if request_id in self._booked:
            raise DuplicateRequest(
                f"request {request_id!r} is booked by this scheduler already (free it first)"
            )
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        rank = (worker_id, dp_rank)
        tokens = prefill_tokens if track_prefill_tokens and prefill_tokens > 0 else 0
        entry = self._overlay.add(rank, hashes, tokens)
        self._booked[request_id] = _Booked(rank, hashes, tokens)
        event = AddRequest(
            request_id=request_id,
            worker_id=worker_id,
            dp_rank=dp_rank,
            block_hashes=hashes,
            prefill_tokens=prefill_tokens,
            expected_prefill_ms=expected_prefill_ms,
            expected_output_tokens=expected_output_tokens,
            track_prefill_tokens=track_prefill_tokens,
            router_id=self.router_id,
            lora_name=lora_name,
        )
        return await self._send(entry, event, undo=lambda: self._booked.pop(request_id, None))

    async def mark_prefill_completed(self, request_id: str) -> int:
        """The request's prefill is done: its tokens leave its rank's prefill load at once."""
        booked = self._booked.get(request_id)
        if booked is None:
            rank = self._rank_in_view(request_id)
            entry = self._overlay.mark(rank, 0)  # its tokens are the view's to take back
            undo = None
        else:
            rank, tokens = booked.rank, booked.prefill
            entry = self._overlay.mark(rank, tokens)
            booked.prefill = 0

            def undo() -> None:
                booked.prefill = tokens

        event = MarkPrefillCompleted(
            request_id=request_id, worker_id=rank[0], dp_rank=rank[1], router_id=self.router_id
        )
        return await self._send(entry, event, undo=undo)

    async def free(self, request_id: str) -> int:
        """The request ended: its rank's load goes down at once."""
        booked = self._booked.pop(request_id, None)
        if booked is None:
            rank = self._rank_in_view(request_id)
            entry = self._overlay.free(rank, (), 0)
            undo = None
        else:
            rank = booked.rank
            entry = self._overlay.free(rank, booked.hashes, booked.prefill)

            def undo() -> None:
                self._booked.setdefault(request_id, booked)

        event = Free(
            request_id=request_id, worker_id=rank[0], dp_rank=rank[1], router_id=self.router_id
        )
        return await self._send(entry, event, undo=undo)

    def _rank_in_view(self, request_id: str) -> Rank:
        rank = self.view.rank_of(request_id)
        if rank is None:
            raise UnknownRequest(
                f"request {request_id!r}: not booked by this scheduler, and its view does not "
                "show it (not active, or not in the bucket yet)"
            )
        return rank

    async def _send(self, entry: Pending, event: Any, undo: Any) -> int:
        try:
            seq = await self.publisher.publish(event)
        except BaseException:
            self._overlay.cancel(entry)
            if undo is not None:
                undo()
            raise
        self._overlay.settle(entry, seq)
        return seq

    def rank_of(self, request_id: str) -> Rank | None:
        """Where ``request_id`` is booked: by this scheduler, else as the view shows it."""
        booked = self._booked.get(request_id)
        return booked.rank if booked is not None else self.view.rank_of(request_id)

    def staleness(self) -> Staleness:
        """The view's (:meth:`RegistryView.staleness`): how far the view is behind the log.
        The scheduler's own events and its peers' count whatever that is (:attr:`pending`)."""
        return self.view.staleness()

    @property
    def pending(self) -> int:
        """Events (its own and its peers') counted that the view does not show yet."""
        self._overlay.prune(self.view.applied_seq)
        return len(self._overlay)

    @property
    def booked(self) -> int:
        """Requests this scheduler booked and has not freed."""
        return len(self._booked)

    # ---- peers ------------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Every worker event of the namespace from the view's position on."""
        self._js = js = self._nc.jetstream()
        subject = self.config.worker_subjects
        try:
            self._feed = await js.subscribe(
                subject,
                stream=self.config.events_stream,
                cb=self._peer,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                config=api.ConsumerConfig(opt_start_seq=self.view.applied_seq + 1),
                idle_heartbeat=5.0,
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning(
                "scheduler %s: not following peers' events (%s); they count once the view "
                "shows them",
                self.router_id,
                exc,
            )
            return
        self.following = True

    async def _peer(self, msg: Msg) -> None:
        seq = log_time_ns(msg)[0]
        if seq <= self.view.applied_seq:
            return  # the view shows it already
        data = msg.data
        if not is_batch(data):
            self._peer_event(seq, data)
            return
        with contextlib.suppress(EventDecodeError):  # refused whole by the writer too
            for item in decode_batch(data):  # a record batch: each of its events
                self._peer_event(seq, item)

    def _peer_event(self, seq: int, data: bytes) -> None:
        try:
            event = decode_event(data)
        except (EventDecodeError, msgspec.DecodeError):
            return  # the writer dead-letters it; nothing to count
        router = getattr(event, "router_id", None)
        if router == self.router_id or router is None:
            return  # ours: counted when sent
        overlay, peers = self._overlay, self._peer_booked
        match event:
            case AddRequest():
                rank = (event.worker_id, event.dp_rank)
                tokens = event.prefill_tokens if event.track_prefill_tokens else 0
                hashes = event.block_hashes
                entry = overlay.add(rank, hashes, tokens)
                peers[event.request_id] = _Booked(rank, hashes, tokens)
                if len(peers) > PEERS_REMEMBERED:
                    peers.popitem(last=False)
            case MarkPrefillCompleted():
                booked = peers.get(event.request_id)
                rank = (event.worker_id, event.dp_rank) if booked is None else booked.rank
                entry = overlay.mark(rank, 0 if booked is None else booked.prefill)
                if booked is not None:
                    booked.prefill = 0
            case Free():
                booked = peers.pop(event.request_id, None)
                if booked is None:
                    entry = overlay.free((event.worker_id, event.dp_rank), (), 0)
                else:
                    entry = overlay.free(booked.rank, booked.hashes, booked.prefill)
            case _:
                return
        overlay.settle(entry, seq)
        self.peer_events += 1
        if router not in self._peers_heard:
            self._share_until = 0.0  # a new peer: the shares change now
        self._peers_heard[router] = time.monotonic()
