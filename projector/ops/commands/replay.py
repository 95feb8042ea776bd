"""The log's commands: ``replay`` folds it into a fresh state, ``rebuild`` re-derives the
bucket from it, ``snapshot`` lists, shows and saves the write model's snapshots.

A family because each folds the log the way the writer does (the fold settings, a snapshot to
start from, a progress bar) and prints loads the same way.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.namespaces import require_namespace
from projector.ops.progress_bar import progress_bar
from projector.settings.config import Config
from projector.write.log_fold import iso
from seqstate import LoadRow


def print_loads(rows: list[LoadRow], as_json: bool) -> None:
    from projector.ops.live import plain_table

    if as_json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
    else:
        print(plain_table(rows))


async def cmd_replay(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.replay import verify
    from projector.write.log_fold import log_bounds, parse_at, replay

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        with progress_bar(not args.no_progress, "replay") as progress:
            if args.verify:
                if args.from_seq is not None or args.to_seq is not None or args.at:
                    raise CliError("--verify replays to the bucket's position: no range flags")
                diffs = await verify(nc, config, progress=progress)
                for line in diffs:
                    print(line)
                print(f"{'DIVERGED' if diffs else 'identical'}: {len(diffs)} keys differ")
                return 1 if diffs else 0
            bounds = await log_bounds(nc, config)
            at_ns = parse_at(args.at, bounds.last_ns) if args.at else None
            done = await replay(
                nc,
                config,
                from_seq=args.from_seq,
                to_seq=args.to_seq,
                at_ns=at_ns,
                progress=progress,
                bounds=bounds,
            )
    for name, why in done.skipped:
        print(f"seqstate: skipped snapshot {name}: {why}", file=sys.stderr)
    start = (
        f"snapshot {done.snapshot.name}"
        if done.snapshot
        else f"event {args.from_seq}"
        if args.from_seq
        else "the first event"
    )
    if not args.json:
        print(
            f"replayed {done.events} events from {start} to event {done.last_seq}"
            f" ({done.dead_letters} dead-lettered); loads as of log time "
            f"{iso(done.as_of_ns)}"
        )
    print_loads(done.loads(), args.json)
    return 0


async def cmd_rebuild(args: argparse.Namespace, config: Config) -> int:
    from projector.nats.resources import ensure
    from projector.ops.replay import rebuild

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)  # before provisioning adds it
        await ensure(nc, config)
        with progress_bar(not args.no_progress, "rebuild") as progress:
            done = await rebuild(nc, config, progress=progress)
    print(
        f"rebuilt the bucket of {config.namespace!r} at event {done.last_seq}: "
        f"{len(done.state.workers.slots)} ranks ({done.events} events folded"
        + (f" after snapshot {done.snapshot.name})" if done.snapshot else ")")
    )
    return 0


async def cmd_snapshot(args: argparse.Namespace, config: Config) -> int:
    from projector.nats.snapshots import SnapshotStore
    from projector.write.log_fold import replay
    from seqstate import SnapshotError

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        store = await SnapshotStore(nc, config).open(create=args.action == "save")
        if args.action == "list":
            if not store.exists:  # a read creates nothing, and says what is not there
                raise CliError(
                    f"no snapshots for namespace {config.namespace!r}: object store "
                    f"{config.snapshot_bucket!r} does not exist (no writer has run with it)"
                )
            infos = await store.list()
            if args.json:
                for info in infos:
                    print(
                        msgspec.json.encode(
                            {"name": info.name, "meta": info.meta, "size": info.size}
                        ).decode()
                    )
            else:
                print(f"{'name':<40}{'event':>12}{'bytes':>12}  log time")
                for info in infos:
                    when = iso(info.meta.as_of) if info.meta else "(unreadable description)"
                    print(f"{info.name:<40}{info.applied_seq:>12}{info.size:>12}  {when}")
            return 0
        if args.action == "show":
            infos = await store.list()
            if not infos:
                raise CliError(f"no snapshots for namespace {config.namespace!r}")
            chosen = (
                infos[-1]
                if args.name == "latest"
                else next((i for i in infos if i.name == args.name), None)
            )
            if chosen is None:
                raise CliError(f"no snapshot named {args.name!r}")
            try:
                state = await store.load(chosen)
            except SnapshotError as exc:
                print(f"INVALID: {exc}")
                return 1
            rows = state.registry.loads(state.now_ns)
            if args.json:
                print_loads(rows, True)
            else:
                print(
                    f"{chosen.name}: event {chosen.applied_seq}, log time "
                    f"{iso(state.now_ns)}, {len(state.requests)} requests on "
                    f"{len(state.workers.slots)} ranks; {dict(state.counters)}"
                )
                print_loads(rows, False)
            return 0
        with progress_bar(not args.no_progress, "snapshot") as progress:
            done = await replay(nc, config, progress=progress)
        info = await store.save(done.state.snapshot(), done.last_seq, done.state.now_ns)
        await store.prune(
            config.snapshots_keep, config.snapshot_history_every, config.snapshot_history_keep
        )
        print(f"saved and verified {info.name} ({info.size} bytes, {done.events} events folded)")
    return 0


def add_replay_flags(replay: argparse.ArgumentParser) -> None:
    """Which part of the log to fold, or --verify: the whole of it against the bucket."""
    replay.add_argument(
        "--from-seq",
        type=int,
        metavar="N",
        help="start from an empty state at event N (a partial replay)",
    )
    replay.add_argument("--to-seq", type=int, metavar="M", help="stop after event M")
    replay.add_argument(
        "--at",
        metavar="TIME",
        help="the state at a log time: ISO 8601 (UTC unless it says), or a "
        "time of day HH:MM[:SS] in UTC on the log's newest day (the day "
        "before if that is after the log's newest event)",
    )
    replay.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    replay.add_argument(
        "--verify",
        action="store_true",
        help="compare with the bucket; exit 1 naming differing keys",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_rebuild_flags(rebuild: argparse.ArgumentParser) -> None:
    rebuild.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_snapshot_flags(snapshot: argparse.ArgumentParser) -> None:
    snapshot.add_argument("action", choices=["list", "show", "save"])
    snapshot.add_argument(
        "name",
        nargs="?",
        default="latest",
        metavar="NAME",
        help="for show: a snapshot name (default: latest)",
    )
    snapshot.add_argument("--json", action="store_true", help="machine-readable output")
    snapshot.add_argument("--no-progress", action="store_true", help="no progress bar")


# replay only reads; rebuild and snapshot may create the bucket they write, and snapshot prunes.
REPLAY = Command(
    "replay",
    "fold the log into a fresh state and print per-rank loads",
    cmd_replay,
    flags.READ + flags.FOLD,
    add_replay_flags,
)
REBUILD = Command(
    "rebuild",
    "re-derive the whole bucket from the write model",
    cmd_rebuild,
    flags.READ + flags.PROVISION + flags.FOLD,
    add_rebuild_flags,
)
SNAPSHOT = Command(
    "snapshot",
    "write-model snapshots: list, show, save",
    cmd_snapshot,
    (
        *flags.READ,
        *flags.PROVISION,
        *flags.FOLD,
        "snapshots_keep",
        "snapshot_history_every",
        "snapshot_history_keep",
    ),
    add_snapshot_flags,
)
