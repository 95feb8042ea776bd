"""What a Prometheus scrape of a seqstate process costs, at real sizes.

Why this exists: the metrics are read from the state when Prometheus asks (projector.ops.metrics),
so nothing is paid per event; the price is paid per scrape instead, and it should follow the
number of ranks (one sample of each per-worker gauge per rank), never the number of active
requests or blocks, which a busy rank counts in the hundreds of thousands. This folds a state
of W ranks each holding R requests of B blocks (real core, no NATS), then times
``generate_latest`` of the process's registry as ``seqstate writer --metrics-port`` builds it
(median of --runs).

Run from the repository root: ``.venv/bin/python benchmarks/metrics_scrape.py [--runs N]``.
"""

from __future__ import annotations

import platform
import statistics
import time
from types import SimpleNamespace

from harness.cli import argument_parser
from prometheus_client import generate_latest

from projector.nats.lag import Lag
from projector.ops.metrics import WRITER, Metrics
from projector.write.writer import WriterStats
from seqstate import AddRequest, SequenceState, WorkerAdded

BLOCK_BASE = 1 << 40


def folded(ranks: int, requests: int, blocks: int) -> SequenceState:
    """``ranks`` single-rank workers, each with ``requests`` requests of ``blocks`` blocks."""
    state = SequenceState(expiry_s=None)
    at = 1_000_000_000
    for w in range(ranks):
        state.apply(WorkerAdded(worker_id=w, block_size=16), at)
    n = 0
    for w in range(ranks):
        for r in range(requests):
            first = BLOCK_BASE + n * blocks
            add = AddRequest(
                request_id=f"w{w}r{r}",
                worker_id=w,
                block_hashes=list(range(first, first + blocks)),
                prefill_tokens=blocks * 16,
                expected_prefill_ms=50.0,
            )
            state.apply(add, at)
            n += 1
            at += 1000
    return state


def scrape_ms(state: SequenceState, runs: int) -> tuple[float, int]:
    """Median ms of one scrape of a writer holding ``state``, and the body's size."""
    writer = SimpleNamespace(
        state=state,
        namespace="bench",
        dead_letters=SimpleNamespace(counts={"undecodable": 0}),
        deltas=SimpleNamespace(messages=0, on_store=None),
        applied=SimpleNamespace(value=0),
        stats=WriterStats(),  # the real one: a stand-in missed what the metrics came to read
        lag=Lag(measured_ns=1),
    )
    metrics = Metrics()
    metrics.follow(WRITER, lambda: [writer])
    times = []
    body = b""
    for _ in range(runs):
        t0 = time.perf_counter()
        body = generate_latest(metrics.registry)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), len(body)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {args.runs} scrapes each")
    print(f"{'ranks':>6} {'requests/rank':>14} {'blocks/rank':>12} {'scrape ms':>10} {'bytes':>9}")
    for ranks, requests, blocks in (
        (16, 10, 16),
        (16, 1000, 128),
        (256, 10, 16),
        (1024, 10, 16),
        (4096, 1, 16),
    ):
        state = folded(ranks, requests, blocks)
        ms, size = scrape_ms(state, args.runs)
        print(f"{ranks:>6} {requests:>14} {requests * blocks:>12} {ms:>10.2f} {size:>9}")


if __name__ == "__main__":
    main()
