"""Replay: fold the log into a fresh state in process, to any point, and compare or rebuild.

Because every event is applied at its log time, and every message goes through the writer's
own fold (:class:`seqstate.fold.Fold`, by the configuration's ``fold_rules``: what the writer
dead-lettered, a replay skips, for the same reason), folding the stream again gives the state
the writer had at any sequence, byte for byte; ``--at`` stops at a log time instead, which
answers "what did the scheduler see at 12:03:07?". A replay starts from the newest valid
snapshot at or before its target (so it costs the tail), or from an empty state at
``--from-seq``.

``verify`` replays to the bucket's recorded position and names every key whose value differs.
``rebuild`` re-derives the whole bucket of a namespace from the write model. The bucket has one
writer, so it takes the namespace's lease (:mod:`projector.nats.lease`) and refuses while a
projector holds it: waiting for an operator's process to end would look like a hang.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError

from projector.bucket.contents import BucketView, read_bucket
from projector.bucket.projection import every_key
from projector.nats.lease import DEFAULT_TTL_S, Holder, LeaseHeld
from projector.nats.stream import last_seq_of
from projector.run.assemble import build_lease, build_projector
from projector.settings.config import Config
from projector.wire.values import RequestValue, load_key, part_key, slot_key, tracker_key
from projector.write.log_fold import Progress, Replayed, ReplayError, replay
from seqstate import RankLoad, SequenceState

# ---- the bucket ------------------------------------------------------------------------------


def differences(state: SequenceState, bucket: BucketView, namespace: str) -> list[str]:
    """Each bucket key whose value differs from ``state``'s, with what differs.

    Slots are part of the write model, so each live request must sit in its own slot's key
    (a long prompt's rest in its parts, stamped like it); a slot key beyond the live ones must
    hold the empty value, and a part hashes only under a head that claims it.
    """
    out = [f"{key}: unreadable ({why})" for key, (_, why) in sorted(bucket.unreadable.items())]
    out += [f"{key}: not a key of the read model" for key in sorted(bucket.strays)]
    got_block = None if bucket.tracker is None else bucket.tracker.block_size
    if state.block_size != got_block and tracker_key(namespace) not in bucket.unreadable:
        out.append(
            f"{tracker_key(namespace)}: bucket block size {got_block}, replay {state.block_size}"
        )
    expected_loads = {rank: slot.load() for rank, slot in state.workers.slots.items()}
    got_loads = {rank: value.rank_load() for rank, value in bucket.loads.items()}
    for rank in sorted(set(expected_loads) | set(got_loads)):
        key = load_key(namespace, rank)
        want, got = expected_loads.get(rank), got_loads.get(rank)
        if want is None:
            out.append(f"{key}: in the bucket, not in the replayed state")
        elif got is None:
            if key not in bucket.unreadable:
                out.append(f"{key}: missing from the bucket")
        elif want != got:
            out.append(f"{key}: bucket {_load_text(got)}, replay {_load_text(want)}")
    for rank in sorted(set(state.workers.slots) | set(bucket.slots)):
        slot_state = state.workers.slots.get(rank)
        live = (
            {}
            if slot_state is None
            else {r.slot: (request_id, r.hashes) for request_id, r in slot_state.requests.items()}
        )
        held = bucket.requests(rank)
        for slot in sorted(set(live) | set(held)):
            key = slot_key(namespace, rank, slot)
            if key not in bucket.unreadable:
                out += _slot_difference(
                    bucket, namespace, rank, slot, live.get(slot), held.get(slot)
                )
    for rank, slot, part in bucket.stray_parts():
        out.append(f"{part_key(namespace, rank, slot, part)}: hashes that no request holds")
    return out


def _slot_difference(
    bucket: BucketView,
    namespace: str,
    rank: tuple[int, int],
    slot: int,
    want: tuple[str, list[int]] | None,
    got: RequestValue | None,
) -> list[str]:
    """How the bucket's request ``got`` (its head) in ``slot`` differs from ``want`` (the
    replay's ``(id, hashes)``; None: both free), with its parts: nothing if it does not."""
    key = slot_key(namespace, rank, slot)
    if got is None:
        assert want is not None
        return [f"{key}: request {want[0]!r} missing from the bucket"]
    if want is None:
        return [f"{key}: request {got.request_id!r} in the bucket, not live in the replayed state"]
    parts = (part_key(namespace, rank, slot, p) for p in range(1, got.parts + 1))
    if any(part in bucket.unreadable for part in parts):
        return []  # named as unreadable already
    try:
        hashes = bucket.hashes(rank, slot)
    except ValueError as exc:
        return [f"{key}: request {got.request_id!r}: {exc}"]
    if (got.request_id, hashes) != want:
        return [
            f"{key}: bucket request {got.request_id!r} ({len(hashes)} hashes), replay "
            f"{want[0]!r} ({len(want[1])} hashes)"
        ]
    return []


def _load_text(load: RankLoad) -> str:
    p = load.prefill
    return (
        f"(blocks {load.active_blocks}, requests {load.active_requests}, prefill "
        f"{p.full_tokens} tokens anchored {p.anchored_since_ns})"
    )


async def verify(nc: Client, config: Config, *, progress: Progress | None = None) -> list[str]:
    """Replay to the bucket's position and list the keys that differ (empty: identical)."""
    try:
        bucket = await read_bucket(nc, config)
    except BucketNotFoundError:
        raise ReplayError(
            f"bucket {config.registry_bucket!r} does not exist: nothing to verify (no "
            "projector has run with these names)"
        ) from None
    if bucket.position is None:
        raise ReplayError(f"the bucket holds no position for namespace {config.namespace!r}")
    replayed = await replay(nc, config, to_seq=bucket.position.applied_seq, progress=progress)
    if replayed.last_seq != bucket.position.applied_seq:
        return [
            f"{config.namespace}.position: bucket at event {bucket.position.applied_seq}, "
            f"the log ends at {replayed.last_seq}"
        ]
    return differences(replayed.state, bucket, config.namespace)


async def rebuild(
    nc: Client,
    config: Config,
    *,
    progress: Progress | None = None,
    lease_ttl_s: float = DEFAULT_TTL_S,
) -> Replayed:
    """Re-derive the namespace's whole bucket from the write model, under its lease.

    Raises :class:`~projector.nats.lease.LeaseHeld` at once if a projector (or another rebuild) of
    the namespace is running; a dead holder's lease is taken over after its TTL.
    """
    lease = build_lease(nc, config, "rebuild", ttl_s=lease_ttl_s)
    try:
        await lease.acquire(wait=False)
    except LeaseHeld as exc:
        raise LeaseHeld(_refusal(exc, exc.holder), exc.holder) from None
    try:
        js = nc.jetstream()
        delta_seq = await last_seq_of(js, config.deltas_stream, config.deltas_subject)
        replayed = await replay(nc, config, progress=progress)
        # A long fold can starve the renewals: prove the lease is still ours before writing.
        await lease.renew()
        bucket = await read_bucket(nc, config)
        projector = build_projector(nc, config)
        projector.lease = lease
        stale = [key for key, _ in every_key(config.namespace, bucket)]
        projector.reset_to(replayed.state, replayed.last_seq, delta_seq, stale=stale)
        await projector.flush()
    finally:
        await lease.release()
    return replayed


def _refusal(exc: LeaseHeld, holder: Holder | None) -> str:
    if holder is not None and holder.kind == "rebuild":
        return f"{exc}; wait for it to end"
    return f"{exc}; stop it (or the 'seqstate run' that holds it), then rebuild"
