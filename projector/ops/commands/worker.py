"""``seqstate worker``: the control plane, adding, removing and listing workers."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
from nats.js.errors import BucketNotFoundError

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.inspection import no_bucket
from projector.ops.namespaces import require_namespace
from projector.settings.config import Config


async def cmd_worker(args: argparse.Namespace, config: Config) -> int:
    from projector.control.workers import WorkerControl

    if args.action == "list":
        if args.worker_id is not None:
            raise CliError("worker list takes no WORKER_ID")
    elif args.worker_id is None:
        raise CliError(f"worker {args.action} needs a WORKER_ID")
    worker_id = int(args.worker_id or 0)
    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        control = WorkerControl(nc, config=config, wait_s=args.wait)
        if args.action == "list":
            await require_namespace(nc, config)
            try:  # a bucket that is not there holds no "0 workers"
                await nc.jetstream().key_value(config.registry_bucket)
            except BucketNotFoundError:
                raise no_bucket(config) from None
            workers = await control.workers()
            if args.json:
                for worker in workers:
                    print(msgspec.json.encode(worker).decode())
            else:
                print(worker_table(workers))
            return 0
        from projector.nats.resources import ensure

        await ensure(nc, config)
        if args.action == "add":
            change = await control.add(
                worker_id, args.dp_start, args.dp_size, block_size=args.block_size
            )
            done = f"ranks {ranks_text(change.dp_ranks)} in the registry"
        else:
            change = await control.remove(worker_id)
            done = "removed from the registry"
            if config.dynamo_endpoints:  # removed for good (WorkerControl.remove)
                done += f", for good: its late requests are refused until `worker add {worker_id}`"
    if change.applied:
        print(f"worker {change.worker_id}: {done} (event {change.seq})")
    elif args.wait <= 0:  # asked not to wait: stored is all it can say
        print(f"worker {change.worker_id}: stored as event {change.seq} (not waited for)")
    else:
        # Stored but not seen folded: "added" would be a promise nobody checked (exit 1, so a
        # script does not go on to route to a worker no scheduler can see yet).
        raise CliError(
            f"worker {change.worker_id}: stored as event {change.seq}, but the registry did "
            f"not show it within {args.wait:g}s: is the pipeline (seqstate run, or writer and "
            "projector) running? It is applied when it runs"
        )
    return 0


def ranks_text(ranks: list[int]) -> str:
    """``0-3``, ``5``, or ``0,2,7``: a worker's ranks as an operator reads them."""
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def worker_table(workers: list[Any]) -> str:
    lines = [f"{'worker':>10} {'ranks':>10} {'requests':>9} {'blocks':>9} {'prefill tok':>12}"]
    for w in workers:
        lines.append(
            f"{w.worker_id:>10} {ranks_text(w.dp_ranks):>10} {w.active_requests:>9} "
            f"{w.active_blocks:>9} {w.prefill_tokens:>12}"
        )
    lines.append(f"{len(workers)} worker" + ("" if len(workers) == 1 else "s"))
    return "\n".join(lines)


def add_worker_flags(worker: argparse.ArgumentParser) -> None:
    worker.add_argument("action", choices=["add", "remove", "list"])
    worker.add_argument(
        "worker_id",
        nargs="?",
        type=int,
        metavar="WORKER_ID",
        help="for add and remove: the worker's id",
    )
    worker.add_argument(
        "--dp-start",
        type=int,
        default=0,
        metavar="N",
        help="for add: its first data-parallel rank (default: 0)",
    )
    worker.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="for add: how many data-parallel ranks (default: 1)",
    )
    worker.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help="for add: tokens per KV block, recorded as the namespace's (default: none named)",
    )
    worker.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="wait this long for the registry to show the change, else fail; 0: do not wait "
        "(default: 10)",
    )
    worker.add_argument("--json", action="store_true", help="for list: JSON lines")


def _examples() -> str:
    return (
        "examples:\n  seqstate worker add 7 --dp-size 2 --block-size 16\n"
        "  seqstate worker remove 7\n  seqstate worker list"
    )


# An add is refused beyond the writer's limit on ranks per worker: the same limit, told early.
WORKER = Command(
    "worker",
    "the control plane: add, remove or list workers",
    cmd_worker,
    (*flags.READ, *flags.PROVISION, *flags.DYNAMO, "max_ranks_per_worker"),
    add_worker_flags,
    epilog=_examples,
)
