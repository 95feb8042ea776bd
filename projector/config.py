"""Names and knobs of the pipeline, from ``SEQSTATE_*`` environment variables (flags mirror them).

Every stream, bucket and durable name is configurable so two deployments (or two test runs)
can share one NATS account without touching each other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from seqstate.errors import SeqstateError

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


class ConfigError(SeqstateError, ValueError):
    """A setting that cannot be used; the message names it."""


@dataclass(frozen=True)
class Config:
    namespace: str = "default"
    events_stream: str = "SEQSTATE_EVENTS"
    deltas_stream: str = "SEQSTATE_DELTAS"
    registry_bucket: str = "seqstate-registry"
    snapshot_bucket: str = "seqstate-snapshots"
    writer_durable: str = "seqstate-writer"
    projector_durable: str = "seqstate-projector"
    # JetStream's duplicate window: a retried publish with the same Nats-Msg-Id inside it is
    # stored once.
    duplicate_window_s: float = 120.0
    expiry_s: float | None = 300.0
    idle_tick_s: float = 5.0
    flush_interval_s: float = 0.005
    replicas: int = 1
    # Snapshots of the write model (issue #4): every N events or T seconds, whichever first;
    # the newest few are kept. 0 disables that trigger.
    snapshot_every_events: int = 10_000
    snapshot_every_s: float = 60.0
    snapshots_keep: int = 3
    # Events the writer keeps before the oldest kept snapshot; None never trims the stream.
    # Trimming happens only after a snapshot has been stored and read back.
    retain_events: int | None = None
    nats_url: str | None = None
    # TLS for every connection (PEM paths): the CA that signed the server's certificate (unset:
    # the system's), and a client certificate with its key for a server that asks for one.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if not _TOKEN.match(self.namespace):
            raise ConfigError(
                f"SEQSTATE_NAMESPACE={self.namespace!r}: use letters, digits, '-' and '_' only"
            )
        for name in ("events_stream", "deltas_stream"):
            if not _TOKEN.match(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not a valid stream name")
        if self.duplicate_window_s < 120:
            raise ConfigError("duplicate_window_s must be at least 120 s (retried publishes)")
        if self.replicas not in (1, 3, 5):
            raise ConfigError(f"replicas={self.replicas}: use 1, 3 or 5")
        if self.flush_interval_s <= 0 or self.idle_tick_s <= 0:
            raise ConfigError("flush_interval_s and idle_tick_s must be positive")
        if self.snapshot_every_events < 0 or self.snapshot_every_s < 0:
            raise ConfigError("snapshot_every_events and snapshot_every_s must not be negative")
        if self.snapshots_keep < 1:
            raise ConfigError(f"snapshots_keep={self.snapshots_keep}: keep at least 1")
        if self.retain_events is not None and self.retain_events < 0:
            raise ConfigError(f"retain_events={self.retain_events}: must not be negative")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("SEQSTATE_TLS_CERT and SEQSTATE_TLS_KEY: set both or neither")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"SEQSTATE_{name.upper()}={path}: no such file")

    @property
    def events_subjects(self) -> str:
        """Every event subject of this namespace: ``seqstate.events.<ns>.<worker>.<rank>``."""
        return f"seqstate.events.{self.namespace}.>"

    def event_subject(self, worker_id: int, dp_rank: int = 0) -> str:
        return f"seqstate.events.{self.namespace}.{worker_id}.{dp_rank}"

    @property
    def control_subject(self) -> str:
        """Events that name no worker (Tick) and topology events."""
        return f"seqstate.events.{self.namespace}.control"

    @property
    def deltas_subject(self) -> str:
        return f"seqstate.deltas.{self.namespace}"

    @property
    def dead_letter_subject(self) -> str:
        return f"seqstate.dead.{self.namespace}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Defaults, then ``SEQSTATE_<FIELD>`` (and ``NATS_URL``), then explicit overrides."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            key = "NATS_URL" if f.name == "nats_url" else f"SEQSTATE_{f.name.upper()}"
            if key in env and env[key] != "":
                values[f.name] = _parse(key, env[key], f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _parse(key: str, raw: str, kind: object) -> object:
    kind = str(kind)
    try:
        if "None" in kind and raw.lower() in ("none", "off"):
            return None
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("int"):
            return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number") from None
    return raw
