"""A real Dynamo 1.6.1 fleet on loopback: mocker workers and KV-router frontends, no GPU.

Dynamo is not a dependency of seqstate. It lives in a venv of its own (``DYNAMO_VENV``, built by
``tests/dynamo/install_dynamo.sh``: ``make test-dynamo`` does both), and its processes are
started from that venv's Python, so nothing of Dynamo is ever imported into the test process.
What the tests know of the fleet, they learn the way an operator would: discovery (which
instance ids the workers took, which dp ranks they serve), each frontend's HTTP port
(``/v1/models``, ``/metrics``) and the NATS subjects.

Discovery is Dynamo's file backend (``discovery="file"``: one file a key under the fleet's
``discovery/`` directory) or etcd (``discovery="etcd"``: an etcd server of the fleet's own,
fleet_etcd.py, started by :meth:`Fleet.start_etcd` before any Dynamo process and stopped after
them). Both hold the same keys (``v1/instances/...``, ``v1/event_channels/...``, ...), read
here as :class:`Entry` rows by :meth:`Fleet.entries`, whichever backend holds them.

Every process runs in a process group of its own, its stdout and stderr in a log file under the
fleet's root, so a failed run can be read afterwards (the conftest attaches each log's tail to
the failure report). Stopping is SIGTERM to the group, then SIGKILL to the group if it has not
exited within ``STOP_S``: a frontend or a mocker spawns threads and helpers, and a killed parent
must not leave them holding ports for the next test. A test process that dies without its
teardown (SIGKILL) takes the fleet with it: each process is started with Linux's
``PR_SET_PDEATHSIG`` (SIGTERM), as our own nats-server is.

Worker instance ids are random u64s drawn by each worker at start. seqstate must carry all 64
bits, and a value above 2^63 is what breaks a signed 64-bit path, so :meth:`Fleet.start_workers`
restarts the single-rank mocker until some worker holds an id above 2^63 (each start is a fair
coin; the loop gives up after ``HIGH_ID_TRIES``, which fails with odds of 2^-24).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_etcd import EtcdGateway, etcd_args, etcd_binary

from projector.nats.server import _death_signal_setter

DYNAMO_VERSION = "1.6.1"
MODEL = "tiny"
BLOCK_SIZE = 16
NAMESPACE, COMPONENT, ENDPOINT = "dynamo", "backend", "generate"
# What `seqstate run --dynamo-endpoint` takes, and the subject Dynamo publishes it on.
DYNAMO_ENDPOINT = f"{NAMESPACE}.{COMPONENT}.{ENDPOINT}"
EVENTS_SUBJECT = (
    f"namespace.{NAMESPACE}.component.{COMPONENT}.endpoint.{ENDPOINT}.active_sequences_events"
)
# Each token takes ~0.1 s of the mocker's simulated decode, so a stream with a large max_tokens
# stays in flight until the test closes it; no assertion depends on that speed.
DECODE_SPEEDUP = "0.05"
STOP_S = 10.0
HIGH_ID_TRIES = 24
TOP_BIT = 1 << 63
HERE = Path(__file__).resolve().parent
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def default_venv() -> Path:
    """Where ``make test-dynamo`` keeps the Dynamo venv: outside the checkout, built once."""
    configured = os.environ.get("DYNAMO_VENV")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "seqstate" / f"dynamo-{DYNAMO_VERSION}"


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (bound together, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class Proc:
    """One Dynamo process: its group is the unit that is stopped, its log what is read."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    rpc_port: int

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def lines(self) -> list[str]:
        """Its log, line by line, ANSI colours stripped (Dynamo colours its logs regardless)."""
        return [_ANSI.sub("", line) for line in self.log.read_text(errors="replace").splitlines()]

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.lines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def check(self) -> None:
        """Raise with the log's tail if the process has exited: a wait for it is then over."""
        if not self.alive:
            raise AssertionError(
                f"{self.name} exited with {self.popen.returncode}; log {self.log}:\n{self.tail()}"
            )

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to the group after ``STOP_S``; reaps the leader."""
        if self.alive:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait()
        # Helpers the leader left behind die with their group even when the leader exited.
        self._signal_group(signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the group, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait()


@dataclass
class Frontend(Proc):
    """A KV-router frontend with replica sync; ``router_id`` is learnt from its first AddRequest."""

    http_port: int = 0
    router_id: int | None = None


@dataclass(frozen=True)
class Entry:
    """One discovery key, whichever backend holds it: its key as Dynamo wrote it (``v1/...``,
    unencoded), its JSON value, and (etcd only) the lease it is attached to; files have none."""

    key: str
    value: dict[str, Any]
    lease: int | None = None


DISCOVERIES = ("file", "etcd")


@dataclass
class Fleet:
    """The processes of one fleet, sharing a nats-server and a discovery (files or etcd)."""

    python: Path
    root: Path
    nats_url: str
    discovery: str = "file"
    nats_monitor: str | None = None  # nats-server's HTTP monitoring, if it serves one
    model_dir: Path = field(init=False)
    file_kv: Path = field(init=False)
    etcd: Proc | None = None
    mockers: list[Proc] = field(default_factory=list)
    frontends: list[Frontend] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.discovery in DISCOVERIES, self.discovery
        self.model_dir = self.root / "model"
        self.file_kv = self.root / "discovery"
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.file_kv.mkdir(exist_ok=True)

    # ---- starting -------------------------------------------------------------------------

    def write_model(self) -> None:
        """The tiny tokenizer and config, written by the Dynamo venv (it has ``tokenizers``)."""
        subprocess.run(
            [str(self.python), str(HERE / "make_tiny_model.py"), str(self.model_dir)],
            check=True,
            capture_output=True,
        )

    def start_etcd(self) -> Proc:
        """The fleet's etcd (``discovery="etcd"`` only): ready once ``gateway.healthy()``."""
        assert self.discovery == "etcd" and self.etcd is None
        binary = etcd_binary()
        if binary is None or not binary.exists():
            raise AssertionError(
                f"no etcd binary ({binary or 'none found'}): run tests/dynamo/install_etcd.sh,"
                " or set ETCD_BIN"
            )
        client, peer = free_ports(2)
        args = etcd_args(binary, self.root / "etcd-data", client, peer)
        self.etcd = Proc(
            "etcd", self._spawn("etcd", args, dict(os.environ)), self._log("etcd"), client
        )
        return self.etcd

    @property
    def gateway(self) -> EtcdGateway:
        assert self.etcd is not None, "no etcd in a fleet on file discovery"
        return EtcdGateway(f"http://127.0.0.1:{self.etcd.rpc_port}")

    def _env(self, rpc_port: int, response_port: int | None = None) -> dict[str, str]:
        """Dynamo's environment: NATS event plane, TCP request plane, the fleet's
        discovery, no hub; distinct TCP ports per process, so two never fight over one."""
        env = dict(os.environ)
        env.update(
            NATS_SERVER=self.nats_url,
            DYN_DISCOVERY_BACKEND=self.discovery,
            DYN_EVENT_PLANE="nats",
            DYN_REQUEST_PLANE="tcp",
            DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            DYN_TCP_RPC_PORT=str(rpc_port),
            HF_HUB_OFFLINE="1",
            NO_COLOR="1",
        )
        if self.discovery == "etcd":
            env["ETCD_ENDPOINTS"] = self.gateway.url
        else:
            env["DYN_FILE_KV"] = str(self.file_kv)
        if response_port is not None:
            env["DYN_TCP_RESPONSE_STREAM_PORT"] = str(response_port)
        return env

    def _log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self._log(name).open("ab") as out:
            return subprocess.Popen(
                args,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one
                cwd=self.root,
                # SIGTERM when the test process dies, even by SIGKILL: no fleet outlives its run.
                preexec_fn=_death_signal_setter(),
            )

    def _dynamo(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self._spawn(name, [str(self.python), "-m", *args], env)

    def start_mocker(self, name: str, *, dp: int = 1, env: dict[str, str] | None = None) -> Proc:
        (rpc,) = free_ports(1)
        args = [
            "dynamo.mocker",
            "--model-path",
            str(self.model_dir),
            "--model-name",
            MODEL,
            "--block-size",
            str(BLOCK_SIZE),
            "--decode-speedup-ratio",
            DECODE_SPEEDUP,
        ]
        if dp > 1:
            args += ["--data-parallel-size", str(dp)]
        popen = self._dynamo(name, args, {**self._env(rpc), **(env or {})})
        proc = Proc(name, popen, self._log(name), rpc)
        self.mockers.append(proc)
        return proc

    def start_frontend(self, name: str, *extra: str, env: dict[str, str] | None = None) -> Frontend:
        """A KV-router frontend with replica sync; ``env`` adds to (or overrides) Dynamo's
        environment, e.g. ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS``."""
        rpc, response, http = free_ports(3)
        args = [
            "dynamo.frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http),
            "--router-mode",
            "kv",
            "--router-replica-sync",
            "--event-plane",
            "nats",
            "--discovery-backend",
            self.discovery,
            "--request-plane",
            "tcp",
            *extra,
        ]
        popen = self._dynamo(name, args, {**self._env(rpc, response), **(env or {})})
        front = Frontend(name, popen, self._log(name), rpc, http_port=http)
        self.frontends.append(front)
        return front

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

    # ---- stopping and reading ---------------------------------------------------------------

    def stop_proc(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.mockers:
            self.mockers.remove(proc)
        if isinstance(proc, Frontend) and proc in self.frontends:
            self.frontends.remove(proc)

    def kill_proc(self, proc: Proc) -> None:
        """SIGKILL a process of the fleet (its group), as a crash would, and forget it."""
        proc.kill()
        self.stop_proc(proc)

    def stop(self) -> None:
        """Frontends first (they route), then the workers, then etcd (they hold leases on it);
        each group SIGTERM, then SIGKILL."""
        for proc in [*self.frontends, *self.mockers]:
            proc.stop()
        self.frontends.clear()
        self.mockers.clear()
        if self.etcd is not None:
            self.etcd.stop()

    def check(self) -> None:
        for proc in [*self.mockers, *self.frontends, *([self.etcd] if self.etcd else [])]:
            proc.check()

    def tails(self, lines: int = 40) -> str:
        logs = sorted((self.root / "logs").glob("*.log"))
        parts = []
        for log in logs:
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log} ---\n" + "\n".join(_ANSI.sub("", t) for t in text))
        return "\n".join(parts)
