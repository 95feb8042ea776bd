"""The lease on a namespace's bucket: one writer (a projector or a rebuild) at a time.

The bucket has a single writer by design; two (a rebuild while a projector runs, two projectors
of one namespace) would interleave stale values with fresh ones. The lease is the key
``<ns>.lease`` in the bucket itself, so it lives wherever what it guards lives.

A holder can die without releasing (SIGKILL), so the lease must lapse by itself. Per-message
TTLs need nats-server 2.11 and machines share no clock, so liveness is the key's *revision*:
the holder rewrites the key every ``renew_s`` (compare-and-set on its own last revision), and
anyone else takes it over (compare-and-set on the revision it saw) only once that revision has
stayed unchanged for the holder's whole TTL on the taker's own monotonic clock. The holder
counts its TTL from the *send* time of its last successful renewal and a taker from when it
*received* the revision, so the holder stops writing before anyone may take over, as long as
no message is delayed by more than a TTL.

A holder that cannot renew for a TTL (the server away) stops writing but does not give up: a
later successful compare-and-set proves nobody took over, and writing resumes. Only a failed
one that shows another holder means the lease is lost, and the holder must end.

A holder on this machine whose process is gone is taken over at once instead of after a TTL:
when its pid is in our pid namespace on this boot, a missing process is proof of death (a
restarted process, the common case, then need not wait).

A projector's renewals are its heartbeat: each carries its last lag measurement
(:class:`~projector.wire.values.Heartbeat`, from ``Lease.beat``), so a reader of the bucket alone
(a scheduler) learns at every renewal that the projector lives and how far the bucket is behind
the log. Takers ignore it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import (
    APIError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from projector.aio.tasks import cancel_all
from projector.nats.failures import describe as describe_failure
from projector.settings.config import Config
from projector.wire.values import Heartbeat, lease_key
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.lease")

DEFAULT_TTL_S = 3.0
Kind = Literal["projector", "rebuild"]
_WRONG_LAST = (10071, 10164)  # JetStream's "wrong last sequence" error codes
# What a server restart or a leader election looks like from here: worth another try.
TRANSIENT: tuple[type[Exception], ...] = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,
    NoStreamResponseError,  # a 503 to a KV write: the bucket's stream is electing a leader
)
_NOT_RELEASED: tuple[type[Exception], ...] = (*TRANSIENT, APIError)


class Holder(msgspec.Struct, frozen=True):
    """The lease's value: who holds it, for a person reading it and for a taker deciding."""

    kind: str  # "projector" or "rebuild"
    id: str  # unique per acquisition: tells our own late renewal from another holder's
    host: str
    pid: int
    started: str  # wall-clock time, for people only: no decision uses it
    ttl_s: float  # the holder's TTL, which takers wait out (not their own)
    pid_space: str = ""  # where ``pid`` names this process (boot and pid namespace); "": unknown
    heartbeat: Heartbeat | None = None  # a projector's last lag measurement (None: none yet)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


class LeaseHeld(SeqstateError, RuntimeError):
    """A live holder has the lease and the caller would not wait for it."""

    def __init__(self, message: str, holder: Holder | None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLost(SeqstateError, RuntimeError):
    """Another holder has the lease now: this one must stop writing and end."""


class LeaseExpired(SeqstateError, RuntimeError):
    """Not renewed for a whole TTL: writes wait until a renewal shows nobody took over."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Holder)


def decode_holder(data: bytes) -> Holder | None:
    """The lease's value (None: unreadable)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _pid_space() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}:{namespace.st_dev}:{namespace.st_ino}"


PID_SPACE = _pid_space()


def provably_dead(holder: Holder | None) -> bool:
    """True only if ``holder``'s process is certainly gone; any doubt answers False."""
    if holder is None or not PID_SPACE or holder.pid_space != PID_SPACE or holder.pid <= 0:
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's) or cannot be asked
        return False
    return False  # alive, or its pid reused: wait the TTL out


def describe(holder: Holder | None, namespace: str) -> str:
    if holder is None:
        return f"a writer of namespace {namespace!r} holds the lease (its value is unreadable)"
    return f"a {holder.kind} of namespace {namespace!r} is running ({holder.describe()})"


class Lease:
    """``await lease.acquire(wait=...)``, then ``lease.check()`` before every write, and
    ``await lease.release()`` at the end; a background task renews it meanwhile."""

    def __init__(
        self,
        nc: Client,
        config: Config,
        kind: Kind,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        renew_s: float | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
    ) -> None:
        renew_s = ttl_s / 3 if renew_s is None else renew_s
        if not (math.isfinite(ttl_s) and 0 < renew_s < ttl_s):
            raise ValueError(f"lease: need 0 < renew_s < ttl_s, got {renew_s} and {ttl_s}")
        self.namespace = config.namespace
        self.key = lease_key(config.namespace)
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.poll_s = min(renew_s / 4, 0.25)  # how often a waiter looks at the key
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.holder = Holder(
            kind, uuid.uuid4().hex, socket.gethostname(), os.getpid(), started, ttl_s, PID_SPACE
        )
        self._value = _encoder.encode(self.holder)
        # What each renewal carries besides the holder (set by a projector: its lag).
        self.beat: Callable[[], Heartbeat | None] | None = None
        self._js = nc.jetstream()
        self._bucket = config.registry_bucket
        self._kv: KeyValue | None = None
        self.revision = 0  # of our last write of the key; 0: not held
        self._valid_until = 0.0  # loop time
        self._lost: str | None = None
        self._on_lost = on_lost
        self._keeper: asyncio.Task[None] | None = None
        self._renewing = asyncio.Lock()

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None."""
        return self._lost

    # ---- taking it --------------------------------------------------------------------------

    async def acquire(self, *, wait: bool) -> None:
        """Take the lease. A live holder is waited for (``wait``) or refused with
        :class:`LeaseHeld`; a dead one is taken over after its TTL, or at once if provably dead.
        """
        kv = await self._kv_handle()
        loop = asyncio.get_running_loop()
        told: str | None = None  # the holder we said we are waiting for
        while True:
            try:
                seen = await self._read(kv)
                if seen is None:
                    sent = loop.time()
                    revision = await kv.create(self.key, self._value)
                    break
                last, holder = seen
                dead = provably_dead(holder)
                outcome = "dead" if dead else await self._observe(kv, last, holder)
                if outcome == "renewed":
                    if not wait:
                        raise LeaseHeld(describe(holder, self.namespace), holder)
                    if told != (holder.id if holder else ""):
                        told = holder.id if holder else ""
                        log.warning("%s: waiting for it to stop", describe(holder, self.namespace))
                    continue
                if outcome == "gone":
                    continue
                sent = loop.time()
                revision = await kv.update(self.key, self._value, last=last)
            except KeyWrongLastSequenceError:
                continue  # someone else created or took it first: look again
            except TRANSIENT as exc:
                log.warning(
                    "lease of namespace %r: %s; trying again", self.namespace, describe_failure(exc)
                )
                await asyncio.sleep(self.poll_s)
                continue
            previous = f"a {holder.kind} ({holder.describe()})" if holder else "an unreadable value"
            log.warning(
                "took over the lease of namespace %r from %s: %s",
                self.namespace,
                previous,
                "its process is gone" if dead else "not renewed for its TTL",
            )
            break
        self.revision = revision
        self._valid_until = sent + self.ttl_s
        self._lost = None
        self._keeper = asyncio.create_task(self._keep(), name=f"seqstate-lease-{self.namespace}")
        log.info("holding the lease of namespace %r (%s)", self.namespace, self.holder.kind)

    async def _observe(
        self, kv: KeyValue, revision: int, holder: Holder | None
    ) -> Literal["renewed", "gone", "stale"]:
        """Watch ``revision`` for the holder's TTL: renewed (alive), gone, or unchanged."""
        loop = asyncio.get_running_loop()
        ttl = holder.ttl_s if holder is not None and 0 < holder.ttl_s < math.inf else self.ttl_s
        deadline = loop.time() + ttl
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(self.poll_s, left))
            try:
                seen = await self._read(kv)
            except TRANSIENT:
                continue  # the closing compare-and-set decides anyway
            if seen is None:
                return "gone"
            if seen[0] != revision:
                return "renewed"
        return "stale"

    async def _read(self, kv: KeyValue) -> tuple[int, Holder | None] | None:
        try:
            entry = await kv.get(self.key)
        except KeyNotFoundError:  # never written, deleted, or purged
            return None
        return entry.revision or 0, decode_holder(entry.value or b"")

    async def _kv_handle(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._js.key_value(self._bucket)
        return self._kv

    # ---- holding it -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise unless writing is safe now: :class:`LeaseLost` (end) or :class:`LeaseExpired`
        (wait: a renewal may still succeed)."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if not self.revision:
            raise LeaseLost(f"the lease of namespace {self.namespace!r} is not held")
        if asyncio.get_running_loop().time() >= self._valid_until:
            raise LeaseExpired(
                f"the lease of namespace {self.namespace!r} was not renewed for "
                f"{self.ttl_s:g}s; writes wait for a renewal"
            )

    async def renew(self) -> None:
        """Extend the lease to a TTL from now, or raise :class:`LeaseLost`; transient errors
        (the server away) propagate and the lease stays as it was."""
        async with self._renewing:
            if self._lost is not None:
                raise LeaseLost(self._lost)
            kv = await self._kv_handle()
            loop = asyncio.get_running_loop()
            while True:
                sent = loop.time()
                try:
                    revision = await asyncio.wait_for(
                        kv.update(self.key, self._renewal(), last=self.revision), self.renew_s
                    )
                except KeyWrongLastSequenceError:
                    seen = await self._read(kv)
                    if seen is not None and seen[1] is not None and seen[1].id == self.holder.id:
                        self.revision = seen[0]  # a renewal we gave up waiting for landed
                        continue
                    self._lost = f"the lease of namespace {self.namespace!r} was taken over: " + (
                        "its key was deleted" if seen is None else describe(seen[1], self.namespace)
                    )
                    raise LeaseLost(self._lost) from None
                self.revision = revision
                self._valid_until = sent + self.ttl_s
                return

    def _renewal(self) -> bytes:
        heartbeat = self.beat() if self.beat is not None else None
        if heartbeat is None:
            return self._value
        return _encoder.encode(msgspec.structs.replace(self.holder, heartbeat=heartbeat))

    async def _keep(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.poll_s if failing else self.renew_s)
            try:
                await self.renew()
            except LeaseLost as exc:
                log.error("%s", exc)
                if self._on_lost is not None:
                    self._on_lost(exc)
                return
            except TRANSIENT as exc:
                if not failing:
                    log.warning(
                        "lease of namespace %r not renewed (%s); retrying",
                        self.namespace,
                        describe_failure(exc),
                    )
                failing = True
                continue
            except Exception as exc:  # the connection is gone for good: nothing can renew it
                self._lost = (
                    f"the lease of namespace {self.namespace!r} cannot be renewed: "
                    f"{describe_failure(exc)}"
                )
                log.error("%s", self._lost)
                if self._on_lost is not None:
                    self._on_lost(LeaseLost(self._lost))
                return
            if failing:
                log.warning("lease of namespace %r renewed again", self.namespace)
            failing = False

    # ---- giving it up -----------------------------------------------------------------------

    async def release(self) -> None:
        """Delete the key (compare-and-set), so the next holder starts at once, not after a TTL."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            await cancel_all([keeper], None)  # a renewal's request may drop one cancellation
        if not self.revision or self._lost is not None:
            self.revision = 0
            return
        kv = await self._kv_handle()
        async with self._renewing:
            try:
                for _ in range(3):
                    try:
                        await asyncio.wait_for(kv.delete(self.key, last=self.revision), self.ttl_s)
                        return
                    except APIError as exc:
                        if exc.err_code not in _WRONG_LAST:
                            raise
                    seen = await self._read(kv)  # a cancelled renewal of ours may have landed
                    if seen is None or seen[1] is None or seen[1].id != self.holder.id:
                        return  # someone else's now: not ours to delete
                    self.revision = seen[0]
            except _NOT_RELEASED as exc:
                log.warning(
                    "lease of namespace %r not released (%r): the next holder waits %gs",
                    self.namespace,
                    exc,
                    self.ttl_s,
                )
            finally:
                self.revision = 0
