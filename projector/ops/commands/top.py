"""``seqstate top``: workers with their add and free rates, live or once."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.commands.signals import catch_signals, until_signal
from projector.ops.namespaces import require_namespace
from projector.settings.config import Config


async def cmd_top(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.top import CountingView, events_per_s, plain, render, sample, worker_rows

    if args.interval <= 0:
        raise CliError(f"--interval {args.interval:g}: must be positive")
    catch_signals()
    # Live, it rides out a NATS restart as watch does; --once is a one-shot read that fails fast.
    async with connect(
        require_url(config), service=not args.once, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config)
        view = CountingView(nc, config=config)
        async with view:
            view.reset_counts()  # what the start delivered is the state, not traffic

            def emit(before: Any, now: Any) -> None:
                rows = worker_rows(view, before, now)
                if args.json:
                    for row in rows:
                        print(msgspec.json.encode(row).decode(), flush=True)
                else:
                    print(
                        plain(rows, now.applied_seq, events_per_s(before, now)) + "\n", flush=True
                    )

            async def loop() -> None:
                before = sample(view)
                if args.once:
                    await asyncio.sleep(args.interval)
                    emit(before, sample(view))
                    return
                if args.json or not sys.stdout.isatty():
                    while True:
                        await asyncio.sleep(args.interval)
                        now = sample(view)
                        emit(before, now)
                        before = now
                from rich.console import Console
                from rich.live import Live

                title = f"seqstate top · {config.namespace}"
                with Live(console=Console(), auto_refresh=False) as live:
                    prev: Any = None
                    while True:
                        now = sample(view)
                        live.update(
                            render(
                                worker_rows(view, prev, now),
                                title,
                                now.applied_seq,
                                events_per_s(prev, now),
                            ),
                            refresh=True,
                        )
                        prev = now
                        await asyncio.sleep(args.interval)

            await until_signal(loop(), duration=args.duration)
    return 0


def add_top_flags(top: argparse.ArgumentParser) -> None:
    top.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between refreshes; the rates are over this (default: 1)",
    )
    top.add_argument(
        "--once", action="store_true", help="print one table (rates over one interval) and exit"
    )
    top.add_argument("--json", action="store_true", help="JSON lines, one per worker")
    top.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after this many seconds"
    )


TOP = Command(
    "top",
    "a live table of workers with their add and free rates",
    cmd_top,
    flags.READ,
    add_top_flags,
)
