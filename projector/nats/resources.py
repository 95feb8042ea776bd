"""Provisioning: the streams and the KV bucket the pipeline needs, created or updated idempotently.

Running it twice changes nothing; running it for a second namespace adds that namespace's
subjects to the shared streams. It never deletes a stream, nor takes a Dynamo endpoint out of a
capture (``seqstate dynamo uncapture`` does: :mod:`projector.dynamo.uncapture`). A difference it
cannot reconcile (the storage type of an existing stream, say) is reported as
:class:`ProvisioningError` naming the setting, never papered over by recreating the stream and
losing its log. Replicas are only ever raised: a process started with the default ``--replicas
1`` against a cluster's R3 streams must not quietly strip them of their copies.

The events stream is the ledger's truth, so it never drops an event to make room: it is kept
at the discard policy ``new`` (and, under a per-subject limit, ``discard_new_per_subject``).
It has no limits of its own, but an operator may give it some (or the account's storage may
run out): a full stream then refuses new events, and ``RouterPublisher`` raises
``PublishError`` saying so, where the default policy ``old`` would drop the *oldest* events,
unfolded ones included, without a word. A ``max_age`` on it, which drops events whatever the
policy, is warned about.

The capture and dead-letter streams are buffers and copies, so they have byte limits
(``capture_max_bytes``, ``dead_letter_max_bytes``) and drop their oldest messages beyond
(discard ``old``). The capture stream holds what no writer's forwarder has stored yet (it
purges what it stored), so ``new`` would have it refuse Dynamo's newest messages once such a
backlog filled it, and keep the oldest; with ``old``, only a backlog nothing took for longer
than the limit holds loses its oldest, and :mod:`projector.nats.backlog` counts those exactly
(``status``, the metrics), as the fold counts them per Dynamo publisher. A byte limit on an
existing stream is only ever raised (a stream without one, as streams created before the
setting, gets it): two processes given different values must not take turns rewriting it, and
an operator's larger limit stays; 'off' lifts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from projector.aio.retry import with_backoff
from projector.nats.client_internals import server_info
from projector.nats.connection import refused_or
from projector.nats.failures import (
    RETRY_FOR_S,
    STORAGE_EXCEEDED,
    JetStreamOff,
    describe,
    jetstream_off,
    placing,
)
from projector.settings.config import Config
from projector.wire import msg_ids
from projector.wire.capture import (
    CAPTURE_MAX_AGE_S,
    capture_stream,
    dynamo_subject,
)
from seqstate.errors import SeqstateError

# Per-message TTL, atomic batches and counters arrive in 2.11-2.12; we rely on none of them,
# but an old server silently ignores unknown stream options, so refuse anything older than the
# oldest release we test with.
MIN_SERVER = (2, 10, 0)
# The deltas stream takes atomic batches where the server has them (the writer then stores
# many messages per round trip, else one); asked of older servers, the option would be ignored.
ATOMIC_BATCHES = (2, 12, 0)

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
            if jetstream_off(exc) and not server_info(nc).get("jetstream"):
                raise JetStreamOff() from None
            if asyncio.get_running_loop().time() > deadline:
                if jetstream_off(exc):
                    raise JetStreamOff() from None
                raise ProvisioningError(f"JetStream is not available: {describe(exc)}") from None
            await asyncio.sleep(0.2)


def check_server(nc: Client) -> None:
    version = nc.connected_server_version
    found = (version.major, version.minor, version.patch)
    if found == (0, 0, 0):  # reconnecting: no server to ask now (its requests wait for one)
        return
    if found < MIN_SERVER:
        wanted = ".".join(map(str, MIN_SERVER))
        raise ProvisioningError(
            f"nats-server {'.'.join(map(str, found))} is too old: need {wanted}+"
        )


def _server_at_least(nc: Client, version: tuple[int, int, int]) -> bool:
    found = nc.connected_server_version
    return (found.major, found.minor, found.patch) >= version


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
    doing = "checking or provisioning the streams and the bucket"

    async def once() -> Resources:
        names = resource_names(config)
        return await refused_or(
            nc, _ensure(nc, config), user=config.nats_user, doing=doing, names=names
        )

    # A server restarting in the middle leaves a request unanswered: every step is a create or
    # an update to what is wanted, so the whole is asked again, as long as a consumer rides
    # out a restart anywhere else (RETRY_FOR_S). Any answer but silence is final.
    return await with_backoff(
        once,
        again=lambda exc: isinstance(exc, TimeoutError),
        within_s=RETRY_FOR_S,
        say=lambda exc, pause: f"{doing} failed, retrying in {pause:.2f}s: {describe(exc)}",
    )


async def _ensure(nc: Client, config: Config) -> Resources:
    check_server(nc)
    js = nc.jetstream()
    await wait_for_jetstream(nc)
    storage = api.StorageType.FILE
    if config.dynamo_endpoints:
        await _ensure_capture(js, config)
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
            metadata={msg_ids.KEY: msg_ids.new_key()},
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
            allow_direct=True,  # the projector's lag counts its namespace's delta messages
            allow_atomic=True if _server_at_least(nc, ATOMIC_BATCHES) else None,
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
            max_bytes=_bytes_limit(config.dead_letter_max_bytes),
            discard=api.DiscardPolicy.OLD,
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


async def _ensure_capture(js: JetStreamContext, config: Config) -> None:
    """The namespace's capture stream (its Dynamo endpoints' subjects, added to any it has).

    It buffers what Dynamo publishes, whether seqstate's processes run or not, until a
    writer's forwarder (:mod:`projector.dynamo.forward`) stores it in the events stream (as
    record batches) and purges it. It keeps a day of messages, should none be forwarded for
    a while (no writer running, or the events stream full).
    """
    name = dynamo_capture(config)
    await _ensure_stream(
        js,
        api.StreamConfig(
            name=name,
            description=(
                f"Dynamo replica-sync events captured for seqstate namespace "
                f"{config.namespace} (the writer forwards them into its events stream)"
            ),
            subjects=[dynamo_subject(e) for e in config.dynamo_endpoints],
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS,
            max_age=CAPTURE_MAX_AGE_S,
            max_bytes=_bytes_limit(config.capture_max_bytes),
            discard=api.DiscardPolicy.OLD,
            num_replicas=config.replicas,
        ),
    )


_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"


def msg_id_key(info: api.StreamInfo) -> str | None:
    """The events stream's msg-id key (:mod:`projector.wire.msg_ids`), None on a stream that
    no writer of this version has provisioned yet."""
    return (info.config.metadata or {}).get(msg_ids.KEY)


def _bytes_limit(setting: int | None) -> int:
    return -1 if setting is None else setting  # JetStream's "no limit"


def _raised_bytes(name: str, have: int | None, wanted: int) -> int:
    """The byte limit an existing stream keeps: the larger (no limit, -1, the largest of
    all when asked for); a stream without one gets the one wanted."""
    have = have if have and have > 0 else -1
    if have == -1 or wanted == -1:
        return wanted
    if wanted < have:
        log.warning(
            "stream %s keeps its byte limit of %d although this process asks for %d: "
            "seqstate never lowers a byte limit (lower it by hand, and the setting of every "
            "process, if you mean to)",
            name,
            have,
            wanted,
        )
    return max(have, wanted)


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
            return await _unreserved(js.add_stream, wanted, None)
        except APIError as exc:
            if exc.err_code == _NAME_IN_USE:  # made meanwhile by another process (its own key)
                return await _ensure_stream(js, wanted, keep_every_message=keep_every_message)
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
    changes: dict[str, object] = {
        "subjects": subjects + missing,
        "duplicate_window": max(have.duplicate_window or 0, wanted.duplicate_window or 0),
        "num_replicas": max(replicas, wanted.num_replicas or 1),
        "description": wanted.description,
        "max_age": wanted.max_age if wanted.max_age is not None else have.max_age,
        "allow_direct": bool(have.allow_direct or wanted.allow_direct),
        # turned on, never off: a writer of an older version has no use for it, nor harm
        "allow_atomic": bool(have.allow_atomic or wanted.allow_atomic),
        "sources": _sources(have.sources, wanted.sources),
    }
    if keep_every_message:
        changes["discard"] = api.DiscardPolicy.NEW
        changes["discard_new_per_subject"] = bool((have.max_msgs_per_subject or 0) > 0)
    if wanted.max_bytes is not None:  # a limit of seqstate's setting
        changes["max_bytes"] = _raised_bytes(wanted.name or "", have.max_bytes, wanted.max_bytes)
    current: dict[str, object] = {
        "subjects": subjects,
        "duplicate_window": have.duplicate_window,
        "num_replicas": have.num_replicas,
        "description": have.description,
        "max_age": have.max_age,
        "allow_direct": bool(have.allow_direct),
        "allow_atomic": bool(have.allow_atomic),
        "sources": list(have.sources or []),
    }
    if keep_every_message:
        current["discard"] = have.discard
        current["discard_new_per_subject"] = bool(have.discard_new_per_subject)
    if wanted.metadata:  # a key the stream lacks is added; one it has is never changed
        changes["metadata"] = {**wanted.metadata, **(have.metadata or {})}
        current["metadata"] = have.metadata or {}
    if wanted.max_bytes is not None:
        current["max_bytes"] = have.max_bytes if have.max_bytes and have.max_bytes > 0 else -1
    if changes == current:
        return info
    updated = api.StreamConfig.from_response(have.as_dict())
    for key, value in changes.items():
        setattr(updated, key, value)
    try:
        return await _unreserved(js.update_stream, updated, have.max_bytes)
    except APIError as exc:
        raise ProvisioningError(f"cannot update stream {wanted.name}: {exc.description}") from None


async def _unreserved(
    call: Callable[[api.StreamConfig], Awaitable[api.StreamInfo]],
    config: api.StreamConfig,
    instead: int | None,
) -> api.StreamInfo:
    """``call(config)``; if the server cannot reserve the byte limit asked for (a server
    whose whole JetStream storage is smaller), once more with the limit ``instead`` (none,
    or the stream's own), saying so: the server's storage is the bound then."""
    asked = config.max_bytes or -1
    what = f"placing stream {config.name}"
    try:
        return await placing(lambda: call(config), what)
    except APIError as exc:
        if exc.err_code != STORAGE_EXCEEDED or asked <= 0 or asked == (instead or -1):
            raise
        refused = describe(exc)
    log.warning(
        "stream %s keeps %s: the server cannot reserve the %d bytes of its byte limit "
        "(%s); its JetStream storage bounds it instead",
        config.name,
        f"its byte limit of {instead}" if instead and instead > 0 else "no byte limit",
        asked,
        refused,
    )
    config.max_bytes = instead if instead and instead > 0 else -1
    return await placing(lambda: call(config), what)


async def _ensure_bucket(js: JetStreamContext, wanted: api.KeyValueConfig) -> KeyValue:
    try:
        kv = await js.key_value(wanted.bucket)
    except BucketNotFoundError:
        return await placing(lambda: js.create_key_value(wanted), f"placing bucket {wanted.bucket}")
    status = await kv.status()
    if status.history != wanted.history:
        raise ProvisioningError(
            f"bucket {wanted.bucket} keeps history {status.history}, the configuration wants "
            f"{wanted.history}"
        )
    return kv
