"""Numbers from runs: medians, percentiles, CPU seconds and memory read from ``/proc``.

One run on a shared two-core machine is noise; a figure is the median of several, and a
before/after comparison runs the two interleaved (A B A B ...) so that a load that comes and
goes falls on both alike, and is quoted as the ratio of medians taken in the same invocation.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


def collect() -> None:
    """Drop earlier garbage outside the timed regions (gc stays enabled inside them)."""
    gc.collect()


async def stamp(awaitable: Awaitable[object]) -> float:
    """``perf_counter()`` at the moment ``awaitable`` completes."""
    await awaitable
    return time.perf_counter()


def median(values: Iterable[float]) -> float:
    """The median of the numbers given, NaNs (a measurement that could not be had) left out;
    NaN when none is left."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def median_of(runs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of an ascending sequence; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def ratio(after: Sequence[float], before: Sequence[float]) -> float:
    """Median of ``after`` over median of ``before``: a same-run ratio."""
    return median(after) / median(before)


def rotated(variants: Sequence[T], run: int) -> list[T]:
    """The order to measure ``variants`` in on run ``run`` (from 0): each run starts one further
    along, so no variant always runs first (on a cold cache) or right after the same other."""
    k = run % len(variants)
    return [*variants[k:], *variants[:k]]


def alternated(variants: Sequence[T], run: int) -> list[T]:
    """The order on run ``run`` (from 0): as given, then reversed, and so on; two variants
    each go first as often."""
    return list(variants) if run % 2 == 0 else list(variants[::-1])


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of another process, from /proc; NaN if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def proc_tree_cpu(pids: Sequence[int]) -> float:
    """utime + stime (all threads) of ``pids`` and their live descendants, in seconds: a
    server that forks workers is measured whole."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            parent[int(name)] = int(fields[1])
            cpu[int(name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, ValueError, IndexError):
            continue
    wanted = set(pids)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in wanted and pid not in wanted:
                wanted.add(pid)
                grew = True
    return sum(cpu.get(p, 0.0) for p in wanted)


def rss_kb(pid: int | str = "self", fields: Sequence[str] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """``fields`` of ``/proc/<pid>/status`` in kB (VmRSS: resident now, VmHWM: its peak)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[key] = int(value.split()[0])
    return out


def fresh_stores(runs: int, prefix: str) -> Iterator[Path]:
    """A new, empty JetStream store directory for each of ``runs`` runs, removed after its run:
    no run reads what an earlier one left."""
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp) / "js"
