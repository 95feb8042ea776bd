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

import builtins
import contextlib
import hashlib
import io
import logging
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from projector.nats.failures import explain
from projector.nats.retry import placing
from projector.nats.tasks import off_loop
from projector.wire.config import Config
from seqstate import SCHEMA_VERSION, SeqstateError, SequenceState, SnapshotError
from seqstate.snapshot import SNAPSHOT_VERSION

log = logging.getLogger("seqstate.snapshots")

SEQ_DIGITS = 20


def digest_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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

    async def prune(self, keep: int) -> builtins.list[str]:
        """Delete all but the newest ``keep`` snapshots of this namespace; returns their names."""
        snapshots = await self.list()
        doomed = snapshots[: max(0, len(snapshots) - keep)]
        for info in doomed:
            with contextlib.suppress(NotFoundError):
                await self.store.delete(info.name)
        return [info.name for info in doomed]

    # ---- loading ----------------------------------------------------------------------------

    async def fetch(self, name: str) -> bytes:
        """The snapshot's bytes, digest-checked; ``SnapshotError`` names what is wrong."""
        # Into a buffer: without one, nats-py joins the chunks with ``+=``, which copies the
        # whole object again for every chunk (about 1.4 GB of copying for a 19 MB snapshot).
        buffer = io.BytesIO()
        try:
            result = await self.store.get(name, writeinto=buffer)
        except DigestMismatchError:
            raise SnapshotError(f"snapshot {name}: digest mismatch (damaged chunks)") from None
        except (ObjectNotFoundError, NotFoundError, BadObjectMetaError) as exc:
            raise SnapshotError(f"snapshot {name}: {type(exc).__name__}") from None
        data = buffer.getvalue()
        if result.info.size != len(data):
            raise SnapshotError(f"snapshot {name}: {len(data)} of {result.info.size} bytes")
        return data

    async def load(self, info: SnapshotInfo) -> SequenceState:
        if info.meta is None:
            raise SnapshotError(f"snapshot {info.name}: unreadable description")
        if info.meta.snapshot_version != SNAPSHOT_VERSION:
            raise SnapshotError(
                f"snapshot {info.name}: version {info.meta.snapshot_version}, "
                f"this build reads {SNAPSHOT_VERSION}"
            )
        data = await self.fetch(info.name)
        if info.meta.digest and digest_of(data) != info.meta.digest:
            raise SnapshotError(f"snapshot {info.name}: its bytes differ from its digest")
        try:
            # Seconds for a large model: off the loop, so that a signal is heard meanwhile.
            state = await off_loop(lambda: SequenceState.restore(data), "seqstate-restore")
        except SnapshotError as exc:
            raise SnapshotError(f"snapshot {info.name}: {exc}") from None
        if info.meta.size != len(data):
            raise SnapshotError(f"snapshot {info.name}: size differs from its description")
        return state

    async def newest_valid(
        self, *, at_most_seq: int | None = None, at_most_ns: int | None = None
    ) -> tuple[SequenceState, SnapshotInfo] | None:
        """The newest snapshot that loads (within the bounds given); each one passed is logged."""
        for info in reversed(await self.list()):
            if at_most_seq is not None and info.applied_seq > at_most_seq:
                continue
            if at_most_ns is not None and (info.meta is None or info.meta.as_of > at_most_ns):
                continue
            try:
                return await self.load(info), info
            except SnapshotError as exc:
                self.skipped.append((info.name, str(exc)))
                log.warning("skipping %s", exc)
        return None
