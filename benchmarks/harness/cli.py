"""The flags most benchmarks take, spelled and checked once."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.workload import DEFAULT_TRACE


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of the script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0] or None)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document instead")


def add_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (Mooncake)")
