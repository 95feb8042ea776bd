"""``seqstate publish``: events given as JSON lines, all or nothing.

Every line is decoded and checked (the writer's checks, the size limit) before the first one
is published, so a file with a bad line 40 does not leave 39 events in the log.

Each event's msg-id is ``<router id>:<n>:<tag>``, its tag derived from the events stream's
key (:mod:`projector.wire.msg_ids`): a second run with the same ``--router-id`` meets the
first one's ids and is refused (within the stream's duplicate window). A run interrupted
(Ctrl-C) says how many events it stored; ``--resume`` reads the log for the events the
router id stored, checks that they are the file's first ones, each once, and publishes the
rest under the next ids: after the duplicate window too, nothing is stored twice or skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from projector.nats.connection import close_at_once, connect, refused_or, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.settings.config import Config
from seqstate.events import Event

log = logging.getLogger("seqstate")
EXIT_INTERRUPTED = 130  # a shell's code for a command ended by SIGINT

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.api import StreamInfo

    from projector.route.publisher import PublishError, RouterPublisher


async def cmd_publish(args: argparse.Namespace, config: Config) -> int:
    """:func:`_publish`, stopped by the first Ctrl-C only: a second one that came before the
    first was handled raised KeyboardInterrupt wherever the loop stood, cutting the line that
    says what was stored (or a clean-up, with a traceback)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            task.cancel()

    loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        return await _publish(args, config)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        task.uncancel()
        return EXIT_INTERRUPTED
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if interrupted:  # the process ends now: another Ctrl-C would only cut its exit short
            signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _publish(args: argparse.Namespace, config: Config) -> int:
    from projector.route.publisher import PublishError, RouterPublisher, quoted_router_id
    from seqstate import EventDecodeError, decode_event, encode_event

    if args.resume and args.router_id is None:
        raise CliError("--resume: give the --router-id of the run to resume")
    router_id = f"cli-{os.getpid()}" if args.router_id is None else args.router_id
    try:
        quoted_router_id(router_id)
    except ValueError as exc:
        raise CliError(f"--router-id: {exc}") from None
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
        run: _Run | None = None
        stored: int | None = None if args.resume else 0  # None: the log not checked yet
        try:
            from projector.nats.resources import ensure, msg_id_key, resource_names
            from projector.route.publisher import EventTooLarge

            probe = RouterPublisher(
                nc, namespace=config.namespace, router_id=router_id, config=config
            )
            checked = []
            for number, event in events:  # all or nothing: sizes are known once connected
                try:
                    checked.append(probe.check(event))
                except EventTooLarge as exc:
                    raise CliError(f"{name}:{number}: {exc}") from None
            info = await _events_stream_info(nc, config)
            if info is None:
                # a fresh server: provision, as the pipeline would
                info = (await ensure(nc, config)).events
            key = msg_id_key(info)
            if key is None:
                log.warning(
                    "stream %s has no msg-id key yet (a writer of this version adds it): a second "
                    "run with this router id will not be recognised",
                    config.events_stream,
                )
            names = resource_names(config)
            earlier = 0
            if args.resume:
                earlier = stored = await refused_or(
                    nc,
                    stored_before(nc, config, probe, checked, [n for n, _ in events], name),
                    user=config.nats_user,
                    doing="reading the events already stored",
                    names=names,
                )
            pub = RouterPublisher(
                nc,
                namespace=config.namespace,
                router_id=router_id,
                config=config,
                msg_id_key=key,
                router_seq=earlier,
            )
            run = _Run(pub, [event for event, _ in checked[earlier:]])
            try:
                await refused_or(
                    nc,
                    run.publish_all(),
                    user=config.nats_user,
                    doing="publishing events",
                    names=names,
                )
            except PublishError as exc:
                raise CliError(_refusal(exc, name, router_id, earlier + run.done)) from None
        except asyncio.CancelledError:  # Ctrl-C: say what is stored, and how to go on
            said = _interrupted(name, router_id, stored, run, len(events))
            print(f"seqstate: {said}", file=sys.stderr)
            await close_at_once(nc)  # a drain would wait for a read of the log called off
            raise
    count = f"{run.done} event" + ("" if run.done == 1 else "s")
    before = f" ({stored} already stored)" if args.resume else ""
    print(f"published {count}{before}" + (f", last sequence {run.last}" if run.last else ""))
    return 0


class _Run:
    """The events of a run, published one after another; how far it got."""

    def __init__(self, pub: RouterPublisher, events: list[Event]) -> None:
        self.pub = pub
        self.events = events
        self.done = 0  # stored, in order
        self.last: int | None = None

    async def publish_all(self) -> None:
        """Each in turn (each awaited: stored in the given order)."""
        for event in self.events:
            self.last = await self.pub.publish(event)
            self.done += 1


def _resume_hint(name: str, router_id: str) -> str:
    shown = "FILE" if name == "stdin" else shlex.quote(name)
    return f"seqstate publish {shown} --router-id {shlex.quote(router_id)} --resume"


def _interrupted(
    name: str, router_id: str, stored: int | None, run: _Run | None, total: int
) -> str:
    """What an interrupted run leaves: said whenever it is stopped, publishing or not yet."""
    hint = f"`{_resume_hint(name, router_id)}` checks them and publishes the rest"
    if stored is None:  # --resume, before the log was checked
        return (
            f"interrupted before checking the events router id {router_id!r} stored earlier: "
            f"none of {name} published by this run; {hint}"
        )
    if run is None:
        if not stored:
            return f"interrupted before publishing: none of the {total} events of {name} stored"
        return (
            f"interrupted before publishing: {stored} of {total} events of {name} stored "
            f"(router id {router_id!r}, by an earlier run); {hint}"
        )
    return (
        f"interrupted: {stored + run.done} of {total} events of {name} stored (router id "
        f"{router_id!r}; the next one may be too); {hint}"
    )


def _refusal(exc: PublishError, name: str, router_id: str, stored: int) -> str:
    """A publish refused: a router id already used is said with the way to go on."""
    if exc.taken_at is None or exc.squatted:
        return str(exc)
    return (
        f"router id {router_id!r} already stored events (msg-id {exc.msg_id} is at stream "
        f"sequence {exc.taken_at}; {stored} stored by this run): "
        f"`{_resume_hint(name, router_id)}` publishes the rest of {name} once it has checked "
        "that they are its own; or choose another --router-id"
    )


async def stored_before(
    nc: Client,
    config: Config,
    pub: RouterPublisher,
    checked: list[tuple[Event, bytes]],
    lines: list[int],
    name: str,
) -> int:
    """How many of the file's events (in order) an earlier run with this router id stored.

    The log says, whatever the duplicate window: every stored message whose msg-id names the
    router id is its event ``n``, which must be the file's own (same subject, same bytes),
    and they must be the file's first ``n`` events, each stored once: else this is no run of
    this file, and nothing is published."""
    from projector.nats.stream import first_seq_of, last_seq_of
    from projector.wire.headers import MSG_ID
    from projector.wire.msg_ids import router_of

    js = nc.jetstream()
    stream, subjects = config.events_stream, config.events_subjects
    first, last = await first_seq_of(js, stream, subjects), await last_seq_of(js, stream, subjects)
    found: dict[int, int] = {}
    if last:
        async for seq, subject, headers, data in _messages(nc, config, first, last):
            parsed = router_of((headers or {}).get(MSG_ID, ""))
            if parsed is None or parsed[0] != pub.router_id:
                continue
            n = parsed[1]
            if n in found:
                raise CliError(
                    f"router id {pub.router_id!r} stored its event {n} twice (stream sequences "
                    f"{found[n]} and {seq}): not resuming"
                )
            if n > len(checked) or (subject, data) != (
                pub.subject_for(checked[n - 1][0]),
                checked[n - 1][1],
            ):
                where = f"{name}:{lines[n - 1]}" if n <= len(checked) else f"beyond {name}"
                raise CliError(
                    f"router id {pub.router_id!r} stored, as its event {n} (stream sequence "
                    f"{seq}), another event than {where}: not a run of this file, not resuming"
                )
            found[n] = seq
    stored = len(found)
    if sorted(found) != list(range(1, stored + 1)):
        missing = next(n for n in range(1, stored + 1) if n not in found)
        raise CliError(
            f"router id {pub.router_id!r} stored events of {name} but not its event {missing}: "
            "not resuming"
        )
    return stored


async def _messages(
    nc: Client, config: Config, first: int, last: int
) -> AsyncIterator[tuple[int, str, dict[str, str] | None, bytes]]:
    """The namespace's events ``first..last``: sequence, subject, headers, payload."""
    from nats.js import api

    from projector.nats.stream import log_time_ns

    sub = await nc.jetstream().subscribe(
        config.events_subjects,
        stream=config.events_stream,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        config=api.ConsumerConfig(opt_start_seq=first),
    )
    task = asyncio.current_task()
    try:
        while True:
            msg = await sub.next_msg(timeout=30)
            if task is not None and task.cancelling():
                # nats-py waits with asyncio.wait_for, which drops a cancellation that comes as
                # a message does (Python 3.11): Ctrl-C then went unheard until the log was read
                raise asyncio.CancelledError
            seq = log_time_ns(msg)[0]
            yield seq, msg.subject, msg.headers, msg.data
            if seq >= last:
                return
    finally:
        await sub.unsubscribe()


async def _events_stream_info(nc: Client, config: Config) -> StreamInfo | None:
    """The events stream's info if it exists and takes this namespace's subjects.

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
        return None
    return info if config.events_subjects in (info.config.subjects or []) else None


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
        default=None,
        metavar="ID",
        help="the router id in each event's msg-id: a second run with the same one is "
        "refused, within the stream's duplicate window (default: cli-PID)",
    )
    publish.add_argument(
        "--resume",
        action="store_true",
        help="go on with an interrupted run of this FILE and --router-id: check, in the log, "
        "that the events it stored are the file's first ones, then publish the rest",
    )


PUBLISH = Command(
    "publish",
    "publish events given as JSON lines (a file, or - for stdin)",
    cmd_publish,
    flags.READ + flags.PROVISION,
    add_publish_flags,
    epilog=event_reference,
)
