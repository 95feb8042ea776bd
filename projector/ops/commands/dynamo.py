"""``seqstate dynamo resync``: tell Dynamo's router replicas the requests in flight;
``seqstate dynamo uncapture``: take endpoints out of a namespace's capture."""

from __future__ import annotations

import argparse

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.namespaces import require_namespace
from projector.settings.config import Config


async def cmd_dynamo(args: argparse.Namespace, config: Config) -> int:
    if args.action == "uncapture":
        return await cmd_uncapture(config)
    from projector.dynamo.resync import ResyncError, resync
    from projector.dynamo.uncapture import UncaptureError, require_captured

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        try:
            await require_captured(nc, config, config.dynamo_endpoints)
            done = await resync(nc, config)
        except (ResyncError, UncaptureError) as exc:
            raise CliError(str(exc)) from None
    endpoints = ", ".join(config.dynamo_endpoints)
    print(
        f"resynced {done.requests} requests in flight ({done.marked} with their prefill "
        f"done) of namespace {config.namespace!r} to {endpoints}, as Dynamo publisher "
        f"{done.publisher_id}; the log at event {done.last_seq}"
        + (f"; {done.skipped} skipped (ended, or not Dynamo's)" if done.skipped else "")
        + (f"; {done.freed} ended meanwhile, their Free sent again" if done.freed else "")
    )
    return 0


async def cmd_uncapture(config: Config) -> int:
    from projector.dynamo.uncapture import UncaptureError, uncapture

    async with connect(
        require_url(config), service=False, config=config, fail_on_refusal=True
    ) as nc:
        await require_namespace(nc, config, log=True)
        try:
            done = await uncapture(nc, config, config.dynamo_endpoints)
        except UncaptureError as exc:
            raise CliError(str(exc)) from None
    ns = config.namespace
    for endpoint, events in done.removed.items():
        its = (
            "event, and replay still folds it"
            if events == 1
            else "events, and replay still folds them"
        )
        print(
            f"uncaptured Dynamo endpoint {endpoint} of namespace {ns!r}: the log keeps its "
            f"{events:,} {its}"
        )
    if done.deleted:
        print(f"stream {done.stream} deleted: namespace {ns!r} captures no Dynamo endpoint")
    else:
        print(f"still captured: {', '.join(done.kept)}")
    print(
        "a seqstate process still given it (--dynamo-endpoint, SEQSTATE_DYNAMO_ENDPOINT) "
        "captures it again when it next provisions (run: at every start): take it out there "
        "first"
    )
    return 0


def add_dynamo_flags(dynamo: argparse.ArgumentParser) -> None:
    dynamo.add_argument("action", choices=["resync", "uncapture"])


def _examples() -> str:
    return (
        "examples:\n  seqstate dynamo resync --namespace prod --dynamo-endpoint "
        "dynamo.backend.generate\n\n"
        "resync republishes, in Dynamo's wire format, each request in flight of the\n"
        "namespace's Dynamo endpoints (its AddRequest as routed, and its\n"
        "MarkPrefillCompleted if its prefill is done), so that a router replica started\n"
        "after they were routed counts them as its peers do; then it waits for the log to\n"
        "show what it sent, and sends the Free again of each request that ended\n"
        "meanwhile, so no replica keeps a request the ledger has freed. Run it after\n"
        "starting a frontend; the ledger ignores its own republished messages.\n\n"
        "  seqstate dynamo uncapture --namespace prod --dynamo-endpoint dynamo.backend.generat\n\n"
        "uncapture takes the endpoints given (all of the namespace's when none is)\n"
        "out of its capture: JetStream stops storing what Dynamo publishes there; the\n"
        "last one gone, the capture stream is deleted. The log keeps their events.\n"
        "A process still given the endpoint captures it again when it next provisions\n"
        "(seqstate run: at every start): take it out of its flags first."
    )


DYNAMO = Command(
    "dynamo",
    "Dynamo's routers: resync a late replica; uncapture an endpoint",
    cmd_dynamo,
    flags.READ + flags.FOLD + flags.DYNAMO,
    add_dynamo_flags,
    epilog=_examples,
)
