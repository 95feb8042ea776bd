"""Writes deploy/nats-roles.conf: least-privilege NATS users for seqstate, one per role.

    python deploy/nats_roles.py > deploy/nats-roles.conf             # the default names
    SEQSTATE_NAMESPACE=prod python deploy/nats_roles.py > prod.conf   # names from SEQSTATE_*

The names (namespace, streams, buckets) come from the same settings the commands read, so the
permissions match the subjects the deployment uses. tests/unit/test_roles.py checks that the
shipped file is this script's output for the defaults.
"""

from __future__ import annotations

import sys

from projector.nats.resources import dead_letter_stream
from projector.nats.security import INBOX_PREFIX
from projector.settings.config import Config
from projector.wire.capture import RAW_PATTERN, capture_stream, captured_subjects

ROLES = (
    "router",
    "scheduler",
    "chooser",
    "control",
    "writer",
    "projector",
    "replay",
    "demo",
    "admin",
    "dynamo",
)
# Dynamo's own processes talk on subjects of their own, all below this prefix (its event plane
# on NATS: replica sync, KV events, metrics); seqstate captures one kind of them.
DYNAMO_SUBJECTS = "namespace.>"
CONSUMERS = ("writer", "projector")  # they answer `nats micro` and their status endpoint
# The roles whose work `run`, `rebuild`, `snapshot save` and `serve-http` do between them: the
# writer's and the projector's, and a router's that registers its workers (the demo's).
ADMIN_OF = ("writer", "projector", "demo")


def read_stream(stream: str) -> list[str]:
    """Read a stream: info, single messages, consumers of one's own, their flow control, acks."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{api}.CONSUMER.INFO.{stream}.*",
        f"{api}.CONSUMER.DELETE.{stream}.*",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{api}.CONSUMER.LIST.{stream}",
        f"{api}.CONSUMER.NAMES.{stream}",
        f"$JS.FC.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def follow_stream(stream: str) -> list[str]:
    """Consume a stream (a consumer of one's own, its flow control and acks), and nothing else
    of it: no single message."""
    return [s for s in read_stream(stream) if ".STREAM." not in s and ".DIRECT." not in s]


def inbox(role: str) -> str:
    """A seqstate role's inboxes: below ``_SEQSTATE_INBOX.<role>``, the prefix its client takes
    when it signs in as the user named after the role (projector.nats.security.inbox_prefix),
    so that no other role, Dynamo's least of all, reads its replies."""
    return f"{INBOX_PREFIX}.{role}.>"


def subscriptions(config: Config, role: str) -> list[str]:
    """Per role: the subjects it may subscribe to. Every role gets its own inbox; the writer
    and the projector also answer NATS service discovery (``nats micro``:
    projector.nats.services) and their status endpoint, replying to whoever asked
    (``allow_responses``); so does the admin, which runs them, in every namespace. Dynamo's
    processes keep nats' default ``_INBOX.>``, which no seqstate client uses."""
    if role in CONSUMERS:
        return [inbox(role), "$SRV.>", f"seqstate.svc.{config.namespace}.{role}.>"]
    if role == "admin":
        own = (s for kind in CONSUMERS for s in subscriptions(config, kind)[1:])
        # `run` beside a Dynamo fleet listens to the routers' replica-sync messages itself: a
        # router publisher the log never heard is a frontend started blind, to resync.
        return list(
            dict.fromkeys(
                [
                    inbox(role),
                    *(every_namespace(s, config.namespace) for s in own),
                    RAW_PATTERN,
                ]
            )
        )
    if role == "dynamo":
        return ["_INBOX.>", DYNAMO_SUBJECTS]
    return [inbox(role)]


def every_namespace(subject: str, namespace: str) -> str:
    """``subject`` for every namespace: ``seqstate.<kind>.<namespace>...`` with ``*`` for the
    namespace's token (NATS wildcards are whole tokens); any other subject as it is.

    ``serve-http`` folds each model's tracker in a namespace of its own
    (``st-<model>-<group>``, projector.http.tracker_names), named only when a first worker of
    the model registers, so no allow list can name them in advance.
    """
    tokens = subject.split(".")
    if tokens[0] == "seqstate" and len(tokens) > 2 and tokens[2] == namespace:
        tokens[2] = "*"
    return ".".join(tokens)


def worker_subjects(config: Config) -> str:
    """Every worker subject of the namespace (:attr:`Config.worker_subjects`)."""
    return config.worker_subjects


def denied(config: Config, role: str) -> list[str]:
    """Per role: subjects refused although an allowed wildcard matches them (deny wins).

    ``*.*`` takes any two tokens, ``control.x`` and ``routers.x`` too: those are no worker's
    subject, so a router is refused them, and the control subject itself is named as well, so
    that no later widening of the allow list (``<ns>.>``, ``<ns>.*``) can hand a router the
    operator's subject.
    """
    control, routers = config.control_subject, config.router_subject
    if role in ("router", "chooser"):
        return [control, f"{control}.>", f"{routers}.>"]
    if role == "demo":
        return [f"{control}.>", f"{routers}.>"]
    if role == "admin":
        return [every_namespace(s, config.namespace) for s in denied(config, "demo")]
    return []


def permissions(config: Config) -> dict[str, tuple[str, list[str]]]:
    """Per role: what it is for, and the subjects it may publish to.

    The admin's are the union of the roles whose work its commands do (``ADMIN_OF``), for
    every namespace (:func:`every_namespace`): nothing any of them may not.
    """
    roles = namespaced_permissions(config)
    # Beyond them, serve-http's Outcomes follows the writer's dead letters (an ordered
    # consumer: the read set a replay has on that stream), to answer a refused call at once.
    dead = read_stream(dead_letter_stream(config))
    # And `seqstate dynamo resync` republishes requests in flight on Dynamo's subjects;
    # `seqstate dynamo uncapture` deletes the capture stream once it captures nothing.
    uncapture = f"$JS.API.STREAM.DELETE.{capture_stream(config.events_stream, config.namespace)}"
    union = (*(s for role in ADMIN_OF for s in roles[role][1]), *dead, RAW_PATTERN, uncapture)
    roles["admin"] = (
        "the commands that do several roles' work (an operator's maintenance and all-in-one "
        "processes): run (the writer and the projector in one process, the demo router "
        "beside them), rebuild, snapshot save, serve-http, dynamo resync and uncapture; the "
        "writer's, the projector's and the demo's grants and the read set on the dead "
        "letters, in every namespace (serve-http's trackers are namespaces of their own)",
        list(dict.fromkeys(every_namespace(s, config.namespace) for s in union)),
    )
    return roles


def namespaced_permissions(config: Config) -> dict[str, tuple[str, list[str]]]:
    """Per role but the admin: what it is for, and the subjects of ``config.namespace`` (and
    the streams and buckets) it may publish to."""
    events, deltas, dead = config.events_stream, config.deltas_stream, dead_letter_stream(config)
    registry, snapshots = f"KV_{config.registry_bucket}", f"OBJ_{config.snapshot_bucket}"
    # A namespace given --dynamo-endpoint also has a capture stream (projector.wire.capture).
    capture = capture_stream(events, config.namespace)
    streams = (events, deltas, dead, registry, snapshots, capture)
    # What `ensure` (every writer and projector start; `worker`, `demo`, and `publish` on a
    # server without the events stream) reads: each stream's info. The writer and the
    # projector may also create or update them; none deletes.
    info = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", *(f"$JS.API.STREAM.INFO.{s}" for s in streams)]
    provision = [f"$JS.API.STREAM.{op}.{s}" for s in streams for op in ("CREATE", "UPDATE")]
    # A router's events: its requests' on their worker's subject, its heartbeat and goodbye
    # on the routers subject; never the control subject (topology is the operator's). The
    # events stream's info lets `seqstate publish` see that the stream is there (it then
    # provisions nothing); RouterPublisher needs no JetStream API at all.
    publishes = [worker_subjects(config), config.router_subject]  # what RouterPublisher sends
    router = [*publishes, f"$JS.API.STREAM.INFO.{events}"]
    return {
        "router": (
            "publishes its requests' lifecycle events on their worker's subject, its heartbeat "
            "and goodbye on the routers subject, never on the control subject; acks come back "
            "on its inbox",
            router,
        ),
        "chooser": (
            "a router that chooses (projector.Scheduler): a router's publishes, the bucket's "
            "reads, and the namespace's worker events followed through a consumer of the "
            "events stream (its peers' bookings); never the stream's info",
            [*publishes, *read_stream(registry), *follow_stream(events)],
        ),
        "scheduler": (
            "reads the registry bucket (RegistryView: KV get and watch); writes nothing",
            [*read_stream(registry)],
        ),
        "control": (
            "the worker control plane (seqstate worker add|remove|list): topology "
            "events on the control subject, and reads the bucket to confirm them",
            [config.control_subject, *info, *read_stream(registry)],
        ),
        "writer": (
            "folds the events (retention purges them), logs its Ticks on the control subject, "
            "forwards the Dynamo capture into the captured subjects, publishes deltas and dead "
            "letters, keeps snapshots, reads the projector's position in the bucket",
            [
                config.control_subject,
                *info,
                *provision,
                *read_stream(events),
                *read_stream(deltas),
                *read_stream(registry),
                *read_stream(snapshots),
                # its capture forwarder: reads the capture stream (and its lag, the oldest
                # message waiting there), stores its messages on the captured subjects,
                # purges what it stored, and removes the events stream's source of it
                *read_stream(capture),
                f"$JS.API.STREAM.PURGE.{capture}",
                captured_subjects(config.namespace).removesuffix(">") + "*.*.*",
                config.deltas_subject,
                config.dead_letter_subject,
                f"$JS.API.STREAM.PURGE.{events}",
                f"$O.{config.snapshot_bucket}.>",
                f"$JS.API.STREAM.PURGE.{snapshots}",
            ],
        ),
        "projector": (
            "reads the deltas, writes the bucket (loads, slots, position, its lease)",
            [
                *info,
                *provision,
                *read_stream(deltas),
                *read_stream(registry),
                f"$KV.{config.registry_bucket}.>",
                # its readiness counts what the writer has not handled yet: the events
                # stream's newest messages, and the newest writer dead letter; the
                # namespace's events counted by the server (a direct get); the oldest
                # Dynamo message waiting in the capture stream
                *(f"$JS.API.STREAM.MSG.GET.{s}" for s in (events, dead, capture)),
                f"$JS.API.DIRECT.GET.{events}",
            ],
        ),
        "replay": (
            "an operator's read-only tools: replay (--verify), status, loads, watch, "
            "snapshot list/show, nats micro list|info|stats",
            [
                *info,
                *(subject for s in streams for subject in read_stream(s)),
                "$SRV.>",
                f"seqstate.svc.{config.namespace}.>",
            ],
        ),
        "demo": (
            "the demo router: a router that registers its workers (the control subject) and "
            "shows the registry's live table",
            [*router, config.control_subject, *info, *read_stream(registry)],
        ),
        "dynamo": (
            "Dynamo's own processes (KV-router frontends with --router-replica-sync, workers) "
            "on the NATS event plane: Dynamo's subjects only, none of seqstate's; the "
            "namespace's capture stream stores their replica-sync events",
            [DYNAMO_SUBJECTS],
        ),
    }


HEADER = """\
# Least-privilege NATS users for seqstate, one per role, in one JetStream account.
# Generated by deploy/nats_roles.py for namespace {ns!r} (other names: run it with their
# SEQSTATE_* settings). Streams {streams};
# bucket {bucket}; object store {snapshots}.
#
# Passwords come from the server's environment ($SEQSTATE_<ROLE>_PASSWORD: the server refuses to
# start while one is unset). A client signs in with SEQSTATE_NATS_USER and SEQSTATE_NATS_PASSWORD
# (or --nats-user/--nats-password). For nkeys (SEQSTATE_NATS_NKEY_SEED) replace a user/password
# pair by `nkey: U...`; for JWTs (SEQSTATE_NATS_CREDS) give nsc the same allow lists.
#
# Events: a router publishes on its requests' worker subjects (seqstate.events.<ns>.<w>.<r>) and
# its heartbeat and goodbye on seqstate.events.<ns>.routers, and is denied the control subject
# seqstate.events.<ns>.control, which belongs to the control role (topology) and the writer
# (its Ticks).
#
# The admin signs in the commands that do several roles' work (run, rebuild, snapshot save,
# serve-http, dynamo resync and uncapture): the writer's, the projector's and the demo's
# grants, in every namespace, since serve-http folds each model's tracker in a namespace of its
# own (st-<model>-<group>), Dynamo's replica-sync subjects (a resync republishes on them), and
# deleting the namespace's Dynamo capture stream (uncapture, once it captures nothing).
#
# Dynamo's own processes sign in as "dynamo" (NATS_SERVER=nats://dynamo:PASSWORD@host:4222):
# they publish and subscribe on Dynamo's subjects (namespace.>), and nothing of seqstate's.
#
# Each seqstate role subscribes to its own inbox, _SEQSTATE_INBOX.<role>.>: replies (the
# JetStream API, publish acks) and push consumers' deliveries land there. A seqstate client
# takes _SEQSTATE_INBOX.<user> as its inbox prefix when it signs in with a user name (set
# SEQSTATE_NATS_INBOX_PREFIX=_SEQSTATE_INBOX.<role> with an nkey or a credentials file).
# Dynamo's processes keep nats' default _INBOX.>, where no seqstate reply goes. The writer
# and the projector (and the admin, which runs them) also answer `nats micro` discovery
# ($SRV.>) and their status endpoint, replying to whoever asked.
#
# Use: nats-server -js -c deploy/nats-roles.conf   (compose.yaml does).
"""


def render(config: Config) -> str:
    streams = ", ".join((config.events_stream, config.deltas_stream, dead_letter_stream(config)))
    out = [
        HEADER.format(
            ns=config.namespace,
            streams=streams,
            bucket=config.registry_bucket,
            snapshots=config.snapshot_bucket,
        ),
        "accounts {",
        "  SEQSTATE {",
        "    jetstream: enabled",
        "    users: [",
    ]
    for role, (what, publish) in permissions(config).items():
        out.append(f"      # {role}: {what}")
        out.append(f"      {{ user: {role}, password: $SEQSTATE_{role.upper()}_PASSWORD,")
        out.append("        permissions: {")
        out.append("          publish: { allow: [")
        out += [f'            "{subject}"' for subject in dict.fromkeys(publish)]
        refused = denied(config, role)
        if refused:  # deny wins over allow: nats-server checks it after the allow list
            out.append("          ]")
            out.append("          deny: [")
            out += [f'            "{subject}"' for subject in refused]
        out.append("          ] }")
        allowed = ", ".join(f'"{subject}"' for subject in subscriptions(config, role))
        out.append(f"          subscribe: {{ allow: [{allowed}] }}")
        if role in (*CONSUMERS, "admin"):
            out.append("          allow_responses: true")
        out.append("        } }")
    out += ["    ]", "  }", "}", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render(Config.from_env()))
