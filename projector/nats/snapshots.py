"""Write-model snapshots in a JetStream object store, so a restart costs the tail, not the history.

A snapshot is ``SequenceState.snapshot()`` bytes, named ``<ns>.<applied_seq>`` (zero-padded so
names sort by position) in the ``seqstate-snapshots`` object store, with its position, log
time and versions in the object's description. The object store chunks large states and keeps
a SHA-256 digest that nats-py checks on every read.

Saving is put, then read back and compared byte for byte: only then is the snapshot *verified*,
and only verified snapshots allow trimming the event stream. Loading tries the newest first; a
snapshot that is missing chunks, fails its digest, does not decode, or was written by an
incompatible version is reported with its reason and skipped for the next older one. Never a
crash, never a silently wrong state.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import hashlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
    ServiceUnavailableError,
)
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)
from nats.nuid import NUID

from projector.aio.tasks import off_loop
from projector.nats.failures import explain, placing
from projector.settings.config import Config
from seqstate import SCHEMA_VERSION, SeqstateError, SequenceState, SnapshotError
from seqstate.snapshot import READABLE_VERSIONS, SNAPSHOT_VERSION

log = logging.getLogger("seqstate.snapshots")

SEQ_DIGITS = 20
CHUNK_BATCH = 64  # chunks asked for at once (8 MB of nats-py's 128 kB chunks)
CHUNK_WAIT_S = 5.0  # a chunk that does not come within this is missing
CHUNK_RETRY_S = 0.05  # a pull the server could not serve yet is asked again after this
CHUNK_CONSUMER_IDLE_S = 30.0  # the server drops a reader's consumer left behind after this


def digest_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _object_digest(data: bytes) -> str:
    """The object store's digest of ``data`` (SHA-256, URL-safe base64), unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


class SnapshotNotStored(SeqstateError, RuntimeError):
    """The server did not store a snapshot; the message says why (a full disk, say)."""


class SnapshotMeta(msgspec.Struct, frozen=True):
    namespace: str
    applied_seq: int  # the last event folded into the state
    as_of: int  # that event's log time (ns since the epoch)
    snapshot_version: int
    event_schema: int
    size: int
    # A digest of the bytes (blake2b-128, hex), checked at every load: a body damaged in a
    # way that still decodes is refused too. Trailing and optional: older snapshots have "".
    digest: str = ""


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    meta: SnapshotMeta | None  # None: the description is unreadable (the snapshot is unusable)
    size: int
    modified: str

    @property
    def applied_seq(self) -> int:
        return self.meta.applied_seq if self.meta else _seq_from_name(self.name)


def starting_points(
    snapshots: Iterable[SnapshotInfo], at_most_seq: int | None, at_most_ns: int | None
) -> Iterator[SnapshotInfo]:
    """Which of ``snapshots`` (oldest first) a fold to event ``at_most_seq`` and log time
    ``at_most_ns`` may start from, newest first: one taken after either would hold what the
    fold must not see yet (one of unknown time cannot be placed, so never serves a time)."""
    for info in reversed(list(snapshots)):
        if at_most_seq is not None and info.applied_seq > at_most_seq:
            continue
        if at_most_ns is not None and (info.meta is None or info.meta.as_of > at_most_ns):
            continue
        yield info


def kept(
    snapshots: list[SnapshotInfo], keep: int, history_every: int | None, history_keep: int
) -> list[SnapshotInfo]:
    """Which of ``snapshots`` (oldest first) a prune keeps: the newest ``keep``, and the first
    at or past each positive multiple of ``history_every`` events (the newest
    ``history_keep`` of those), so that a look at any past moment folds at most about
    ``history_every`` events from one; the start of the log needs none."""
    newest = snapshots[max(0, len(snapshots) - keep) :]
    if not history_every or not history_keep:
        return newest
    firsts: dict[int, SnapshotInfo] = {}
    for info in snapshots:
        window = info.applied_seq // history_every
        if window >= 1 and window not in firsts:
            firsts[window] = info
    history = [firsts[w] for w in sorted(firsts)[-history_keep:]]
    chosen = {info.name for info in history + newest}
    return [info for info in snapshots if info.name in chosen]


def _seq_from_name(name: str) -> int:
    try:
        return int(name.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return -1


class SnapshotStore:
    """The snapshots of one namespace. ``skipped`` records every snapshot a load had to pass."""

    def __init__(self, nc: Client, config: Config) -> None:
        self.nc = nc
        self.config = config
        self._store: ObjectStore | None = None
        self.skipped: list[tuple[str, str]] = []

    async def open(self, *, create: bool = True) -> SnapshotStore:
        """Open the object store; without ``create``, a missing one reads as empty."""
        js = self.nc.jetstream()
        bucket = self.config.snapshot_bucket
        try:
            self._store = await js.object_store(bucket)
        except BucketNotFoundError:
            if not create:
                return self
            config = api.ObjectStoreConfig(
                description="seqstate write-model snapshots",
                storage=api.StorageType.FILE,
                replicas=self.config.replicas,
            )
            self._store = await placing(
                lambda: js.create_object_store(bucket, config=config),
                f"placing object store {bucket}",
            )
        return self

    @property
    def exists(self) -> bool:
        """Whether :meth:`open` found (or made) the object store."""
        return self._store is not None

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            raise RuntimeError("SnapshotStore.open() first")
        return self._store

    def name_for(self, applied_seq: int) -> str:
        return f"{self.config.namespace}.{applied_seq:0{SEQ_DIGITS}d}"

    # ---- listing ----------------------------------------------------------------------------

    async def list(self) -> list[SnapshotInfo]:
        """This namespace's snapshots, oldest first."""
        if self._store is None:
            return []
        try:
            entries = await self.store.list()
        except NotFoundError:
            return []
        prefix = f"{self.config.namespace}."
        out = []
        for entry in entries:
            if entry.deleted or not entry.name or not entry.name.startswith(prefix):
                continue
            if _seq_from_name(entry.name) < 0:
                continue
            try:
                meta = msgspec.json.decode(entry.description or b"", type=SnapshotMeta)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError, RecursionError):
                meta = None
            out.append(SnapshotInfo(entry.name, meta, entry.size or 0, entry.mtime or ""))
        out.sort(key=lambda info: info.applied_seq)
        return out

    # ---- saving -----------------------------------------------------------------------------

    async def save(self, state_bytes: bytes, applied_seq: int, as_of_ns: int) -> SnapshotInfo:
        """Store, read back and compare; raises ``SnapshotError`` if the read-back differs."""
        meta = SnapshotMeta(
            self.config.namespace,
            applied_seq,
            as_of_ns,
            SNAPSHOT_VERSION,
            SCHEMA_VERSION,
            len(state_bytes),
            digest_of(state_bytes),
        )
        name = self.name_for(applied_seq)
        try:
            await self.store.put(
                name,
                state_bytes,
                meta=api.ObjectMeta(name=name, description=msgspec.json.encode(meta).decode()),
            )
        except (TimeoutError, nats.errors.Error) as exc:  # a full disk, say: named
            why = await explain(self.nc, exc, f"OBJ_{self.config.snapshot_bucket}")
            raise SnapshotNotStored(f"snapshot {name} not stored: {why}") from None
        stored = await self.fetch(name)
        if stored != state_bytes:
            raise SnapshotError(f"snapshot {name} read back differently from what was stored")
        return SnapshotInfo(name, meta, len(state_bytes), "")

    async def prune(
        self, keep: int, history_every: int | None = None, history_keep: int = 0
    ) -> builtins.list[str]:
        """Delete the snapshots of this namespace that :func:`kept` does not keep; returns
        their names."""
        snapshots = await self.list()
        spared = {info.name for info in kept(snapshots, keep, history_every, history_keep)}
        doomed = [info for info in snapshots if info.name not in spared]
        for info in doomed:
            with contextlib.suppress(NotFoundError):
                await self.store.delete(info.name)
        return [info.name for info in doomed]

    # ---- loading ----------------------------------------------------------------------------

    async def fetch(self, name: str) -> bytes:
        """The snapshot's bytes, digest-checked; ``SnapshotError`` names what is wrong.

        The chunks are pulled in batches by a consumer of their own, not read one by one
        through nats-py's ``ObjectStore.get``, whose ordered push consumer waits on flow
        control between chunks: ~11 MB/s, half a second for a 6 MB snapshot, against tens of
        milliseconds pulled. The object's SHA-256 and size are checked as ``get`` checks them.
        """
        try:
            info = await self.store.get_info(name)
        except (ObjectNotFoundError, NotFoundError, BadObjectMetaError) as exc:
            raise SnapshotError(f"snapshot {name}: {type(exc).__name__}") from None
        if not info.nuid or info.is_link() or info.chunks is None or info.size is None:
            raise SnapshotError(f"snapshot {name}: BadObjectMetaError")
        chunks = await self._pull_chunks(name, info.nuid, info.chunks) if info.size else []
        data = b"".join(chunks)
        if len(chunks) != info.chunks or len(data) != info.size:
            raise SnapshotError(
                f"snapshot {name}: {len(data)} of {info.size} bytes in {len(chunks)} of "
                f"{info.chunks} chunks"
            )
        if _object_digest(data) != (info.digest or "").removeprefix(OBJ_DIGEST_TYPE).rstrip("="):
            raise SnapshotError(f"snapshot {name}: digest mismatch (damaged chunks)")
        return data

    async def _pull_chunks(self, name: str, nuid: str, count: int) -> builtins.list[bytes]:
        """The object's ``count`` chunks in order (fewer if some do not come)."""
        js = self.nc.jetstream()
        bucket = self.config.snapshot_bucket
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        consumer = NUID().next().decode()  # nats-py's own way to name one
        consumer_info = await js.add_consumer(
            stream,
            api.ConsumerConfig(
                name=consumer,
                filter_subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid),
                deliver_policy=api.DeliverPolicy.ALL,
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=CHUNK_CONSUMER_IDLE_S,
                # One replica in memory: on a cluster an R3 consumer answers its first pulls
                # with 503 until its peers elect a leader (seen right after a leader change).
                num_replicas=1,
                mem_storage=True,
            ),
        )
        chunks: builtins.list[bytes] = []
        try:
            stored = consumer_info.num_pending or 0
            if stored != count:  # a chunk lost (or one too many): said at once, not waited for
                raise SnapshotError(f"snapshot {name}: {stored} of {count} chunks stored")
            sub = await js.pull_subscribe_bind(consumer, stream)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CHUNK_WAIT_S
            try:
                while len(chunks) < count:
                    try:
                        msgs = await sub.fetch(min(count - len(chunks), CHUNK_BATCH), CHUNK_WAIT_S)
                    except TimeoutError:
                        break  # missing chunks: said by the caller
                    except ServiceUnavailableError:
                        # The consumer's leader not elected yet (a cluster in a leader
                        # change): asked again until a chunk would count as missing.
                        if loop.time() > deadline:
                            raise
                        await asyncio.sleep(CHUNK_RETRY_S)
                        continue
                    chunks += [msg.data for msg in msgs]
                    deadline = loop.time() + CHUNK_WAIT_S
            finally:
                await sub.unsubscribe()
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError, NotFoundError):
                await js.delete_consumer(stream, consumer)
        return chunks

    async def load(self, info: SnapshotInfo, *, registry: bool = True) -> SequenceState:
        """The state of snapshot ``info``; ``registry=False``: its registry left deferred
        (``SequenceState.restore``)."""
        if info.meta is None:
            raise SnapshotError(f"snapshot {info.name}: unreadable description")
        if info.meta.snapshot_version not in READABLE_VERSIONS:
            raise SnapshotError(
                f"snapshot {info.name}: version {info.meta.snapshot_version}, "
                f"this build reads {', '.join(map(str, READABLE_VERSIONS))}"
            )
        data = await self.fetch(info.name)
        if info.meta.digest and digest_of(data) != info.meta.digest:
            raise SnapshotError(f"snapshot {info.name}: its bytes differ from its digest")
        try:
            # Seconds for a large model: off the loop, so that a signal is heard meanwhile.
            state = await off_loop(
                lambda: SequenceState.restore(data, registry=registry), "seqstate-restore"
            )
        except SnapshotError as exc:
            raise SnapshotError(f"snapshot {info.name}: {exc}") from None
        if info.meta.size != len(data):
            raise SnapshotError(f"snapshot {info.name}: size differs from its description")
        return state

    async def newest_valid(
        self,
        *,
        at_most_seq: int | None = None,
        at_most_ns: int | None = None,
        registry: bool = True,
        snapshots: builtins.list[SnapshotInfo] | None = None,
    ) -> tuple[SequenceState, SnapshotInfo] | None:
        """The newest snapshot that loads (within the bounds given; among ``snapshots`` if the
        caller has just listed them); each one passed is logged."""
        listed = await self.list() if snapshots is None else snapshots
        for info in starting_points(listed, at_most_seq, at_most_ns):
            try:
                return await self.load(info, registry=registry), info
            except SnapshotError as exc:
                self.skipped.append((info.name, str(exc)))
                log.warning("skipping %s", exc)
        return None
