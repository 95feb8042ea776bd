"""What the etcd of a fleet on etcd discovery holds, read as an operator would.

Dynamo's default discovery on bare metal is etcd: each process keeps its keys (``v1/...``,
unencoded, see README.md) under an etcd lease it keeps alive, and etcd deletes them when the
lease runs out. The fleet's etcd (Debian's ``etcd-server`` 3.4, one member on loopback) is
started and stopped by :meth:`projector.dynamo.fleet.Fleet.start_etcd`, which also says where
its binary is found (``etcd_binary``).

Reads go through etcd's v3 JSON gateway (``POST /v3/kv/range`` and ``/v3/lease/timetolive``,
keys base64), with urllib: a test kit needs no etcd client library, and what it reads is the
same JSON an operator's ``curl`` gets.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """One etcd key as the gateway returns it: decoded key and value, and the lease it is
    attached to (0: none)."""

    key: str
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int

    def json(self) -> object:
        return json.loads(self.value)


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: str) -> bytes:
    """The range end that makes ``range`` a prefix scan (etcd's own rule: last byte + 1)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


@dataclass(frozen=True)
class EtcdGateway:
    """etcd's v3 JSON gateway at ``url`` (``http://127.0.0.1:PORT``)."""

    url: str

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            answer: dict[str, object] = json.loads(response.read())
        return answer

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def range(self, prefix: str) -> list[Key]:
        """Every key under ``prefix``, in key order."""
        answer = self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        )
        kvs = answer.get("kvs") or []
        assert isinstance(kvs, list), answer
        return [
            Key(
                key=base64.b64decode(kv["key"]).decode(),
                value=base64.b64decode(kv.get("value", "")),
                lease=int(kv.get("lease", 0)),
                create_revision=int(kv.get("create_revision", 0)),
                mod_revision=int(kv.get("mod_revision", 0)),
            )
            for kv in kvs
        ]

    def lease_ttl(self, lease: int) -> tuple[int, int]:
        """(granted TTL, remaining TTL) of a lease, in seconds; remaining -1 once it is gone."""
        answer = self._post("/v3/lease/timetolive", {"ID": str(lease)})
        return int(answer.get("grantedTTL", 0)), int(answer.get("TTL", -1))
