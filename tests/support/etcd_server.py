"""A real etcd for the tests: Debian's etcd-server (3.4), one member on free loopback ports.

The binary: ``ETCD_BIN``, else where ``tests/tools/install_etcd.sh`` unpacks it
(``${XDG_CACHE_HOME:-~/.cache}/seqstate/etcd-3.4/usr/bin/etcd``; ``make test`` runs the
installer first), else ``etcd`` on ``PATH``. Missing, the test fails with the command that
installs it: what a run tests must not depend on what a machine happens to have.

Started in a process group of its own with a data directory under the test's temp dir, ready
when its gateway answers a status request; stopped with SIGTERM to the group (SIGKILL after a
deadline). :meth:`EtcdServer.kill` is a crash; :meth:`EtcdServer.start` again restarts it on
the same data and ports. The helpers speak etcd's v3 JSON gateway (what an operator's ``curl``
would), as Dynamo's writes would land: a put under a lease, a lease that runs out.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from projector.nats.server import _free_ports

READY_S = 20.0
STOP_S = 10.0
HERE = Path(__file__).resolve().parents[1]  # tests/
INSTALLER = HERE / "tools" / "install_etcd.sh"


def etcd_binary() -> str:
    configured = os.environ.get("ETCD_BIN")
    if configured:
        return configured
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    unpacked = Path(cache) / "seqstate" / "etcd-3.4" / "usr" / "bin" / "etcd"
    if os.access(unpacked, os.X_OK):
        return str(unpacked)
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError(f"no etcd binary: run `bash {INSTALLER.relative_to(HERE.parent)}`")


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


class EtcdServer:
    """One etcd member; ``url`` is its client URL (the gateway is on the same port)."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        self.data_dir = data_dir
        self.binary = binary or etcd_binary()
        self.client_port, self.peer_port = _free_ports(2, "127.0.0.1")
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        client, peer = self.url, f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=seqstate-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=seqstate-test={peer}",
            "--log-level=warn",
        ]
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + READY_S
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(f"{self.url}/v3/maintenance/status", json={}, timeout=1).is_success:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd not ready within {READY_S:.0f} s: {self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays for a restart."""
        if self._proc is not None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
            self._proc = None

    # ---- the gateway, as a Dynamo process would write ---------------------------------------

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.post(self.url + path, json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Put ``key``; the store's revision after it."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, key: str) -> int:
        answer = await self.call("/v3/kv/deleterange", {"key": b64(key)})
        return int(answer.get("deleted", 0))

    async def grant(self, ttl_s: int) -> int:
        """A lease of ``ttl_s`` seconds that nobody keeps alive: it runs out as a SIGKILLed
        process's would."""
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"])

    async def compact(self, revision: int) -> None:
        await self.call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    async def revision(self) -> int:
        answer = await self.call("/v3/kv/range", {"key": b64("\0"), "count_only": True})
        return int(answer["header"]["revision"])
