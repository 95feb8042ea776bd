"""The live suite's fleet: :mod:`projector.dynamo.fleet`'s (what ``make dynamo-demo`` runs too),
with what the tests read of it, the way an operator would: discovery (which instance ids the
workers took, which dp ranks they serve), each frontend's HTTP port (``/v1/models``,
``/metrics``) and the NATS subjects.

Discovery is Dynamo's file backend or an etcd of the fleet's own (fleet_etcd.py reads it).
Both hold the same keys (``v1/instances/...``, ``v1/event_channels/...``, ...), read here as
:class:`Entry` rows by :meth:`Fleet.entries`, whichever backend holds them.

Worker instance ids are random u64s drawn by each worker at start. seqstate must carry all 64
bits, and a value above 2^63 is what breaks a signed 64-bit path, so live.py restarts the
single-rank mocker until some worker holds an id above 2^63 (each start is a fair coin; the
loop gives up after ``HIGH_ID_TRIES``, which fails with odds of 2^-24).
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from fleet_etcd import EtcdGateway

from projector.dynamo import fleet as launch
from projector.dynamo.fleet import (
    BLOCK_SIZE,
    COMPONENT,
    DYNAMO_ENDPOINT,
    ENDPOINT,
    EVENTS_SUBJECT,
    MODEL,
    Frontend,
    Proc,
    default_venv,
    free_ports,
)

__all__ = [
    "BLOCK_SIZE",
    "DYNAMO_ENDPOINT",
    "EVENTS_SUBJECT",
    "MODEL",
    "Entry",
    "Fleet",
    "Frontend",
    "Proc",
    "default_venv",
    "free_ports",
]

HIGH_ID_TRIES = 24
TOP_BIT = 1 << 63


@dataclass(frozen=True)
class Entry:
    """One discovery key, whichever backend holds it: its key as Dynamo wrote it (``v1/...``,
    unencoded), its JSON value, and (etcd only) the lease it is attached to; files have none."""

    key: str
    value: dict[str, Any]
    lease: int | None = None


class Fleet(launch.Fleet):
    """The product's fleet, and what discovery and nats-server say about it."""

    @property
    def gateway(self) -> EtcdGateway:
        return EtcdGateway(self.etcd_url)

    # ---- what discovery says ----------------------------------------------------------------

    def entries(self, kind: str) -> list[Entry]:
        """Every key under ``v1/<kind>/`` (``instances``, ``event_channels``, ``mdc``, ...),
        from the files or from etcd, in key order. A file half-written is skipped: the next
        read has it."""
        if self.discovery == "etcd":
            return [
                Entry(k.key, k.json(), k.lease)  # type: ignore[arg-type]
                for k in self.gateway.range(f"v1/{kind}/")
            ]
        folder = self.file_kv / "v1" / kind
        found = []
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            if not path.is_file():
                continue
            with contextlib.suppress(OSError, ValueError):
                name = path.relative_to(self.file_kv).as_posix()
                found.append(Entry(urllib.parse.unquote(name), json.loads(path.read_text())))
        return sorted(found, key=lambda e: e.key)

    def worker_ids(self) -> dict[int, int]:
        """rpc port -> instance id of every worker registered on the ``generate`` endpoint."""
        found: dict[int, int] = {}
        for entry in self.entries("instances"):
            record = entry.value
            if record.get("endpoint") != ENDPOINT or record.get("component") != COMPONENT:
                continue
            transport = record.get("transport")
            tcp = transport.get("tcp") if isinstance(transport, dict) else None
            if isinstance(tcp, str):
                port = int(tcp.split("/", 1)[0].rsplit(":", 1)[1])
                found[port] = int(str(record["instance_id"]))
        return found

    def ranks(self) -> set[tuple[int, int]]:
        """(worker_id, dp_rank) of every rank publishing KV events: one per rank, dp included."""
        ranks = set()
        for entry in self.entries("event_sources"):
            meta = entry.value.get("metadata")
            worker = meta.get("worker") if isinstance(meta, dict) else None
            if entry.value.get("topic") == "kv-events" and isinstance(worker, dict):
                ranks.add((int(worker["worker_id"]), int(worker["dp_rank"])))
        return ranks

    def worker_of(self, proc: Proc) -> int | None:
        return self.worker_ids().get(proc.rpc_port)

    def channels(self, topic: str = "active_sequences_events") -> dict[int, Entry]:
        """The endpoint's event channels of ``topic``, by the id they register (the
        ``instance_id`` in the value: the publisher id of what they publish)."""
        suffix = f"/endpoint/{ENDPOINT}/topic/{topic}/"
        return {
            int(entry.value["instance_id"]): entry
            for entry in self.entries("event_channels")
            if suffix in entry.key and f"/component/{COMPONENT}/" in entry.key
        }

    # ---- what nats-server says ------------------------------------------------------------

    def subscriptions(self, subject: str = EVENTS_SUBJECT) -> set[tuple[int, int]]:
        """(connection id, subscription id) of every subscription on exactly ``subject``, from
        nats-server's monitoring (``/connz?subs=detail``)."""
        assert self.nats_monitor is not None, "nats-server runs without monitoring"
        url = f"{self.nats_monitor}/connz?subs=detail&limit=100000"
        with urllib.request.urlopen(url, timeout=5) as response:
            connz = json.loads(response.read())
        return {
            (int(conn["cid"]), int(sub["sid"]))
            for conn in connz.get("connections") or []
            for sub in conn.get("subscriptions_list_detail") or []
            if sub.get("subject") == subject
        }
