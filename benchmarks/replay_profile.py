"""Where ``replay.py``'s (r1) time goes, when it misses its target or ``--profile`` asks.

Each part folds the same stream another way, so that the replay's time can be told apart into
what nats-py, the fast path's reader, the core and ``fold_stream``'s own loop each cost:
(p1) nats-py alone, (p1b) the reader process and pipe alone, (p2) the core alone on the
stream's payloads, (p3) ``cProfile`` over one ``fold_stream``, grouped by where the time goes.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import pstats
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from harness.measure import children_cpu_s, collect
from harness.servers import connect
from harness.workload import WAIT_TIMEOUT_S
from nats.aio.msg import Msg
from nats.js import api

from projector.nats.stream import log_time_ns
from projector.settings.config import Config
from projector.write.log_fold import fold_stream
from seqstate import decode_event


async def client_alone(url: str, config: Config, last: int) -> tuple[dict[str, Any], list[Any]]:
    """(p1) fold_stream's subscription with a callback that folds nothing; keeps the payloads."""
    nc = await connect(url, "bench-client-alone")
    kept: list[tuple[bytes, int]] = []
    keep = kept.append
    try:
        done = asyncio.get_running_loop().create_future()

        async def take(msg: Msg) -> None:
            seq, at_ns = log_time_ns(msg)
            keep((msg.data, at_ns))
            if seq >= last and not done.done():
                done.set_result(None)

        collect()
        c0, t0 = time.process_time(), time.perf_counter()
        sub = await nc.jetstream().subscribe(
            config.events_subjects,
            stream=config.events_stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            config=api.ConsumerConfig(opt_start_seq=1),
            cb=take,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )
        await asyncio.wait_for(done, WAIT_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await sub.unsubscribe()
    finally:
        await nc.drain()
    return {
        "events": len(kept),
        "seconds": seconds,
        "cpu_s": cpu,
        "events_per_s": len(kept) / seconds,
    }, kept


async def reader_alone(url: str, config: Config, last: int) -> dict[str, Any] | None:
    """(p1b) the fast path's reader process and pipe, feeding a callback that folds nothing."""
    try:
        from projector.nats.stream_reader import fast_fold
    except ImportError:
        return None
    nc = await connect(url, "bench-reader-alone")
    count = 0

    def take(*args: Any) -> bool:
        """One ``(seq, at_ns, data)`` or, in newer versions, one batch of them."""
        nonlocal count
        if len(args) == 1:
            count += len(args[0])
            return bool(args[0]) and args[0][-1][0] < last
        count += 1
        return bool(args[0] < last)

    try:
        collect()
        c0, k0, t0 = time.process_time(), children_cpu_s(), time.perf_counter()
        _, why = await fast_fold(nc, config, take, start_seq=1, end_seq=last)
        seconds = time.perf_counter() - t0
        cpu, child_cpu = time.process_time() - c0, children_cpu_s() - k0
    finally:
        await nc.drain()
    return {
        "events": count,
        "seconds": seconds,
        "cpu_s": cpu,
        "child_cpu_s": child_cpu,
        "events_per_s": count / seconds,
        "gave_up": why,
    }


def fold_payloads(
    kept: Sequence[tuple[bytes, int]], config: Config, *, like_fold_stream: bool
) -> float:
    """Seconds to decode and fold ``kept`` into a fresh state.

    ``like_fold_stream``: as ``fold_stream`` folds when it can (registry deferred and rebuilt
    once at the end, cyclic GC off); otherwise registry kept current and GC on (fold.py's way).
    """
    state = config.new_state()
    apply = state.apply
    deferred = like_fold_stream and hasattr(state, "defer_registry")
    collect()
    if like_fold_stream:
        gc.disable()
    try:
        t0 = time.perf_counter()
        if deferred:
            state.defer_registry()
        for data, at_ns in kept:
            apply(decode_event(data), at_ns)
        if deferred:
            state.sync_registry()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def core_alone(kept: Sequence[tuple[bytes, int]], config: Config) -> dict[str, Any]:
    """(p2) decode_event + apply over the stream's own payloads and log times, no NATS."""
    n = len(kept)
    collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        decoded = [decode_event(data) for data, _ in kept]
        decode_s = time.perf_counter() - t0
    finally:
        gc.enable()
    del decoded
    fast_s = fold_payloads(kept, config, like_fold_stream=True)
    plain_s = fold_payloads(kept, config, like_fold_stream=False)
    return {
        "events": n,
        "decode_us": decode_s / n * 1e6,
        "like_fold_stream_us": fast_s / n * 1e6,
        "like_fold_stream_events_per_s": n / fast_s,
        "registry_current_gc_on_us": plain_s / n * 1e6,
        "registry_current_gc_on_events_per_s": n / plain_s,
    }


CATEGORIES: Final = (
    ("seqstate: decode_event", ("seqstate/events",)),
    ("seqstate: apply (the fold, registry rebuild)", ("seqstate/", "SequenceState", "seqstate.")),
    (
        "fold_stream's loop (_Folder / take, log_time_ns)",
        ("projector/replay", "projector/stream.py"),
    ),
    ("fast path, this side (pipe reads, batch decode)", ("projector/stream_reader",)),
    ("nats-py JetStream (ordered-consumer checks, metadata)", ("nats/js/",)),
    ("nats-py core (read loop, parser, Msg, dispatch)", ("nats/aio/", "nats/protocol/")),
    ("asyncio (queues, tasks, streams, event loop, epoll)", ("asyncio/", "selectors")),
)
OTHER: Final = "other"


def categorize(key: tuple[str, int, str]) -> str:
    text = f"{key[0]}:{key[2]}"
    for label, needles in CATEGORIES:
        if any(needle in text for needle in needles):
            return label
    return OTHER


def grouped(raw: dict[tuple[str, int, str], Any]) -> dict[str, float]:
    """Own time per category; a builtin's own time goes to the category of each caller."""
    groups: dict[str, float] = {}
    for key, (_, _, tottime, _, callers) in raw.items():
        label = categorize(key)
        if key[0] == "~" and label == OTHER and callers:
            for caller, caller_stats in callers.items():
                share = caller_stats[2]  # own time of this builtin under that caller
                groups[categorize(caller)] = groups.get(categorize(caller), 0.0) + share
            continue
        groups[label] = groups.get(label, 0.0) + tottime
    return groups


async def profiled_replay(url: str, config: Config, last: int, top: int) -> dict[str, Any]:
    """(p3) cProfile over one fold_stream, grouped by where the time goes."""
    nc = await connect(url, "bench-profile")
    profiler = cProfile.Profile()
    try:
        state = config.new_state()
        collect()
        t0 = time.perf_counter()
        profiler.enable()
        await fold_stream(nc, config, state, start_seq=1, end_seq=last)
        profiler.disable()
        seconds = time.perf_counter() - t0
    finally:
        await nc.drain()
    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    groups = grouped(raw)
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    functions = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in rows:
        short = "/".join(Path(filename).parts[-2:]) if filename != "~" else ""
        functions.append(
            {
                "function": f"{short}:{line}({name})" if short else name,
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
                "share": tottime / total,
            }
        )
    return {
        "wall_s_under_profiler": seconds,
        "profiled_s": total,
        "shares": {k: v / total for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top": functions,
    }
