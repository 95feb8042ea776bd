"""Request workloads for the demo router: what arrives when, with which prompt blocks.

A demo is only convincing if its traffic has the shape that makes KV-aware routing matter:
long prefixes shared by many requests, conversations whose prompts grow turn by turn, and
heavy-tailed lengths that leave some workers far busier than others. Two sources give that
shape: :func:`synthetic` (seeded, infinite, no files) and :func:`mooncake` (the Mooncake
FAST'25 conversation trace, real arrival times).

Both produce the same thing, :class:`DemoRequest`, with the same cost model and the same
block-hash semantics, so the router that replays them needs to know nothing about the source.
Nothing here does network I/O, reads a clock or sleeps: a workload is a pure function of its
parameters (and, for the trace, of the file's bytes), so a demo run can be reproduced and
this module can be tested without NATS.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Protocol

import msgspec
from msgspec import Meta

from seqstate.errors import SeqstateError

U64_MAX: Final = 2**64 - 1

# ---- the cost model ------------------------------------------------------------------------
#
# How long a request occupies its worker, modeled rather than measured, so a replay is
# deterministic and needs no GPU. Prefill is linear in the prompt (the same formula as
# benchmarks/fold.py, so the demo and the benchmark book the same prefill load); decode is
# linear in the output, optionally capped. A speed-up divides both after the cap, like it
# divides arrival times, so a sped-up replay is the same replay on a shorter clock: the same
# requests, the same overlaps, the same concurrency.

PREFILL_BASE_MS: Final = 20.0
PREFILL_MS_PER_TOKEN: Final = 0.05
DECODE_MS_PER_TOKEN: Final = 20.0

# Tokens per block hash. Mooncake's trace hashes 512-token blocks; the synthetic workload uses
# a smaller block so short prompts still have a few blocks to share.
MOONCAKE_BLOCK_TOKENS: Final = 512
SYNTHETIC_BLOCK_TOKENS: Final = 64

# ---- the synthetic traffic shape -----------------------------------------------------------
#
# Lengths are lognormal (median, sigma) and clipped: a long right tail like production
# traffic, with no prompt so long that one request makes the demo unreadable.

SYSTEM_PROMPT_TOKENS: Final = (1024.0, 0.8)
SYSTEM_PROMPT_CLIP: Final = (256, 8192)
USER_MESSAGE_TOKENS: Final = (192.0, 1.2)
USER_MESSAGE_CLIP: Final = (8, 16384)
OUTPUT_TOKENS: Final = (150.0, 1.0)
OUTPUT_CLIP: Final = (1, 4096)
# A conversation that would outgrow this context ends; its slot starts a new one.
MAX_CONTEXT_TOKENS: Final = 32768
MAX_TURNS: Final = 32
# A demo at 50 req/s should not hold a 4096-token answer for 80 s (workload seconds).
SYNTHETIC_MAX_DECODE_S: Final = 10.0


class WorkloadError(SeqstateError, ValueError):
    """A workload that cannot be replayed; the one-line message names the file and line."""


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request of a workload, with everything the router publishes about it.

    Times are wall-clock for the replay (already divided by the speed-up): the router books
    the request at ``arrival_s``, marks its prefill done ``prefill_ms`` later and frees it
    ``decode_ms`` after that. ``block_hashes`` are chained u64 hashes of the complete prompt
    blocks only, so ``block_hashes[i]`` names the whole prefix up to block ``i``.
    """

    request_id: str
    arrival_s: float
    block_hashes: tuple[int, ...]
    isl_tokens: int
    output_tokens: int
    prefill_ms: float
    decode_ms: float


class Workload(Protocol):
    """What the demo router iterates: named, with its block size, in arrival order.

    Iterating must yield :class:`DemoRequest` in non-decreasing ``arrival_s``, so the router
    can replay with a single cursor; each ``iter()`` starts the same stream again.
    """

    @property
    def name(self) -> str: ...

    @property
    def block_tokens(self) -> int: ...

    def __iter__(self) -> Iterator[DemoRequest]: ...


# ---- shared helpers ------------------------------------------------------------------------


def modeled_prefill_ms(isl_tokens: int, speedup: float = 1.0) -> float:
    """Prefill duration of a prompt under the cost model, at the replay's speed."""
    return (PREFILL_BASE_MS + PREFILL_MS_PER_TOKEN * isl_tokens) / speedup


def modeled_decode_ms(
    output_tokens: int, speedup: float = 1.0, max_decode_s: float | None = None
) -> float:
    """Decode duration under the cost model, capped in workload time, at the replay's speed."""
    ms = DECODE_MS_PER_TOKEN * output_tokens
    if max_decode_s is not None:
        ms = min(ms, max_decode_s * 1000.0)
    return ms / speedup


def chain_hashes(content_ids: Iterable[int], parent: int = 0) -> list[int]:
    """Chained u64 block hashes: each hash covers its block's content and the whole prefix.

    Chaining is what makes a hash name a prefix rather than a block: two prompts get the same
    hash at position ``i`` only if blocks ``0..i`` all agree, which is the only kind of reuse a
    KV cache can serve. ``parent`` continues an existing chain (its last hash).
    """
    out = []
    for content in content_ids:
        digest = hashlib.blake2b(
            parent.to_bytes(8, "little") + content.to_bytes(8, "little"), digest_size=8
        ).digest()
        parent = int.from_bytes(digest, "little")
        out.append(parent)
    return out


def _positive(what: str, value: float, where: str = "") -> None:
    if not (math.isfinite(value) and value > 0):
        raise WorkloadError(f"{where}{what} must be a positive finite number, got {value!r}")


def _limit(limit: int | None, where: str = "") -> None:
    if limit is not None and limit < 0:
        raise WorkloadError(f"{where}limit must be >= 0 or None, got {limit!r}")


def _lognormal(rng: random.Random, shape: tuple[float, float], clip: tuple[int, int]) -> int:
    median, sigma = shape
    low, high = clip
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


# ---- synthetic -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Conversation:
    number: int
    turns_left: int
    context_tokens: int  # system prompt + every user message and answer so far
    busy_until_s: float  # workload time the last turn's answer ends; no new turn before it
    content_ids: list[int]  # one per complete block of the context, Mooncake-style ids
    hashes: list[int]  # chained over content_ids
    turn: int = 0


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Seeded, production-shaped traffic; infinite unless ``limit`` is set.

    Arrivals are Poisson at ``rate_per_s`` (in workload time; a speed-up multiplies the wall
    rate). ``conversations`` slots stand for concurrent users: each arrival goes to a slot,
    chosen uniformly among those whose last answer has ended (a user cannot send the next turn
    before reading the previous answer), so conversations interleave. When every slot is still
    waiting, the arrival starts a new conversation in a random slot, and the one it replaces
    simply has no more turns. A conversation picks one of ``system_prompts`` shared system
    prompts (Zipf-weighted, so a few dominate) and runs a geometric number of turns with mean
    ``mean_turns``; every turn's prompt is the previous prompt plus its answer plus a new user
    message, so its block hashes extend the previous turn's. Request ids are
    ``syn-<conversation>-<turn>``.

    Everything is drawn from one ``random.Random(seed)`` in a fixed order: the same parameters
    give the same requests, byte for byte.
    """

    seed: int = 0
    rate_per_s: float = 50.0
    conversations: int = 256
    system_prompts: int = 8
    mean_turns: float = 4.0
    speedup: float = 1.0
    max_decode_s: float | None = SYNTHETIC_MAX_DECODE_S
    block_tokens: int = SYNTHETIC_BLOCK_TOKENS
    limit: int | None = None

    def __post_init__(self) -> None:
        _positive("rate_per_s", self.rate_per_s)
        _positive("speedup", self.speedup)
        if self.max_decode_s is not None:
            _positive("max_decode_s", self.max_decode_s)
        for name in ("conversations", "system_prompts", "block_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not (math.isfinite(self.mean_turns) and self.mean_turns >= 1):
            raise WorkloadError(f"mean_turns must be >= 1, got {self.mean_turns!r}")
        _limit(self.limit)

    @property
    def name(self) -> str:
        return f"synthetic(seed={self.seed}, rate={self.rate_per_s:g}/s)"

    def __iter__(self) -> Iterator[DemoRequest]:
        rng = random.Random(self.seed)
        bt = self.block_tokens
        # Content ids are a counter, like Mooncake's hash_ids: a fresh id is fresh content.
        # The chain starts from a per-seed root, so two seeds (or a synthetic run and a trace
        # replay feeding one registry) never appear to share a prefix.
        fresh = itertools.count()
        root = int.from_bytes(
            hashlib.blake2b(f"seqstate-synthetic-{self.seed}".encode(), digest_size=8).digest(),
            "little",
        )
        systems: list[tuple[int, list[int], list[int]]] = []
        for _ in range(self.system_prompts):
            tokens = _lognormal(rng, SYSTEM_PROMPT_TOKENS, SYSTEM_PROMPT_CLIP)
            ids = [next(fresh) for _ in range(tokens // bt)]
            systems.append((tokens, ids, chain_hashes(ids, root)))
        popularity = [1.0 / (k + 1) for k in range(self.system_prompts)]
        keep_going = 1.0 - 1.0 / self.mean_turns
        slots: list[_Conversation | None] = [None] * self.conversations
        numbers = itertools.count()

        def open_conversation() -> _Conversation:
            tokens, ids, hashes = rng.choices(systems, weights=popularity)[0]
            turns = 1
            while turns < MAX_TURNS and rng.random() < keep_going:
                turns += 1
            return _Conversation(next(numbers), turns, tokens, 0.0, list(ids), list(hashes))

        now_s = 0.0
        emitted = 0
        while self.limit is None or emitted < self.limit:
            now_s += rng.expovariate(self.rate_per_s)
            idle = [i for i, c in enumerate(slots) if c is None or c.busy_until_s <= now_s]
            slot = rng.choice(idle) if idle else rng.randrange(self.conversations)
            user = _lognormal(rng, USER_MESSAGE_TOKENS, USER_MESSAGE_CLIP)
            output = _lognormal(rng, OUTPUT_TOKENS, OUTPUT_CLIP)
            conv = slots[slot]
            if (
                conv is None
                or conv.busy_until_s > now_s
                or conv.turns_left == 0
                or conv.context_tokens + user + output > MAX_CONTEXT_TOKENS
            ):
                conv = slots[slot] = open_conversation()
            isl = conv.context_tokens + user
            # Blocks that became complete with this prompt: everything past the shared system
            # prompt's complete blocks is this conversation's own content.
            new_ids = [next(fresh) for _ in range(isl // bt - len(conv.content_ids))]
            parent = conv.hashes[-1] if conv.hashes else root
            conv.content_ids.extend(new_ids)
            conv.hashes.extend(chain_hashes(new_ids, parent))
            prefill_ms = modeled_prefill_ms(isl)
            decode_ms = modeled_decode_ms(output, max_decode_s=self.max_decode_s)
            yield DemoRequest(
                request_id=f"syn-{conv.number}-{conv.turn}",
                arrival_s=now_s / self.speedup,
                block_hashes=tuple(conv.hashes),
                isl_tokens=isl,
                output_tokens=output,
                prefill_ms=prefill_ms / self.speedup,
                decode_ms=decode_ms / self.speedup,
            )
            emitted += 1
            conv.busy_until_s = now_s + (prefill_ms + decode_ms) / 1000.0
            conv.context_tokens = isl + output
            conv.turns_left -= 1
            conv.turn += 1


def synthetic(
    *,
    seed: int = 0,
    rate_per_s: float = 50.0,
    conversations: int = 256,
    system_prompts: int = 8,
    mean_turns: float = 4.0,
    speedup: float = 1.0,
    max_decode_s: float | None = SYNTHETIC_MAX_DECODE_S,
    block_tokens: int = SYNTHETIC_BLOCK_TOKENS,
    limit: int | None = None,
) -> Iterator[DemoRequest]:
    """Iterate a :class:`SyntheticWorkload`; bad parameters raise here, not at first ``next``."""
    return iter(
        SyntheticWorkload(
            seed=seed,
            rate_per_s=rate_per_s,
            conversations=conversations,
            system_prompts=system_prompts,
            mean_turns=mean_turns,
            speedup=speedup,
            max_decode_s=max_decode_s,
            block_tokens=block_tokens,
            limit=limit,
        )
    )


# ---- the Mooncake trace --------------------------------------------------------------------

_NonNegative = Annotated[int, Meta(ge=0)]


class _TraceLine(msgspec.Struct):
    """One line of the Mooncake FAST'25 trace; extra keys are ignored."""

    timestamp: _NonNegative  # ms since the trace start
    input_length: _NonNegative
    output_length: _NonNegative
    hash_ids: list[_NonNegative]


_trace_decoder = msgspec.json.Decoder(_TraceLine)


@dataclass(frozen=True, slots=True)
class MooncakeWorkload:
    """The Mooncake FAST'25 trace (JSON lines), replayed at its own timestamps.

    The trace's ``hash_ids`` already name prefixes (the same id at the same position means the
    same prefix), but they are re-chained with :func:`chain_hashes` so that a hash from this
    workload means exactly what a synthetic one means. The trace lists a hash for the last,
    partial block of a prompt too; only the ``input_length // block_tokens`` complete blocks
    are kept, as ``AddRequest.block_hashes`` requires. Request ``mc-<i>`` is the trace line
    with 0-based index ``i``; blank lines are skipped but counted.

    The file must exist when the workload is made (a missing trace fails before a demo
    starts), but it is read lazily (3 MB is no reason to stall startup): a malformed line
    raises :class:`WorkloadError` only when iteration reaches it, after the requests before it
    were yielded. Timestamps must not decrease, since the router replays with one cursor.
    """

    path: Path
    speedup: float = 1.0
    limit: int | None = None
    max_decode_s: float | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))  # a str is welcome at run time
        where = self._where
        _positive("speedup", self.speedup, where)
        if self.max_decode_s is not None:
            _positive("max_decode_s", self.max_decode_s, where)
        if self.block_tokens < 1:
            raise WorkloadError(f"{where}block_tokens must be >= 1, got {self.block_tokens!r}")
        _limit(self.limit, where)
        if not self.path.exists():
            raise WorkloadError(f"{where}no such file")
        if not self.path.is_file():
            raise WorkloadError(f"{where}not a regular file")

    @property
    def _where(self) -> str:
        return f"mooncake trace {self.path}: "

    @property
    def name(self) -> str:
        return f"mooncake({self.path.name}, x{self.speedup:g})"

    def __iter__(self) -> Iterator[DemoRequest]:
        if self.limit == 0:
            return
        try:
            with self.path.open("rb") as f:
                yield from self._requests(f)
        except OSError as exc:
            raise WorkloadError(f"{self._where}cannot read: {exc.strerror or exc}") from None

    def _requests(self, lines: Iterable[bytes]) -> Iterator[DemoRequest]:
        emitted = 0
        last_ms = 0
        for index, raw in enumerate(lines):
            if not raw.strip():
                continue
            where = f"{self.path}:{index + 1}: "
            try:
                line = _trace_decoder.decode(raw)
            except msgspec.ValidationError as exc:
                raise WorkloadError(f"{where}{exc}") from None
            except msgspec.DecodeError as exc:
                raise WorkloadError(f"{where}invalid JSON: {exc}") from None
            if line.timestamp < last_ms:
                raise WorkloadError(
                    f"{where}timestamp {line.timestamp} ms is before the previous {last_ms} ms"
                )
            last_ms = line.timestamp
            ids = line.hash_ids[: line.input_length // self.block_tokens]
            if ids and max(ids) > U64_MAX:
                raise WorkloadError(f"{where}a hash id does not fit in u64 - at `$.hash_ids`")
            yield DemoRequest(
                request_id=f"mc-{index}",
                arrival_s=line.timestamp / 1000.0 / self.speedup,
                block_hashes=tuple(chain_hashes(ids)),
                isl_tokens=line.input_length,
                output_tokens=line.output_length,
                prefill_ms=modeled_prefill_ms(line.input_length, self.speedup),
                decode_ms=modeled_decode_ms(line.output_length, self.speedup, self.max_decode_s),
            )
            emitted += 1
            if emitted == self.limit:
                return


class _Stamp(msgspec.Struct):
    timestamp: int = 0


_stamp_decoder = msgspec.json.Decoder(_Stamp)


def trace_extent(path: str | Path, limit: int | None = None) -> tuple[int, float]:
    """How many requests a Mooncake trace holds (at most ``limit``) and the trace time of the
    last one, in seconds: what a replay's progress is measured against. One quick pass (only
    each line's timestamp is decoded); a line that does not decode is left for the replay to
    report where it stops."""
    count, last_ms = 0, 0
    try:
        with Path(path).open("rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                if limit is not None and count >= limit:
                    break
                count += 1
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    last_ms = max(last_ms, _stamp_decoder.decode(raw).timestamp)
    except OSError as exc:
        raise WorkloadError(f"mooncake trace {path}: cannot read: {exc.strerror or exc}") from None
    return count, last_ms / 1000.0


def mooncake(
    path: str | Path,
    *,
    speedup: float = 1.0,
    limit: int | None = None,
    max_decode_s: float | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Iterator[DemoRequest]:
    """Iterate a :class:`MooncakeWorkload`; a missing file or bad argument raises here."""
    return iter(
        MooncakeWorkload(
            Path(path),
            speedup=speedup,
            limit=limit,
            max_decode_s=max_decode_s,
            block_tokens=block_tokens,
        )
    )
