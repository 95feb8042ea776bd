"""``seqstate run`` beside a Dynamo fleet: the follower (:mod:`projector.dynamo.follow`) bound
to the running pipeline.

The follower reads the running writer's fold (never changes it) and resyncs from a copy of it,
so an automatic resync replays nothing: the copy is the ledger at the writer's last event, and
the resync folds on from there to its fence.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client

from projector.dynamo.discovery_config import open_discovery, parse_discovery
from projector.dynamo.follow import DiscoveryFeed, FleetFeed, Follower
from projector.dynamo.resync import resync
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.write.writer import Writer
from seqstate import SequenceState
from seqstate.errors import SeqstateError


class Pipeline(Protocol):
    """The running pipeline as the follower sees it: its writer (``seqstate run``'s
    :class:`projector.run.pipeline.Pipeline`, which sits above this wing)."""

    @property
    def writer(self) -> Writer: ...


class NoPipeline(SeqstateError, LookupError):
    """No pipeline runs (it is restarting): the follower waits for the next."""


def follower(
    nc: Client,
    config: Config,
    pipeline: Callable[[], Pipeline | None],
    feed: FleetFeed | None,
) -> Follower:
    def ledger() -> SequenceState:
        return _running(pipeline).writer.state

    def heard_before() -> frozenset[int]:
        return _running(pipeline).writer.heard_before_start

    async def resync_now() -> str:
        writer = _running(pipeline).writer
        # One synchronous step: the copy and its position are of the same event.
        base = (SequenceState.restore(writer.state.snapshot()), writer.stats.last_seq)
        done = await resync(nc, config, base=base)
        return (
            f"{done.requests} requests in flight republished ({done.marked} with their prefill "
            f"done), as publisher {done.publisher_id}; the log at event {done.last_seq}"
            + (f"; {done.freed} ended meanwhile, their Free sent again" if done.freed else "")
        )

    # A msg-id prefix of its own: its control events never deduplicate another's.
    control = RouterPublisher(
        nc, router_id=f"dynamo-discovery-{uuid.uuid4().hex[:12]}", config=config
    )
    return Follower(
        nc,
        config,
        feed=feed,
        ledger=ledger,
        resync=resync_now,
        publish=control.publish,
        auto_resync=config.dynamo_resync == "auto",
        heard_before=heard_before,
    )


def _running(pipeline: Callable[[], Pipeline | None]) -> Pipeline:
    running = pipeline()
    if running is None:
        raise NoPipeline("no pipeline runs")
    return running


def feed_for(config: Config) -> FleetFeed | None:
    """The discovery feed ``config`` names (None: no discovery); a
    :class:`~projector.dynamo.discovery_config.DiscoveryConfigError` for a spec or an
    environment that cannot be followed (one line)."""
    follower = open_discovery(parse_discovery(config.dynamo_discovery or None))
    return None if follower is None else DiscoveryFeed(follower, config.dynamo_endpoints)
