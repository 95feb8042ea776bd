"""The ``seqstate`` command line. The NATS pipeline commands arrive with the pipeline."""

from __future__ import annotations

import argparse
import sys

from seqstate import SCHEMA_VERSION


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seqstate", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the event schema version")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run", help="writer + projector (+ --demo router); not built yet")
    args, _ = parser.parse_known_args(argv)
    if args.version:
        print(f"seqstate event schema {SCHEMA_VERSION}")
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    print(
        f"seqstate: '{args.command}' is not available yet (the NATS pipeline is issue #3)",
        file=sys.stderr,
    )
    return 2
