"""What folding Dynamo's own bytes costs, against the same lifecycle as seqstate's events.

A Dynamo message goes through the one fold like any event, with two more msgpack levels to
decode (the envelope, then its payload), a per-publisher sequence count, and a seqstate event
built from it. This replays the real capture (tests/data/replica-sync-1.6.1.jsonl, 155
messages of two frontends and two workers) through :class:`seqstate.Fold` on the namespace's
capture subject, and the same lifecycle encoded as seqstate's own events on their ranks'
subjects, and prints the best of 5 runs in microseconds per message. In process, no NATS.

Run from the repository root: ``.venv/bin/python benchmarks/dynamo_fold.py [--rounds N]``.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from harness.cli import argument_parser

import seqstate.state
from seqstate import Fold, FoldRules, SequenceState, encode_event
from seqstate.dynamo import captured_subject, core_event, decode_dynamo
from seqstate.fold import subject_of

CAPTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "replica-sync-1.6.1.jsonl"
NS = "bench"


def per_message_us(messages: list[tuple[str, bytes]], rounds: int) -> float:
    """Best of 5: a fresh state each run; the capture drains, so its rounds repeat alike."""
    best = float("inf")
    for _ in range(5):
        fold = Fold(SequenceState(), FoldRules(NS))
        seq = 0
        start = time.perf_counter()
        for _ in range(rounds):
            for subject, payload in messages:
                seq += 1
                fold(seq, seq, subject, payload)
        best = min(best, (time.perf_counter() - start) / (rounds * len(messages)))
    return best * 1e6


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=200, help="folds of the capture per run")
    args = parser.parse_args()
    rows = [json.loads(line) for line in CAPTURE.read_text().splitlines()]
    subject = captured_subject(NS, "dynamo.backend.generate")
    dynamo = [(subject, base64.b64decode(row["data_b64"])) for row in rows]
    own = []
    for _, data in dynamo:
        event = core_event(decode_dynamo(data))
        own.append((subject_of(NS, event), encode_event(event)))
    compiled = (seqstate.state.__file__ or "").endswith(".so")
    print(f"core: {'compiled' if compiled else 'pure Python'}")
    print(f"Dynamo's bytes:   {per_message_us(dynamo, args.rounds):.2f} us/message")
    print(f"seqstate events:  {per_message_us(own, args.rounds):.2f} us/message")


if __name__ == "__main__":
    main()
