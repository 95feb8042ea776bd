"""Provisioning: the streams and the KV bucket the pipeline needs, created or updated idempotently.

Running it twice changes nothing; running it for a second namespace adds that namespace's
subjects to the shared streams. It never deletes a stream. A difference it cannot reconcile
(the storage type of an existing stream, say) is reported as :class:`ProvisioningError`
naming the setting, never papered over by recreating the stream and losing its log. Replicas
are only ever raised: a process started with the default ``--replicas 1`` against a cluster's
R3 streams must not quietly strip them of their copies.

The events stream is the ledger's truth, so it never drops an event to make room: it is kept
at the discard policy ``new`` (and, under a per-subject limit, ``discard_new_per_subject``).
It has no limits of its own, but an operator may give it some (or the account's storage may
run out): a full stream then refuses new events, and ``RouterPublisher`` raises
``PublishError`` saying so, where the default policy ``old`` would drop the *oldest* events,
unfolded ones included, without a word. A ``max_age`` on it, which drops events whatever the
policy, is warned about.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from projector.nats.connection import refused_or
from projector.nats.failures import JetStreamOff, describe, jetstream_off
from projector.wire.capture import (
    CAPTURE_MAX_AGE_S,
    RAW_PATTERN,
    capture_stream,
    dynamo_subject,
    rewrite,
)
from projector.wire.config import Config
from seqstate.errors import SeqstateError

# Per-message TTL, atomic batches and counters arrive in 2.11-2.12; we rely on none of them,
# but an old server silently ignores unknown stream options, so refuse anything older than the
# oldest release we test with.
MIN_SERVER = (2, 10, 0)

log = logging.getLogger("seqstate.resources")


class ProvisioningError(SeqstateError, RuntimeError):
    """The server or an existing stream/bucket cannot be made to match the configuration."""


@dataclass(frozen=True)
class Resources:
    events: api.StreamInfo
    deltas: api.StreamInfo
    dead_letters: api.StreamInfo
    registry: KeyValue


def dead_letter_stream(config: Config) -> str:
    return f"{config.events_stream}_DEAD"


def dynamo_capture(config: Config) -> str:
    """The stream that stores the namespace's Dynamo endpoints' events (projector.wire.capture)."""
    return capture_stream(config.events_stream, config.namespace)


async def wait_for_jetstream(nc: Client, timeout: float = 10.0) -> None:
    """Right after a server (or cluster) starts, management calls can time out: poll first.
    A server whose INFO offers no JetStream, and on which nothing answers its API, has none:
    :class:`JetStreamOff` at once."""
    js = nc.jetstream()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await js.account_info()
            return
        except (TimeoutError, APIError) as exc:
            if jetstream_off(exc) and not (getattr(nc, "_server_info", None) or {}).get(
                "jetstream"
            ):
                raise JetStreamOff() from None
            if asyncio.get_running_loop().time() > deadline:
                if jetstream_off(exc):
                    raise JetStreamOff() from None
                raise ProvisioningError(f"JetStream is not available: {describe(exc)}") from None
            await asyncio.sleep(0.2)


def check_server(nc: Client) -> None:
    version = nc.connected_server_version
    found = (version.major, version.minor, version.patch)
    if found < MIN_SERVER:
        wanted = ".".join(map(str, MIN_SERVER))
        raise ProvisioningError(
            f"nats-server {'.'.join(map(str, found))} is too old: need {wanted}+"
        )


def resource_names(config: Config) -> list[str]:
    """Every stream, bucket and object store of ``config``, as the JetStream API names them."""
    capture = [dynamo_capture(config)] if config.dynamo_endpoints else []
    return [
        *capture,
        config.events_stream,
        config.deltas_stream,
        dead_letter_stream(config),
        f"KV_{config.registry_bucket}",
        f"OBJ_{config.snapshot_bucket}",
        config.registry_bucket,
        config.snapshot_bucket,
    ]


async def ensure(nc: Client, config: Config) -> Resources:
    """Create or update every stream and bucket of ``config``; safe to run at every start.

    A user the server does not allow to (a role of deploy/nats-roles.conf that provisions
    nothing) gets :class:`~projector.nats.connection.PermissionRefused` naming the subject
    refused, at once, not a timeout read as "JetStream is not available".
    """
    return await refused_or(
        nc,
        _ensure(nc, config),
        user=config.nats_user,
        doing="checking or provisioning the streams and the bucket",
        names=resource_names(config),
    )


async def _ensure(nc: Client, config: Config) -> Resources:
    check_server(nc)
    js = nc.jetstream()
    await wait_for_jetstream(nc)
    storage = api.StorageType.FILE
    sources = [await _ensure_capture(js, config)] if config.dynamo_endpoints else None
    events = await _ensure_stream(
        js,
        api.StreamConfig(
            name=config.events_stream,
            description="seqstate lifecycle events (routers publish, the writer folds)",
            subjects=[config.events_subjects],
            storage=storage,
            retention=api.RetentionPolicy.LIMITS,
            duplicate_window=config.duplicate_window_s,
            num_replicas=config.replicas,
            allow_direct=True,
            discard=api.DiscardPolicy.NEW,
            sources=sources,
        ),
        keep_every_message=True,
    )
    deltas = await _ensure_stream(
        js,
        api.StreamConfig(
            name=config.deltas_stream,
            description="seqstate write-model deltas (the writer publishes, the projector reads)",
            subjects=[config.deltas_subject],
            storage=storage,
            retention=api.RetentionPolicy.LIMITS,
            duplicate_window=config.duplicate_window_s,
            num_replicas=config.replicas,
        ),
    )
    dead = await _ensure_stream(
        js,
        api.StreamConfig(
            name=dead_letter_stream(config),
            description="seqstate messages the writer could not decode, with the reason",
            subjects=[config.dead_letter_subject],
            storage=storage,
            retention=api.RetentionPolicy.LIMITS,
            max_age=7 * 24 * 3600.0,
            num_replicas=config.replicas,
        ),
    )
    registry = await _ensure_bucket(
        js,
        api.KeyValueConfig(
            bucket=config.registry_bucket,
            description="seqstate PromptRegistry: per-rank loads (JSON), per-request slots",
            history=1,
            storage=storage,
            replicas=config.replicas,
            direct=True,
        ),
    )
    return Resources(events, deltas, dead, registry)


async def _ensure_capture(js: JetStreamContext, config: Config) -> api.StreamSource:
    """The namespace's capture stream (its Dynamo endpoints' subjects, added to any it has),
    and the events stream's source of it, rewriting each subject into the namespace's.

    The capture stream only buffers: the server copies each message on into the events
    stream at once, whether seqstate's processes run or not. It keeps a day of messages, in
    case the events stream refuses them for a while (full, or its leader being elected).
    """
    name = dynamo_capture(config)
    await _ensure_stream(
        js,
        api.StreamConfig(
            name=name,
            description=(
                f"Dynamo replica-sync events captured for seqstate namespace "
                f"{config.namespace} (its events stream sources them)"
            ),
            subjects=[dynamo_subject(e) for e in config.dynamo_endpoints],
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS,
            max_age=CAPTURE_MAX_AGE_S,
            num_replicas=config.replicas,
        ),
    )
    return api.StreamSource(
        name=name,
        subject_transforms=[api.SubjectTransform(src=RAW_PATTERN, dest=rewrite(config.namespace))],
    )


def _sources(have: list[api.StreamSource] | None, wanted: list[api.StreamSource] | None) -> list:
    """The stream's sources, with each wanted one added if no source of its name is there."""
    kept = list(have or [])
    names = {source.name for source in kept}
    return kept + [source for source in wanted or [] if source.name not in names]


async def _ensure_stream(
    js: JetStreamContext, wanted: api.StreamConfig, *, keep_every_message: bool = False
) -> api.StreamInfo:
    """``keep_every_message``: a limit makes the stream refuse new messages (discard policy
    ``new``), never drop old ones; an operator's limits are kept, the policy is not."""
    try:
        info = await js.stream_info(wanted.name)  # type: ignore[arg-type]
    except NotFoundError:
        try:
            return await js.add_stream(wanted)
        except APIError as exc:
            listed = ", ".join(wanted.subjects or [])
            raise ProvisioningError(
                f"cannot create stream {wanted.name} on {listed}: {exc.description}"
                + (
                    " (another stream, perhaps another namespace's, has them)"
                    if exc.err_code == 10065
                    else ""
                )
            ) from None
    have = info.config
    if keep_every_message and have.max_age:
        log.warning(
            "stream %s has max_age %gs: events older than that are dropped, folded or "
            "not (to trim, use --retain-events instead)",
            wanted.name,
            have.max_age,
        )
    if have.storage != wanted.storage:
        raise ProvisioningError(
            f"stream {wanted.name} uses {have.storage} storage, the configuration wants "
            f"{wanted.storage}; a stream's storage cannot change in place (migrate it by hand)"
        )
    subjects = list(have.subjects or [])
    missing = [s for s in wanted.subjects or [] if s not in subjects]
    replicas = have.num_replicas or 1
    if (wanted.num_replicas or 1) < replicas:
        log.warning(
            "stream %s keeps its %d replicas although this process asks for %d: "
            "seqstate never lowers replicas (lower them by hand if you mean to)",
            wanted.name,
            replicas,
            wanted.num_replicas,
        )
    changes = {
        "subjects": subjects + missing,
        "duplicate_window": max(have.duplicate_window or 0, wanted.duplicate_window or 0),
        "num_replicas": max(replicas, wanted.num_replicas or 1),
        "description": wanted.description,
        "max_age": wanted.max_age if wanted.max_age is not None else have.max_age,
        "allow_direct": bool(have.allow_direct or wanted.allow_direct),
        "sources": _sources(have.sources, wanted.sources),
    }
    if keep_every_message:
        changes["discard"] = api.DiscardPolicy.NEW
        changes["discard_new_per_subject"] = bool((have.max_msgs_per_subject or 0) > 0)
    current = {
        "subjects": subjects,
        "duplicate_window": have.duplicate_window,
        "num_replicas": have.num_replicas,
        "description": have.description,
        "max_age": have.max_age,
        "allow_direct": bool(have.allow_direct),
        "sources": list(have.sources or []),
    }
    if keep_every_message:
        current["discard"] = have.discard
        current["discard_new_per_subject"] = bool(have.discard_new_per_subject)
    if changes == current:
        return info
    updated = api.StreamConfig.from_response(have.as_dict())
    for key, value in changes.items():
        setattr(updated, key, value)
    try:
        return await js.update_stream(updated)
    except APIError as exc:
        raise ProvisioningError(f"cannot update stream {wanted.name}: {exc.description}") from None


async def _ensure_bucket(js: JetStreamContext, wanted: api.KeyValueConfig) -> KeyValue:
    try:
        kv = await js.key_value(wanted.bucket)
    except BucketNotFoundError:
        return await js.create_key_value(wanted)
    status = await kv.status()
    if status.history != wanted.history:
        raise ProvisioningError(
            f"bucket {wanted.bucket} keeps history {status.history}, the configuration wants "
            f"{wanted.history}"
        )
    return kv
