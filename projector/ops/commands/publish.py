"""``seqstate publish``: events given as JSON lines, all or nothing.

Every line is decoded and checked (the writer's checks, the size limit) before the first one
is published, so a file with a bad line 40 does not leave 39 events in the log.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

import msgspec

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.wire.config import Config
from seqstate.events import Event


async def cmd_publish(args: argparse.Namespace, config: Config) -> int:
    from projector.route.publisher import RouterPublisher
    from seqstate import EventDecodeError, decode_event, encode_event

    decoder = msgspec.json.Decoder(Event)
    if args.file == "-":
        lines = sys.stdin.buffer.read().splitlines()
        name = "stdin"
    else:
        try:
            lines = Path(args.file).read_bytes().splitlines()
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
        name = args.file
    events: list[tuple[int, Event]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:  # the round trip applies every check the writer applies
            events.append((number, decode_event(encode_event(decoder.decode(line)))))
        except (msgspec.DecodeError, EventDecodeError) as exc:
            raise CliError(f"{name}:{number}: not an event: {exc}") from None
    async with connect(require_url(config), service=False, config=config) as nc:
        from projector.nats.resources import ensure
        from projector.route.publisher import EventTooLarge

        pub = RouterPublisher(
            nc, namespace=config.namespace, router_id=args.router_id, config=config
        )
        for number, event in events:  # all or nothing: sizes are known once connected
            try:
                pub.check(event)
            except EventTooLarge as exc:
                raise CliError(f"{name}:{number}: {exc}") from None
        await ensure(nc, config)
        last = None
        for _, event in events:
            last = await pub.publish(event)
    count = f"{len(events)} event" + ("" if len(events) == 1 else "s")
    print(f"published {count}" + (f", last sequence {last}" if last else ""))
    return 0


def event_reference() -> str:
    """Every event type and its fields, from the schema itself (for ``publish --help``)."""
    lines = [
        'events: one JSON object per line, "type" naming the event; fields with "=" are',
        "optional (their default shown):",
        "",
    ]
    for kind in Event.__args__:
        parts = []
        for info in msgspec.structs.fields(kind):
            if info.required:
                parts.append(info.name)
            else:
                default = info.default if info.default is not msgspec.NODEFAULT else []
                parts.append(f"{info.name}={msgspec.json.encode(default).decode()}")
        text = f"{kind.__name__}: {', '.join(parts) or '(no fields)'}"
        lines += textwrap.wrap(text, 78, initial_indent="  ", subsequent_indent="      ")
    lines += [
        "",
        "example:",
        '  {"type": "AddRequest", "request_id": "r1", "worker_id": 3,',
        '   "block_hashes": [11, 12], "prefill_tokens": 1200}',
        '  {"type": "Free", "request_id": "r1", "worker_id": 3}',
    ]
    return "\n".join(lines)


def add_publish_flags(publish: argparse.ArgumentParser) -> None:
    """The file to read, and the msg-id prefix that makes a re-run's duplicates detectable."""
    publish.add_argument(
        "file", nargs="?", default="-", metavar="FILE", help="JSON lines (default: - reads stdin)"
    )
    publish.add_argument(
        "--router-id",
        default=f"cli-{os.getpid()}",
        metavar="ID",
        help="msg-id prefix, unique per publisher (default: cli-PID)",
    )


PUBLISH = Command(
    "publish",
    "publish events given as JSON lines (a file, or - for stdin)",
    cmd_publish,
    flags.READ + flags.PROVISION,
    add_publish_flags,
    epilog=event_reference,
)
