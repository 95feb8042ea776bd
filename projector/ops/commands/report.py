"""``seqstate report``: the namespace's log as one self-contained HTML page of charts
(:mod:`projector.ops.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.namespaces import require_namespace
from projector.ops.progress_bar import progress_bar
from projector.ops.ui.page import MAX_POINTS
from projector.settings.config import Config


async def cmd_report(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.report import check_writable, report

    check_writable(args.out)
    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        with progress_bar(not args.no_progress, "report") as progress:
            done = await report(nc, config, since=args.since, until=args.until, progress=progress)
    page = done.page(config.namespace)
    try:
        args.out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {args.out} ({len(page):,} bytes, {len(done.points)} points per series)")
    return 0


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help=f"the HTML page to write: self-contained, at most {MAX_POINTS + 2} points per series",
    )
    when = (
        "ISO 8601 (UTC unless it says), a time of day HH:MM[:SS] on the log's newest day, or "
        "before the log's newest event: --since=-5m (s, m, h or d)"
    )
    parser.add_argument("--since", metavar="WHEN", help=f"from (default: the first event); {when}")
    parser.add_argument(
        "--until", metavar="WHEN", help="to (default: the newest event); as --since"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


REPORT = Command(
    "report",
    "write the namespace's log as one HTML page of charts (loads, events/s, faults)",
    cmd_report,
    flags.READ + flags.FOLD,
    add_report_flags,
)
