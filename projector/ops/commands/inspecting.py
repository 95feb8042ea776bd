"""``seqstate inspect``: one request's story, or one worker's ranks (named ``inspecting`` so
as not to shadow the standard library's ``inspect``)."""

from __future__ import annotations

import argparse

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.namespaces import require_namespace
from projector.ops.progress_bar import progress_bar
from projector.settings.config import Config


async def cmd_inspect(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.inspection import inspect_request, inspect_worker

    if args.what == "worker":
        try:
            worker_id = int(args.id)
        except ValueError:
            raise CliError(f"inspect worker {args.id}: not a worker id (an integer)") from None
        if worker_id < 0:
            raise CliError(f"inspect worker {args.id}: not a worker id (an integer >= 0)")
        async with connect(
            require_url(config), service=False, config=config, fail_on_refusal=True
        ) as nc:
            await require_namespace(nc, config)
            report = await inspect_worker(nc, config, worker_id)
        print(msgspec.json.encode(report.as_dict()).decode() if args.json else report.text())
        return 0
    if args.window < 1:
        raise CliError(f"--window {args.window}: must be at least 1")
    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        with progress_bar(not args.no_progress, "searching the log") as progress:
            done = await inspect_request(
                nc, config, args.id, since_seq=args.since_seq, window=args.window, progress=progress
            )
    print(msgspec.json.encode(done.as_dict()).decode() if args.json else done.text())
    # A request no event names is an answer of "not found", as grep's: the report still says
    # which sequences were searched, and the exit code lets a script tell it from a story.
    return 1 if done.state == "unknown" else 0


def add_inspect_flags(inspect: argparse.ArgumentParser) -> None:
    """What to inspect, and how far back to look for a request the bucket no longer holds."""
    inspect.add_argument("what", choices=["request", "worker"])
    inspect.add_argument("id", metavar="ID", help="a request id, or a worker id")
    inspect.add_argument(
        "--since-seq",
        type=int,
        metavar="N",
        help="for a request not in the bucket: look for its events from "
        "event N on (default: the newest --window events)",
    )
    inspect.add_argument(
        "--window",
        type=int,
        default=100_000,
        metavar="N",
        help="for a request not in the bucket: how many of the newest events "
        "to look through (default: 100000)",
    )
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar")


def _examples() -> str:
    return (
        "examples:\n  seqstate inspect request req-1\n"
        "  seqstate inspect request req-1 --since-seq 1   # the whole log\n"
        "  seqstate inspect worker 3 --json"
    )


INSPECT = Command(
    "inspect",
    "one request's owner, state and events; one worker's ranks",
    cmd_inspect,
    flags.READ,
    add_inspect_flags,
    epilog=_examples,
)
