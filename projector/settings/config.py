"""Names and knobs of the pipeline, from ``SEQSTATE_*`` environment variables (flags mirror them).

Every stream and bucket name is configurable so two deployments (or two test runs) can share
one NATS account without touching each other. Each field carries its own help text and
metavar, so the command line is generated from this one list and cannot drift from it.

A bad value is reported in the words the user typed it in: ``--expiry-s 'banana'``,
``SEQSTATE_EXPIRY_S='banana'`` or ``expiry_s='banana'``, never a Python field name the user
never saw.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from projector.settings.checks import CHECKS, as_shown, rule
from seqstate.bounds import MAX_RANKS, MAX_RANKS_PER_WORKER, RankBounds
from seqstate.errors import SeqstateError
from seqstate.events import Event
from seqstate.fold import (
    MAX_EVENT_BYTES,
    FoldRules,
    control_subject,
    routers_subject,
    subject_of,
    worker_subject,
)
from seqstate.state import MAX_ENDED, MAX_TOMBSTONES, SequenceState

# serve-http's doors. Connections: nginx's default worker_connections; with the refusals that
# linger and the process's own descriptors (NATS, the metrics port) it fits the common
# `ulimit -n` of 1,024. Trackers: each is a pipeline (a writer, a projector, a view and an
# outcomes feed) in every serve-http process, measured at ~0.25 MB and ~0.1% of a core idle
# apiece; 128 keeps that near 30 MB and an eighth of a core, far above a deployment's models
# times routing groups.
DEFAULT_HTTP_MAX_CONNECTIONS = 512
DEFAULT_MAX_TRACKERS = 128


class ConfigError(SeqstateError, ValueError):
    """A setting that cannot be used; the message names it as the user gave it."""

    def __init__(self, problem: str, *, setting: str = "", label: str = "") -> None:
        super().__init__(f"{label}: {problem}" if label else problem)
        self.problem = problem
        self.setting = setting  # the Config field, when one is at fault


# How a client signs in, beside credentials in the URL: one at most.
_AUTH_METHODS = (
    ("nats_user", "nats_password"),
    ("nats_token",),
    ("nats_nkey_seed",),
    ("nats_creds",),
)


# Dynamo's routers' scan period: seqstate started with the fleet's environment follows it.
DYNAMO_SCAN_ENV = "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"


def _setting(default: Any, help: str, metavar: str = "", *, secret: bool = False) -> Any:
    return field(
        default=default,
        repr=not secret,
        metadata={"help": help, "metavar": metavar, "secret": secret},
    )


@dataclass(frozen=True)
class Config:
    nats_url: str | None = _setting(
        None, "NATS server URL; several, comma-separated, for a cluster", "URL"
    )
    namespace: str = _setting("default", "isolates one deployment's subjects and keys", "NAME")
    events_stream: str = _setting("SEQSTATE_EVENTS", "stream of lifecycle events", "NAME")
    deltas_stream: str = _setting("SEQSTATE_DELTAS", "stream of the writer's deltas", "NAME")
    registry_bucket: str = _setting("seqstate-registry", "KV bucket of the read model", "NAME")
    snapshot_bucket: str = _setting(
        "seqstate-snapshots", "object store of write-model snapshots", "NAME"
    )
    duplicate_window_s: float = _setting(
        120.0, "JetStream's duplicate window: a retried publish is stored once", "SECONDS"
    )
    capture_max_bytes: int | None = _setting(
        1024**3,
        "bytes the Dynamo capture stream keeps (its oldest dropped beyond, counted if the "
        "events stream had not taken them); never lowered on an existing stream; 'off': no "
        "limit",
        "BYTES",
    )
    dead_letter_max_bytes: int | None = _setting(
        256 * 1024**2,
        "bytes the dead-letter stream keeps (its oldest dropped beyond; the metrics keep "
        "the counts); never lowered on an existing stream; 'off': no limit",
        "BYTES",
    )
    expiry_s: float | None = _setting(
        300.0,
        "seconds after which an unfreed request expires (a namespace with "
        "--dynamo-endpoint expires by --expiry-scan-s instead); 'off' disables",
        "SECONDS",
    )
    expiry_scan_s: float | None = _setting(
        300.0,
        "a namespace with --dynamo-endpoint expires as Dynamo's routers do: a lease per "
        "request, refreshed by its Add and its prefill's end, scanned every so many seconds "
        "of log time (gone 1 to 2 scans after its last refresh); unset, Dynamo's own "
        f"{DYNAMO_SCAN_ENV} when the environment has it; 'off': --expiry-s applies",
        "SECONDS",
    )
    idle_tick_s: float = _setting(
        5.0, "seconds of stream silence before the writer logs a Tick", "SECONDS"
    )
    flush_interval_s: float = _setting(
        # 20 ms, not 5: at a call's pace a request booked and freed within one flush costs
        # the bucket nothing, which halved serve-http's KV traffic (BENCHMARKS.md)
        0.02,
        "at most one write per bucket key per this many seconds",
        "SECONDS",
    )
    replicas: int = _setting(1, "replicas of each stream and bucket (1, 3 or 5)", "N")
    snapshot_every_events: int = _setting(
        10_000,
        "snapshot the write model every N events (a large one only every size/64 bytes of "
        "events); 0: never by count",
        "N",
    )
    snapshot_every_s: float = _setting(
        60.0, "snapshot the write model every so many seconds; 0: never by time", "SECONDS"
    )
    snapshots_keep: int = _setting(3, "snapshots kept (the newest)", "N")
    snapshot_history_every: int | None = _setting(
        50_000,
        "beside the newest, snapshot the first event past every N events of history and keep "
        "it, so that `loads --at` folds fewer than N events; 'off' keeps only the newest",
        "N",
    )
    snapshot_history_keep: int = _setting(
        40, "history snapshots kept (the newest), bounding the history answerable fast", "N"
    )
    retain_events: int | None = _setting(
        None, "events kept before the oldest snapshot; 'off' (the default) never trims", "N"
    )
    forget_lazy_ranks_s: float | None = _setting(
        600.0,
        "a rank no WorkerAdded registered, empty this long, is dropped; 'off' keeps it",
        "SECONDS",
    )
    orphan_after_s: float | None = _setting(
        30.0,
        "a router silent this long after a heartbeat has its requests freed (orphaned); "
        "'off' never",
        "SECONDS",
    )
    rules: str = _setting(
        "router",
        "the fold's rules: 'router' (workers created by their first request, as in "
        "Dynamo's router) or 'slot-tracker' (strict, as Dynamo's standalone slot tracker)",
        "RULES",
    )
    worker_grace_s: float = _setting(
        0.0,
        "a removed worker added back within this long keeps its requests; 0 (the "
        "default) drops them at once",
        "SECONDS",
    )
    tick_every_s: float = _setting(
        60.0,
        "the writer logs a Tick at least this often, busy or not (expiry, idle ranks)",
        "SECONDS",
    )
    behind_warn_events: int | None = _setting(
        50_000,
        "the writer (projector) warns when this many events wait to be folded (to reach "
        "the bucket); 'off' never",
        "N",
    )
    behind_warn_s: float | None = _setting(
        10.0,
        "the writer (projector) warns when the oldest event not folded (not in the bucket) "
        "has waited this long; 'off' never",
        "SECONDS",
    )
    lag_check_s: float = _setting(
        2.0,
        "the writer and the projector look up their lag this often (a few small reads)",
        "SECONDS",
    )
    consumer_window: int = _setting(
        4096,
        "messages the writer (projector) is sent and has not handled yet, at most: what it "
        "holds in memory while it catches up, whatever the backlog",
        "N",
    )
    max_ranks_per_worker: int = _setting(
        MAX_RANKS_PER_WORKER, "ranks one worker may have; an event beyond is dead-lettered", "N"
    )
    max_ranks: int = _setting(MAX_RANKS, "ranks in all; an event beyond is dead-lettered", "N")
    max_event_bytes: int = _setting(
        MAX_EVENT_BYTES,
        "the largest event the fold applies; a larger one is dead-lettered (too_large). The "
        "writer refuses to start if the server's max_payload less 5 KiB is smaller",
        "BYTES",
    )
    max_tombstones: int = _setting(
        MAX_TOMBSTONES,
        "ids of Marks and Frees that came before their Add, remembered at once; "
        "the oldest beyond are forgotten (counted)",
        "N",
    )
    max_ended: int = _setting(
        MAX_ENDED,
        "ids of ended requests remembered at once (a late repeat is a no-op); the "
        "oldest beyond are forgotten (counted)",
        "N",
    )
    tls_ca: str | None = _setting(
        None,
        "PEM file of the CA that signed the server's certificate (unset: the system's)",
        "PATH",
    )
    tls_cert: str | None = _setting(
        None, "PEM client certificate, for a server that asks for one (with --tls-key)", "PATH"
    )
    tls_key: str | None = _setting(None, "PEM key of the client certificate", "PATH")
    nats_user: str | None = _setting(None, "NATS user name (with --nats-password)", "USER")
    nats_password: str | None = _setting(
        None,
        "password of --nats-user; prefer the variable: a flag shows in ps",
        "SECRET",
        secret=True,
    )
    nats_token: str | None = _setting(
        None,
        "NATS authorization token; prefer the variable: a flag shows in ps",
        "SECRET",
        secret=True,
    )
    nats_nkey_seed: str | None = _setting(
        None, "file holding an NKEY user seed (SU...), for a server with nkey users", "PATH"
    )
    nats_creds: str | None = _setting(
        None, "NATS credentials file (user JWT and seed, as nsc writes it)", "PATH"
    )
    nats_inbox_prefix: str | None = _setting(
        None,
        "the subject prefix of this client's reply inboxes (default: _SEQSTATE_INBOX.<user> "
        "when signing in with a user name, else _SEQSTATE_INBOX): deploy/nats-roles.conf lets "
        "each role subscribe below its own only",
        "SUBJECT",
    )
    metrics_port: int | None = _setting(
        None,
        "serve Prometheus /metrics, /healthz and /readyz on this port; 0: any free port "
        "(logged); 'off' (the default): none",
        "PORT",
    )
    metrics_host: str = _setting(
        "127.0.0.1",
        "the address the metrics port listens on: loopback by default; 0.0.0.0 (every "
        "address) for a scraper outside the host or container",
        "HOST",
    )
    ready_lag_events: int = _setting(
        1000,
        "/readyz answers 200 only while the last lag measurement is at most this many events "
        "(the projector's: events logged and not in the bucket yet, the writer's lag included)",
        "N",
    )
    http_host: str = _setting(
        "127.0.0.1",
        "the address serve-http listens on: loopback by default; 0.0.0.0 (every address) "
        "for clients on other hosts or containers (then set a token)",
        "HOST",
    )
    http_port: int = _setting(8091, "the port serve-http listens on (Dynamo's)", "PORT")
    http_max_connections: int = _setting(
        DEFAULT_HTTP_MAX_CONNECTIONS,
        "client connections serve-http holds open at once; one more is answered 503 and "
        "closed, unread",
        "N",
    )
    max_trackers: int = _setting(
        DEFAULT_MAX_TRACKERS,
        "slot trackers (model_name, routing_group) serve-http serves; each runs a pipeline "
        "in every serve-http process: a /register of one more is 400, and a process with a "
        "lower bound leaves the rest to the others",
        "N",
    )
    http_token: str | None = _setting(
        None,
        "serve-http answers only calls that carry 'Authorization: Bearer TOKEN' (401 "
        "otherwise); prefer the variable or --http-token-file: a flag shows in ps",
        "SECRET",
        secret=True,
    )
    http_token_file: str | None = _setting(
        None, "a file holding serve-http's bearer token (as --http-token; one line)", "PATH"
    )
    event_loop: str = _setting(
        "auto",
        "serve-http's event loop: 'uvloop' (the 'fast' extra), 'asyncio', or 'auto' (uvloop "
        "when installed)",
        "LOOP",
    )
    dynamo_endpoint: str | None = _setting(
        None,
        "fold a Dynamo deployment's own replica-sync events into this namespace: its "
        "endpoint NS.COMPONENT.ENDPOINT (several, comma-separated); JetStream stores them "
        "(routers started with --router-replica-sync on the NATS event plane)",
        "ENDPOINTS",
    )
    dynamo_discovery: str = _setting(
        "",
        "where the Dynamo fleet registers its workers and routers, followed by `run` so that "
        "a dead worker leaves the ledger and a new router replica is resynced: "
        "'etcd:http://HOST:2379[,URL...]', 'file:DIR' or 'none'; unset: Dynamo's own "
        "environment (DYN_DISCOVERY_BACKEND, ETCD_ENDPOINTS, DYN_FILE_KV), etcd at its "
        "default endpoint as Dynamo does",
        "SPEC",
    )
    dynamo_resync: str = _setting(
        "auto",
        "'auto': `run` resyncs each Dynamo router replica that starts (seen in discovery, "
        "or, without it, by its first message); 'off': only `seqstate dynamo resync` does",
        "auto|off",
    )
    ready_lag_s: float | None = _setting(
        10.0,
        "/readyz answers 200 only while the oldest event not handled yet (for the projector: "
        "not in the bucket yet) has waited at most this long; 'off' never (keep it above "
        "--idle-tick-s: an event dead-lettered last is passed by the next Tick)",
        "SECONDS",
    )

    def __post_init__(self) -> None:
        for name, check in CHECKS:
            problem = check(getattr(self, name))
            if problem:
                raise ConfigError(
                    problem, setting=name, label=f"{name}={as_shown(name, getattr(self, name))!r}"
                )
        if self.rules == "slot-tracker" and self.worker_grace_s:
            raise ConfigError(
                "a worker grace has no place under the 'slot-tracker' rules (an unregistered "
                "worker's requests are dropped at once, as in Dynamo): leave it 0",
                setting="worker_grace_s",
                label=f"worker_grace_s={self.worker_grace_s!r}",
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            given = "tls_cert" if self.tls_key is None else "tls_key"
            missing = "tls_key" if given == "tls_cert" else "tls_cert"
            problem = (
                f"a client certificate needs both: set --{missing.replace('_', '-')} or "
                f"{env_name(missing)} too"
            )
            label = f"{given}={getattr(self, given)!r}"
            raise ConfigError(problem, setting=given, label=label)
        if (self.nats_user is None) != (self.nats_password is None):
            given = "nats_user" if self.nats_password is None else "nats_password"
            missing = "nats_password" if given == "nats_user" else "nats_user"
            problem = (
                f"a user and a password go together: set --{missing.replace('_', '-')} or "
                f"{env_name(missing)} too"
            )
            label = f"{given}={as_shown(given, getattr(self, given))!r}"
            raise ConfigError(problem, setting=given, label=label)
        if self.http_token is not None and self.http_token_file is not None:
            raise ConfigError(
                "--http-token/SEQSTATE_HTTP_TOKEN and --http-token-file/"
                "SEQSTATE_HTTP_TOKEN_FILE: set the token one way, not both",
                setting="http_token_file",
            )
        chosen = [names[0] for names in _AUTH_METHODS if getattr(self, names[0]) is not None]
        if len(chosen) > 1:
            shown = " and ".join(f"--{n.replace('_', '-')}/{env_name(n)}" for n in chosen)
            problem = f"{shown}: set one way to sign in, not {len(chosen)}"
            raise ConfigError(problem, setting=chosen[-1])

    @property
    def has_credentials(self) -> bool:
        """Whether a setting (not the URL) says how to sign in."""
        return any(getattr(self, names[0]) is not None for names in _AUTH_METHODS)

    @property
    def events_subjects(self) -> str:
        """Every event subject of this namespace: ``seqstate.events.<ns>.<worker>.<rank>``."""
        return f"seqstate.events.{self.namespace}.>"

    def event_subject(self, worker_id: int, dp_rank: int = 0) -> str:
        return worker_subject(self.namespace, worker_id, dp_rank)

    @property
    def worker_subjects(self) -> str:
        """Every worker subject of the namespace, ``seqstate.events.<ns>.<worker>.<rank>``:
        two tokens after the namespace, so neither ``<ns>.control`` nor ``<ns>.routers``."""
        return f"seqstate.events.{self.namespace}.*.*"

    @property
    def control_subject(self) -> str:
        """The operator's and the writer's events: topology (WorkerAdded, WorkerRemoved) and
        the writer's Tick. The ``control`` role (and the writer, for its Ticks) publishes here;
        a router never does (deploy/nats_roles.py denies it)."""
        return control_subject(self.namespace)

    def subject_of(self, event: Event) -> str:
        """The subject ``event`` is published on: the fold refuses it on another."""
        return subject_of(self.namespace, event)

    @property
    def router_subject(self) -> str:
        """A router's own lifecycle (RouterHeartbeat, RouterGoodbye): events that name no
        worker but are a router's to send, kept off the control subject so that the router
        role never needs it."""
        return routers_subject(self.namespace)

    @property
    def dynamo_endpoints(self) -> tuple[str, ...]:
        """The Dynamo endpoints this namespace captures (``NS.COMPONENT.ENDPOINT`` each)."""
        if not self.dynamo_endpoint:
            return ()
        return tuple(dict.fromkeys(e.strip() for e in self.dynamo_endpoint.split(",")))

    @property
    def deltas_subject(self) -> str:
        return f"seqstate.deltas.{self.namespace}"

    @property
    def dead_letter_subject(self) -> str:
        return f"seqstate.dead.{self.namespace}"

    def new_state(self) -> SequenceState:
        """An empty write model with this configuration's rules: every fold of the log (the
        writer, a replay) starts from one, so they agree byte for byte."""
        return SequenceState(
            expiry_s=self.expiry_s,
            lease_scan_s=self.expiry_scan_s if self.dynamo_endpoints else None,
            forget_lazy_after_s=self.forget_lazy_ranks_s,
            orphan_after_s=self.orphan_after_s,
            worker_grace_s=self.worker_grace_s or None,
            max_tombstones=self.max_tombstones,
            max_ended=self.max_ended,
            slot_tracker=self.rules == "slot-tracker",
        )

    def rules_differing(self, state: SequenceState) -> list[str]:
        """Where ``state`` (restored from a snapshot) folds by other rules than these settings,
        one ``setting: snapshot X, configured Y`` each. The snapshot's rules stay in force: a
        fold that changed its rules halfway would be one no replay could reproduce."""

        def rules(s: SequenceState) -> dict[str, object]:
            return {
                "rules": "slot-tracker" if s.slot_tracker else "router",
                "expiry_s": s.expiry_s,
                "expiry_scan_s": s.lease_scan_s,
                "forget_lazy_ranks_s": s.forget_lazy_after_s,
                "orphan_after_s": s.orphan_after_s,
                "worker_grace_s": s.worker_grace_s,
                "max_tombstones": s.tombstones.capacity,
                "max_ended": s.ended.capacity,
            }

        kept, wanted = rules(state), rules(self.new_state())
        return [
            f"{name}: snapshot {rule(kept[name])}, configured {rule(wanted[name])}"
            for name in kept
            if kept[name] != wanted[name]
        ]

    @property
    def rank_bounds(self) -> RankBounds:
        return RankBounds(self.max_ranks_per_worker, self.max_ranks)

    @property
    def fold_rules(self) -> FoldRules:
        """What every fold of this namespace's log decides by (the writer, replay, rebuild,
        verify): the same rules, so the same verdict for every message."""
        return FoldRules(self.namespace, self.max_event_bytes, self.rank_bounds)

    def with_namespace(self, namespace: str | None) -> Config:
        """This configuration for ``namespace`` (itself when None or the same)."""
        if namespace is None or namespace == self.namespace:
            return self
        return Config(**{**self.__dict__, "namespace": namespace})

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        flags: Mapping[str, tuple[str, str]] | None = None,
        **overrides: object,
    ) -> Config:
        """Defaults, then ``SEQSTATE_<FIELD>`` (and ``NATS_URL``), then flags, then overrides.
        The scan period alone also reads Dynamo's ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS``
        when neither its flag nor its variable is set, as discovery reads Dynamo's variables.

        ``flags`` maps a field to ``(flag, raw text)``: parsed exactly as its environment
        variable is, and named as the flag in an error.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        labels: dict[str, str] = {}
        for f in fields(cls):
            key = env_name(f.name)
            if f.name in (flags or {}):
                flag, raw = (flags or {})[f.name]
                labels[f.name] = f"{flag} {as_shown(f.name, raw)!r}"
            elif key in env and env[key] != "":
                raw = env[key]
                labels[f.name] = f"{key}={as_shown(f.name, raw)!r}"
            else:
                continue
            values[f.name] = _parse(raw, f.type, f.name, labels[f.name])
        dynamo_scan = env.get(DYNAMO_SCAN_ENV, "").strip()
        if "expiry_scan_s" not in values and dynamo_scan:
            labels["expiry_scan_s"] = f"{DYNAMO_SCAN_ENV}={dynamo_scan!r}"
            scan = next(f for f in fields(cls) if f.name == "expiry_scan_s")
            values[scan.name] = _parse(dynamo_scan, scan.type, scan.name, labels[scan.name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in overrides:
            labels.pop(name, None)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ConfigError as exc:
            if exc.setting in labels:
                raise ConfigError(
                    exc.problem, setting=exc.setting, label=labels[exc.setting]
                ) from None
            raise


def env_name(setting: str) -> str:
    """The environment variable of a Config field: ``NATS_URL`` or ``SEQSTATE_<FIELD>``."""
    return "NATS_URL" if setting == "nats_url" else f"SEQSTATE_{setting.upper()}"


def _parse(raw: str, kind: object, name: str, label: str) -> object:
    kind = str(kind)
    optional = "None" in kind
    if optional and raw.strip().lower() in ("none", "off"):
        return None
    try:
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("int"):
            return int(raw)
    except ValueError:
        unit = "seconds" if kind.startswith("float") else "a whole number"
        hint = f"{unit}, or 'off'" if optional else unit
        raise ConfigError(f"not a number ({hint})", setting=name, label=label) from None
    return raw
