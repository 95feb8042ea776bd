"""``seqstate loads`` and ``seqstate watch``: every rank's load from the registry bucket, once
or as it changes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
from typing import Any

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import Command
from projector.ops.commands.signals import catch_signals, until_signal
from projector.ops.namespaces import known, require_namespace
from projector.settings.config import Config

_TIME_AGO = re.compile(r"^-\d+(\.\d+)?(ms|s|m|h|d)?$|^-\d*\.\d+$")


async def cmd_loads(args: argparse.Namespace, config: Config) -> int:
    if args.at is not None:
        return await loads_at(args, config)
    from projector.bucket.reader import RegistryView
    from projector.ops.live import plain_table, staleness_said

    async with (
        connect(require_url(config), service=False, config=config, fail_on_refusal=True) as nc,
        known(nc, config),
        RegistryView(nc, config=config) as view,
    ):
        rows = view.loads()
        staleness = view.staleness()
    if args.json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
    else:
        print(plain_table(rows))
        print(f"as of event {staleness.applied_seq}; {staleness_said(staleness)}")
    return 0


async def loads_at(args: argparse.Namespace, config: Config) -> int:
    """``--at WHEN``: the loads replayed to that moment, in the live command's format; the
    moment they reflect under the table, or on stderr beside ``--json``'s lines."""
    from projector.ops.commands.replay import print_loads
    from projector.ops.loads_at import loads_at

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        answer = await loads_at(nc, config, args.at)
    for name, why in answer.replayed.skipped:
        print(f"seqstate: skipped snapshot {name}: {why}", file=sys.stderr)
    print_loads(answer.replayed.loads(), args.json)
    print(answer.said, file=sys.stderr if args.json else sys.stdout)
    return 0


async def cmd_watch(args: argparse.Namespace, config: Config) -> int:
    """A live table in a terminal; elsewhere (or with --json) a record per change, flushed."""
    from projector.bucket.reader import RegistryView

    catch_signals()
    async with (
        connect(require_url(config), service=True, config=config, fail_on_refusal=True) as nc,
        known(nc, config),
        RegistryView(nc, config=config) as view,
    ):
        if args.json or not sys.stdout.isatty():
            await until_signal(print_changes(view, args.json), duration=args.duration)
            return 0
        from rich.console import Console
        from rich.live import Live

        from projector.ops.live import render, staleness_said

        console = Console()

        async def refresh() -> None:
            with Live(console=console, auto_refresh=False) as live:
                while True:
                    s = view.staleness()
                    stats = {
                        "applied seq": s.applied_seq,
                        "age": f"{s.age_s:.1f}s",
                        "view": staleness_said(s),
                    }
                    live.update(
                        render(view.loads(), title=f"seqstate · {config.namespace}", stats=stats),
                        refresh=True,
                    )
                    await asyncio.sleep(0.25)

        await until_signal(refresh(), duration=args.duration)
    return 0


async def print_changes(view: Any, as_json: bool) -> None:
    """Until cancelled: each rank whose load changed as one JSON line (a removed rank as
    ``{"worker_id", "dp_rank", "removed": true}``), or the whole table after each change;
    every line flushed as it is written. The first output is the current state."""
    from projector.ops.live import plain_table

    last: dict[tuple[int, int], Any] = {}
    first = True
    while True:
        registry = view.registry
        current = {rank: registry.load_of(rank) for rank in registry.ranks()}
        changed = [rank for rank, load in current.items() if last.get(rank) != load]
        removed = [rank for rank in last if rank not in current]
        if changed or removed or first:
            seq = view.applied_seq
            rows = view.loads()
            if as_json:
                by_rank = {(r.worker_id, r.dp_rank): r for r in rows}
                for rank in sorted(changed):
                    record = {**msgspec.structs.asdict(by_rank[rank]), "applied_seq": seq}
                    print(msgspec.json.encode(record).decode(), flush=True)
                for rank in sorted(removed):
                    print(
                        msgspec.json.encode(
                            {
                                "worker_id": rank[0],
                                "dp_rank": rank[1],
                                "removed": True,
                                "applied_seq": seq,
                            }
                        ).decode(),
                        flush=True,
                    )
            else:
                print(plain_table(rows) + f"\nas of event {seq}\n", flush=True)
        first = False
        last = current
        with contextlib.suppress(TimeoutError):
            await view.wait_for(view.applied_seq + 1, timeout=0.5)


def add_loads_flags(loads: argparse.ArgumentParser) -> None:
    loads.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    loads.add_argument(
        "--at",
        metavar="WHEN",
        help="the loads as the ledger held them at WHEN, replayed from the log: seq:N (after "
        "stream position N), an ISO 8601 time (UTC unless it says), a time of day HH:MM[:SS] "
        "(UTC, the log's newest day), or a time ago: -30s, -5m, -2h, -1d",
    )
    # argparse reads "-5m" as an unknown flag; a time ago is a value of --at, as a negative
    # number would be.
    loads._negative_number_matcher = _TIME_AGO


def add_watch_flags(watch: argparse.ArgumentParser) -> None:
    watch.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after this many seconds"
    )
    watch.add_argument(
        "--json", action="store_true", help="one JSON object per changed rank, as it changes"
    )


LOADS = Command(
    "loads",
    "print every rank's load from the registry bucket",
    cmd_loads,
    flags.READ + flags.FOLD,
    add_loads_flags,
)
WATCH = Command(
    "watch", "a live table of the registry bucket", cmd_watch, flags.READ, add_watch_flags
)
