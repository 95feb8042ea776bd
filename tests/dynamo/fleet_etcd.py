"""An etcd server for a fleet on etcd discovery, and what it holds, read as an operator would.

Dynamo's default discovery on bare metal is etcd: each process keeps its keys (``v1/...``,
unencoded, see README.md) under an etcd lease it keeps alive, and etcd deletes them when the
lease runs out. The fleet's etcd is Debian's ``etcd-server`` (3.4), a single member on two free
loopback ports with a data directory under the fleet's root, started in its own process group
and stopped like every other process of the fleet (fleet.py's :class:`fleet.Proc`).

The binary: ``ETCD_BIN``, else ``etcd`` on ``PATH``, else where ``tests/dynamo/install_etcd.sh``
unpacks the package (``${XDG_CACHE_HOME:-~/.cache}/seqstate/etcd-3.4/usr/bin/etcd``;
``make test-dynamo`` runs it first).

Reads go through etcd's v3 JSON gateway (``POST /v3/kv/range`` and ``/v3/lease/timetolive``,
keys base64), with urllib: a test kit needs no etcd client library, and what it reads is the
same JSON an operator's ``curl`` gets.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def etcd_binary() -> Path | None:
    """Where the etcd binary is, or None: ``ETCD_BIN``, ``PATH``, the installer's cache."""
    configured = os.environ.get("ETCD_BIN")
    if configured:
        return Path(configured)
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    unpacked = Path(cache) / "seqstate" / "etcd-3.4" / "usr" / "bin" / "etcd"
    return unpacked if unpacked.exists() else None


def etcd_args(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    """A single member on loopback: its own cluster, nothing shared with another fleet's."""
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        str(binary),
        "--name",
        "fleet",
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"fleet={peer}",
        "--log-level",
        "warn",
    ]


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
