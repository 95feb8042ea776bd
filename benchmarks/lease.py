"""What Dynamo's request lease costs the fold, against the age limit, in the same run.

Why this exists: a Dynamo-fed namespace folds with the lease (``SequenceState(lease_scan_s=S)``:
a second-chance scan every S seconds of log time) instead of the age limit. The promise is that
a scan costs what it expires, never the number of live requests, and that the lease adds
nothing measurable to the fold's steady state. This script measures both, in process, on the
pure core (compiled when built: ``make native``):

(a) fold throughput, events/s: the same synthetic log (AddRequest with a prefill hint, its
    MarkPrefillCompleted, its Free; 100 requests/s over 16 workers, 4 blocks each) folded by
    the age limit and by the lease, alternately, the median of ``--runs`` each;
(b) a Tick with no scan due, with ``--live`` requests in flight (the lease, and the age limit,
    whose Tick visits every rank);
(c) one scan that expires N requests (N = 1,000, 10,000, 100,000), idle since two periods.

Run from the repository root: ``.venv/bin/python benchmarks/lease.py [--runs 5] [--json]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from harness.cli import argument_parser
from harness.measure import ratio
from harness.report import emit, git_revision, machine_line, print_fields

from seqstate import AddRequest, Free, MarkPrefillCompleted, SequenceState, Tick

NS = 1_000_000_000
SCAN_S = 300.0
WORKERS = 16


def synthetic_log(requests: int) -> list[tuple[object, int]]:
    """Add, Mark 20 ms later, Free 2 s later; one request every 10 ms, round-robin workers."""
    timed: list[tuple[int, int, object]] = []
    for i in range(requests):
        at = i * 10_000_000
        worker = i % WORKERS
        rid = f"r{i}"
        hashes = [i * 4 + k for k in range(4)]
        add = AddRequest(request_id=rid, worker_id=worker, block_hashes=hashes, prefill_tokens=64)
        timed.append((at, 0, add))
        timed.append((at + 20_000_000, 1, MarkPrefillCompleted(request_id=rid, worker_id=worker)))
        timed.append((at + 2 * NS, 2, Free(request_id=rid, worker_id=worker)))
    timed.sort(key=lambda t: (t[0], t[1]))
    return [(event, at) for at, _, event in timed]


def fold_rate(make: Callable[[], SequenceState], log: list[tuple[object, int]]) -> float:
    state = make()
    apply = state.apply
    started = time.perf_counter()
    for event, at in log:
        apply(event, at)
    return len(log) / (time.perf_counter() - started)


def with_live(make: Callable[[], SequenceState], live: int, at_ns: int) -> SequenceState:
    state = make()
    for i in range(live):
        state.apply(AddRequest(request_id=f"l{i}", worker_id=i % WORKERS, block_hashes=[i]), at_ns)
    return state


def tick_cost_us(make: Callable[[], SequenceState], live: int, repeats: int) -> float:
    """A Tick in the period the requests were added: no scan due."""
    state = with_live(make, live, NS)
    costs = []
    for k in range(repeats):
        started = time.perf_counter()
        state.apply(Tick(), NS + k)
        costs.append(time.perf_counter() - started)
    return statistics.median(costs) * 1e6


def scan_cost_ms(expiring: int, runs: int) -> float:
    """One Tick at the scan that expires ``expiring`` requests added two periods before."""
    scan = round(SCAN_S * NS)
    costs = []
    for _ in range(runs):
        state = with_live(lambda: SequenceState(lease_scan_s=SCAN_S), expiring, scan)
        started = time.perf_counter()
        delta = state.apply(Tick(), 3 * scan)
        costs.append(time.perf_counter() - started)
        assert len(delta.expired) == expiring, len(delta.expired)
    return statistics.median(costs) * 1e3


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    log = synthetic_log(args.requests)
    age: list[float] = []
    lease: list[float] = []
    for _ in range(args.runs):  # alternated: the machine's drift falls on both alike
        age.append(fold_rate(SequenceState, log))
        lease.append(fold_rate(lambda: SequenceState(lease_scan_s=SCAN_S), log))
    result = {
        "events": len(log),
        "fold_age_events_s": round(statistics.median(age)),
        "fold_lease_events_s": round(statistics.median(lease)),
        "lease_over_age": round(ratio(lease, age), 3),
        "tick_no_scan_us_lease": round(
            tick_cost_us(lambda: SequenceState(lease_scan_s=SCAN_S), args.live, 201), 1
        ),
        "tick_no_scan_us_age": round(tick_cost_us(SequenceState, args.live, 201), 1),
        "scan_ms": {n: round(scan_cost_ms(n, args.runs), 2) for n in (1_000, 10_000, 100_000)},
        "live": args.live,
        "runs": args.runs,
        "machine": machine_line(),
        "commit": git_revision(),
    }
    emit(result, args.json, print_fields, indent=None)


if __name__ == "__main__":
    main()
