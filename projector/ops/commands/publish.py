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
from typing import TYPE_CHECKING

import msgspec

from projector.nats.connection import connect, refused_or, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.wire.config import Config
from seqstate.events import Event

if TYPE_CHECKING:
    from nats.aio.client import Client

    from projector.route.publisher import RouterPublisher


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
    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        from projector.nats.resources import ensure, resource_names
        from projector.route.publisher import EventTooLarge

        pub = RouterPublisher(
            nc, namespace=config.namespace, router_id=args.router_id, config=config
        )
        for number, event in events:  # all or nothing: sizes are known once connected
            try:
                pub.check(event)
            except EventTooLarge as exc:
                raise CliError(f"{name}:{number}: {exc}") from None
        if not await _events_stream_takes(nc, config):
            await ensure(nc, config)  # a fresh server: provision, as the pipeline would
        last = await refused_or(
            nc,
            _publish_all(pub, [event for _, event in events]),
            user=config.nats_user,
            doing="publishing events",
            names=resource_names(config),
        )
    count = f"{len(events)} event" + ("" if len(events) == 1 else "s")
    print(f"published {count}" + (f", last sequence {last}" if last else ""))
    return 0


async def _events_stream_takes(nc: Client, config: Config) -> bool:
    """Whether the events stream exists and takes this namespace's subjects.

    Then ``publish`` provisions nothing: a router (deploy/nats-roles.conf's ``router``) may
    read that one stream's info but not the JetStream account or the other streams, which
    ``ensure`` reads. Otherwise ``ensure`` provisions, as on a fresh server; a user that may
    not gets one line naming the subject it was refused.
    """
    from nats.js.errors import NotFoundError

    from projector.nats.resources import resource_names

    try:
        info = await refused_or(
            nc,
            nc.jetstream().stream_info(config.events_stream),
            user=config.nats_user,
            doing="looking up the events stream",
            names=resource_names(config),
        )
    except NotFoundError:
        return False
    return config.events_subjects in (info.config.subjects or [])


async def _publish_all(pub: RouterPublisher, events: list[Event]) -> int | None:
    """Each in turn (each awaited: stored in the given order); the last one's sequence."""
    last = None
    for event in events:
        last = await pub.publish(event)
    return last


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
