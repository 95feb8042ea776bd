"""Instructions per folded event, counted by valgrind's callgrind: a figure that repeats.

Wall-clock rates on these shared 2-core VMs swing by ±25% from one run to the next, which is
more than most optimisations are worth. An instruction count does not: the same code and the
same events execute the same instructions. This script runs the trace fold of
``benchmarks/fold.py`` (a) under callgrind twice, once folding and once only building the
events, and divides the difference by the number of events. Compare it before and after a
change to the hot path; quote ``fold.py`` for the rate users see.

Run from the repository root: ``.venv/bin/python benchmarks/icount.py [--requests N]``.
Needs ``valgrind`` (Debian package ``valgrind``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fold  # the sibling benchmark script: same state setup
from harness import workload
from harness.cli import argument_parser


def build_and_fold(trace: Path, requests: int, workers: int, do_fold: bool) -> None:
    records = workload.load_trace(trace)[:requests]
    lifecycles = workload.lifecycles(records)
    events = workload.round_robin_events(lifecycles, workload.timeline(lifecycles), workers)
    state = fold.new_state(workers)
    if do_fold:
        apply = state.apply
        for at_ns, event in events:
            apply(event, at_ns)


def count(argv: list[str]) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0")
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    match = re.search(r"Collected : (\d+)", run.stderr)
    if match is None:
        raise SystemExit(f"icount: no callgrind total in valgrind's output:\n{run.stderr[-500:]}")
    return int(match.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("--trace", type=Path, default=workload.DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=2000, help="first N trace requests")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--inner", choices=["fold", "build"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        build_and_fold(args.trace, args.requests, args.workers, args.inner == "fold")
        return 0
    if not args.trace.is_file():
        print(f"icount: trace not found: {args.trace}", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None:
        print("icount: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    base = [
        sys.executable,
        __file__,
        "--trace",
        str(args.trace),
        "--requests",
        str(args.requests),
        "--workers",
        str(args.workers),
    ]
    folded = count([*base, "--inner", "fold"])
    built = count([*base, "--inner", "build"])
    events = 3 * min(args.requests, len(workload.load_trace(args.trace)))
    print(
        f"fold: {(folded - built) / events:,.0f} instructions per event "
        f"({events:,} events of the first {args.requests:,} requests, "
        f"{args.workers} workers round-robin; valgrind callgrind, PYTHONHASHSEED=0)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
