"""The one place where a :class:`~projector.settings.config.Config` becomes components.

The writer and the projector read a handful of the configuration's fields each, and work with
collaborators (a delta log, a snapshotter, dead letters, a lease...) that read a handful of
others. Were each to build its own from the whole configuration, every component would depend
on every setting, and a test could not hand one a stand-in. So each takes only the settings it
reads (a small frozen struct, or plain arguments), and everything is built here, once: the
pipeline, the standby, a rebuild and the command line all assemble through these functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from nats.aio.client import Client
from nats.js import JetStreamContext

from projector.bucket.contents import BucketView, read_bucket
from projector.bucket.projection import Projector, ProjectorSettings
from projector.dynamo.forward import CaptureForwarder
from projector.nats.dead_letters import PROJECTOR_KINDS, WRITER_KINDS, DeadLetters
from projector.nats.host import Host
from projector.nats.lag import Lag, LagSettings, projector_lag, writer_lag
from projector.nats.lease import DEFAULT_TTL_S, Kind, Lease, LeaseLost
from projector.nats.resources import ensure
from projector.nats.retention import Retention
from projector.nats.services import announced
from projector.nats.snapshots import SnapshotStore
from projector.settings.config import Config
from projector.write.delta_log import DeltaLog, DeltaLogSettings
from projector.write.snapshotter import SnapshotSettings, SnapshotStats, Snapshotter
from projector.write.writer import Writer, WriterSettings, WriterStats
from seqstate import SequenceState

__all__ = [
    "build_dead_letters",
    "build_delta_log",
    "build_host",
    "build_lease",
    "build_projector",
    "build_snapshot_store",
    "build_snapshotter",
    "build_writer",
    "delta_log_settings",
    "lag_settings",
    "projector_settings",
    "snapshot_settings",
    "writer_settings",
]


# ---- the settings each component reads ---------------------------------------------------------


def writer_settings(config: Config) -> WriterSettings:
    return WriterSettings(
        namespace=config.namespace,
        events_stream=config.events_stream,
        events_subjects=config.events_subjects,
        control_subject=config.control_subject,
        idle_tick_s=config.idle_tick_s,
        tick_every_s=config.tick_every_s,
        fold=config.fold_rules,
        window=config.consumer_window,
        # serve-http's lease holder answers reads from its writer's fold (projector.http)
        keep_registry=config.rules == "slot-tracker",
    )


def projector_settings(config: Config) -> ProjectorSettings:
    return ProjectorSettings(
        namespace=config.namespace,
        events_stream=config.events_stream,
        deltas_stream=config.deltas_stream,
        deltas_subject=config.deltas_subject,
        registry_bucket=config.registry_bucket,
        flush_interval_s=config.flush_interval_s,
        window=config.consumer_window,
    )


def delta_log_settings(config: Config) -> DeltaLogSettings:
    return DeltaLogSettings(
        namespace=config.namespace,
        events_stream=config.events_stream,
        deltas_stream=config.deltas_stream,
        deltas_subject=config.deltas_subject,
    )


def snapshot_settings(config: Config) -> SnapshotSettings:
    return SnapshotSettings(
        every_events=config.snapshot_every_events,
        every_s=config.snapshot_every_s,
        keep=config.snapshots_keep,
        history_every=config.snapshot_history_every,
        history_keep=config.snapshot_history_keep,
    )


def lag_settings(config: Config) -> LagSettings:
    return LagSettings(
        namespace=config.namespace,
        behind_warn_events=config.behind_warn_events,
        behind_warn_s=config.behind_warn_s,
        lag_check_s=config.lag_check_s,
        ready_lag_events=config.ready_lag_events,
    )


# ---- collaborators -----------------------------------------------------------------------------


def build_host(nc: Client, config: Config) -> Host:
    """Provisioning and service registration, bound to the namespace's names."""
    return Host(
        provision=functools.partial(ensure, nc, config),
        announce=functools.partial(announced, nc, config),
    )


def build_dead_letters(nc: Client, config: Config, kinds: tuple[str, ...]) -> DeadLetters:
    """The namespace's dead letters, counted under ``kinds`` (WRITER_KINDS, PROJECTOR_KINDS)."""
    return DeadLetters(
        nc.jetstream(),
        namespace=config.namespace,
        subject=config.dead_letter_subject,
        max_payload=nc.max_payload,
        kinds=kinds,
    )


def build_delta_log(nc: Client, config: Config) -> DeltaLog:
    return DeltaLog(nc.jetstream(), delta_log_settings(config), max_payload=nc.max_payload)


def build_snapshot_store(nc: Client, config: Config) -> SnapshotStore:
    return SnapshotStore(nc, config)


def build_snapshotter(
    nc: Client,
    config: Config,
    store: SnapshotStore | None,
    stats: SnapshotStats,
    deltas: DeltaLog,
) -> Snapshotter:
    return Snapshotter(store, snapshot_settings(config), Retention.of(nc, config), stats, deltas)


def build_lease(
    nc: Client,
    config: Config,
    kind: Kind,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    renew_s: float | None = None,
    on_lost: Callable[[LeaseLost], None] | None = None,
) -> Lease:
    return Lease(nc, config, kind, ttl_s=ttl_s, renew_s=renew_s, on_lost=on_lost)


# ---- the consumers -----------------------------------------------------------------------------


def build_writer(
    nc: Client,
    config: Config,
    state: SequenceState | None = None,
    *,
    snapshots: bool = True,
) -> Writer:
    """The namespace's writer. ``state``: a fold to go on from, kept as it is (None: an empty
    one with the configuration's rules, replaced by the newest valid snapshot if there is
    one); ``snapshots=False``: none taken or restored."""
    js: JetStreamContext = nc.jetstream()
    stats = WriterStats()
    deltas = build_delta_log(nc, config)
    store = build_snapshot_store(nc, config) if snapshots else None

    async def measure_lag(folded: int) -> Lag:
        return await writer_lag(js, config, folded)

    return Writer(
        nc,
        writer_settings(config),
        state=state if state is not None else config.new_state(),
        restore=state is None,
        stats=stats,
        deltas=deltas,
        snapshotter=build_snapshotter(nc, config, store, stats, deltas),
        dead_letters=build_dead_letters(nc, config, WRITER_KINDS),
        host=build_host(nc, config),
        lag=lag_settings(config),
        measure_lag=measure_lag,
        rules_differing=config.rules_differing,
        # a namespace that captures Dynamo endpoints: its writer stores what is captured
        forwarder=CaptureForwarder(nc, config) if config.dynamo_endpoints else None,
    )


def build_projector(
    nc: Client,
    config: Config,
    *,
    lease_ttl_s: float = DEFAULT_TTL_S,
    lease_renew_s: float | None = None,
    held_lease: Lease | None = None,
    stored_up_to: Callable[[], int] | None = None,
) -> Projector:
    """The namespace's projector. ``lease_ttl_s``: how long a SIGKILLed projector on another
    machine keeps a successor waiting; ``lease_renew_s`` (a third of it by default): how often
    the lease is renewed; ``held_lease``: one the caller holds already (a standby's);
    ``stored_up_to``: the last event a writer in this process folded (the stream holds it)."""
    js: JetStreamContext = nc.jetstream()

    def lease(on_lost: Callable[[LeaseLost], None]) -> Lease:
        return build_lease(
            nc, config, "projector", ttl_s=lease_ttl_s, renew_s=lease_renew_s, on_lost=on_lost
        )

    async def bucket() -> BucketView:
        return await read_bucket(nc, config)

    async def measure_lag(applied: int, delta_seq: int) -> Lag:
        return await projector_lag(js, config, applied, delta_seq)

    return Projector(
        nc,
        projector_settings(config),
        dead_letters=build_dead_letters(nc, config, PROJECTOR_KINDS),
        host=build_host(nc, config),
        lease=lease,
        read_bucket=bucket,
        lag=lag_settings(config),
        measure_lag=measure_lag,
        held_lease=held_lease,
        stored_up_to=stored_up_to,
    )
