"""``seqstate status``: the streams, the consumers, the bucket's position and the lag."""

from __future__ import annotations

import argparse

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import Command
from projector.ops.namespaces import require_namespace
from projector.settings.config import Config


async def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.status import collect, format_status

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        report = await collect(nc, config)
    print(msgspec.json.encode(report).decode() if args.json else format_status(report))
    return 0


def add_status_flags(status: argparse.ArgumentParser) -> None:
    status.add_argument("--json", action="store_true", help="one JSON object")


# It tells a lagging consumer apart by the thresholds its warnings use.
STATUS = Command(
    "status",
    "streams, consumers, the bucket's position and the lag",
    cmd_status,
    flags.READ + flags.BEHIND,
    add_status_flags,
)
