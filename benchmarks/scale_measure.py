"""``scale.py``'s churn phases and what they observe: CPU per process, stream bytes, the
view's own fold, the lag from a publish to the view reflecting it.

A phase's figures are differences between two observations (before and after): the streams
only grow, and CPU seconds only add up, so the difference is what the phase cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from harness.measure import collect, percentile, process_cpu_s
from harness.servers import start_seqstate, stop
from harness.workload import WAIT_TIMEOUT_S
from nats.aio.client import Client

from projector.bucket.reader import RegistryView
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from seqstate import AddRequest, Event

DEL_HEADER: Final = len(b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n")


class CountingView(RegistryView):
    """A RegistryView that counts what its watch delivers and the CPU time its fold takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delivered = 0
        self.stored_bytes = 0  # file-store record size of every delivered value
        self.fold_ns = 0
        self._subject_prefix = len(f"$KV.{self.config.registry_bucket}.")

    def receive(self, key: str, value: bytes | None, *, deleted: bool = False) -> None:
        t0 = time.thread_time_ns()
        super().receive(key, value, deleted=deleted)
        self.fold_ns += time.thread_time_ns() - t0
        self.delivered += 1
        size = 22 + self._subject_prefix + len(key) + len(value or b"") + 8
        self.stored_bytes += size + (4 + DEL_HEADER if deleted else 0)


@dataclass
class Consumers:
    writer: subprocess.Popen[bytes]
    projector: subprocess.Popen[bytes]
    logs: Path
    set_per_rank: int = 0

    def tail(self) -> str:
        parts = []
        for name in ("writer", "projector"):
            path = self.logs / f"{name}.log"
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-5:]
                parts.append(f"{name}: " + " | ".join(lines))
        return "; ".join(parts)


def start_consumers(url: str, logs: Path, level: str, snapshots: bool) -> Consumers:
    settings = {"SEQSTATE_LOG_LEVEL": level}
    if not snapshots:  # a diagnosis: what the writer's snapshots cost
        settings.update(SEQSTATE_SNAPSHOT_EVERY_EVENTS="0", SEQSTATE_SNAPSHOT_EVERY_S="0")
    procs = {
        name: start_seqstate([name], url, logs / f"{name}.log", **settings)
        for name in ("writer", "projector")
    }
    return Consumers(procs["writer"], procs["projector"], logs)


def start_spies(
    args: argparse.Namespace, consumers: Consumers, blocks: int
) -> list[subprocess.Popen[bytes]]:
    """Diagnosis (``--py-spy DIR``): sample the writer, the projector and this process during
    the saturated churn, as collapsed stacks (flamegraph input) in DIR."""
    if not args.py_spy:
        return []
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("--py-spy: py-spy is not installed (pip install py-spy)")
    out = Path(args.py_spy)
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in (
        ("writer", consumers.writer.pid),
        ("projector", consumers.projector.pid),
        ("bench", os.getpid()),
    ):
        path = out / f"{consumers.set_per_rank}x{blocks}-{name}.txt"
        spies.append(
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--nonblocking",
                    "--output",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(0.5)  # let them attach
    return spies


def cpu_now(consumers: Consumers, server_pid: int) -> dict[str, float]:
    return {
        "writer": process_cpu_s(consumers.writer.pid),
        "projector": process_cpu_s(consumers.projector.pid),
        "nats_server": process_cpu_s(server_pid),
        "bench": time.process_time(),
    }


async def streams_now(nc: Client, config: Config, view: CountingView) -> dict[str, Any]:
    js = nc.jetstream()
    out: dict[str, Any] = {}
    for key, name in (
        ("events", config.events_stream),
        ("deltas", config.deltas_stream),
        ("kv", f"KV_{config.registry_bucket}"),
    ):
        state = (await js.stream_info(name)).state
        out[key] = {"messages": state.messages, "bytes": state.bytes, "last_seq": state.last_seq}
    out["view"] = {
        "delivered": view.delivered,
        "stored_bytes": view.stored_bytes,
        "fold_ns": view.fold_ns,
    }
    return out


def costs(
    events: int,
    cpu0: dict[str, float],
    cpu1: dict[str, float],
    s0: dict[str, Any],
    s1: dict[str, Any],
) -> dict[str, Any]:
    """CPU µs and stored bytes per event between two observations."""
    cpu_us = {k: (cpu1[k] - cpu0[k]) * 1e6 / events for k in cpu0}
    cpu_us["view_fold"] = (s1["view"]["fold_ns"] - s0["view"]["fold_ns"]) / 1e3 / events
    kv_written = s1["kv"]["last_seq"] - s0["kv"]["last_seq"]
    delivered = s1["view"]["delivered"] - s0["view"]["delivered"]
    return {
        "cpu_us_per_event": cpu_us,
        "bytes_per_event": {
            "events": (s1["events"]["bytes"] - s0["events"]["bytes"]) / events,
            "deltas": (s1["deltas"]["bytes"] - s0["deltas"]["bytes"]) / events,
            "kv": (s1["view"]["stored_bytes"] - s0["view"]["stored_bytes"]) / events,
        },
        "messages_per_event": {
            "events": (s1["events"]["messages"] - s0["events"]["messages"]) / events,
            "deltas": (s1["deltas"]["messages"] - s0["deltas"]["messages"]) / events,
            "kv": kv_written / events,
        },
        "kv_written": kv_written,
        "kv_delivered_to_view": delivered,
        "kv_state_bytes_change": s1["kv"]["bytes"] - s0["kv"]["bytes"],
    }


def latency_summary(samples_s: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    if not ordered:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": percentile(ordered, 99) * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def reflected_after(view: RegistryView, seq: int, since: float) -> float:
    """Seconds from ``since`` until the view reflects ``seq``."""
    await view.wait_for(seq, timeout=WAIT_TIMEOUT_S)
    return time.perf_counter() - since


async def publish_chunks(pub: RouterPublisher, events: Sequence[Event], chunk: int) -> int:
    last = 0
    for start in range(0, len(events), chunk):
        seqs = await pub.publish_many(events[start : start + chunk])
        last = max(last, *seqs)
    return last


# ---- the phases ---------------------------------------------------------------------------


@dataclass
class Pipeline:
    """What a phase publishes through and observes: the publisher's connection and config, the
    publisher, this process's view, the consumers and the nats-server's pid."""

    nc: Client
    config: Config
    pub: RouterPublisher
    view: CountingView
    consumers: Consumers
    server_pid: int


async def saturated_churn(
    args: argparse.Namespace, pipeline: Pipeline, steps: list[list[Event]], blocks: int
) -> dict[str, Any]:
    nc, config, pub, view = pipeline.nc, pipeline.config, pipeline.pub, pipeline.view
    consumers, server_pid = pipeline.consumers, pipeline.server_pid
    events = [event for step in steps for event in step]
    collect()
    spies = start_spies(args, consumers, blocks)
    s0 = await streams_now(nc, config, view)
    cpu0 = cpu_now(consumers, server_pid)
    samplers: list[asyncio.Task[float]] = []
    t0 = time.perf_counter()
    last = 0
    for start in range(0, len(events), args.chunk):
        seqs = await pub.publish_many(events[start : start + args.chunk])
        acked = time.perf_counter()
        last = max(last, *seqs)
        for i in range(start, start + len(seqs)):
            if i % args.sample_every == args.sample_every - 1:
                samplers.append(asyncio.create_task(reflected_after(view, seqs[i - start], acked)))
    published = time.perf_counter() - t0
    await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    cpu1 = cpu_now(consumers, server_pid)
    stop(spies, signal.SIGINT)
    lags = await asyncio.gather(*samplers)
    s1 = await streams_now(nc, config, view)
    adds = sum(isinstance(e, AddRequest) for e in events)
    return {
        "events": len(events),
        "seconds": seconds,
        "publish_seconds": published,
        "events_per_s": len(events) / seconds,
        "hashes_per_s": adds * blocks / seconds,
        "lag_at_saturation": latency_summary(lags),
        **costs(len(events), cpu0, cpu1, s0, s1),
    }


async def paced_churn(
    args: argparse.Namespace, pipeline: Pipeline, steps: list[list[Event]]
) -> dict[str, Any]:
    nc, config, pub, view = pipeline.nc, pipeline.config, pipeline.pub, pipeline.view
    consumers, server_pid = pipeline.consumers, pipeline.server_pid
    loop = asyncio.get_running_loop()
    interval = 3 / args.paced_rate
    events = sum(len(step) for step in steps)
    collect()
    s0 = await streams_now(nc, config, view)
    cpu0 = cpu_now(consumers, server_pid)
    from_ack: list[asyncio.Task[float]] = []
    from_start: list[asyncio.Task[float]] = []
    late = 0
    began_unix = time.time()
    begin = loop.time()
    t0 = time.perf_counter()
    last = 0
    for k, step in enumerate(steps):
        due = begin + k * interval
        wait = due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -interval:
            late += 1
        started = time.perf_counter()
        seqs = await pub.publish_many(step)
        acked = time.perf_counter()
        last = max(last, *seqs)
        add_seq = seqs[1]  # Free, AddRequest, MarkPrefillCompleted
        from_ack.append(asyncio.create_task(reflected_after(view, add_seq, acked)))
        from_start.append(asyncio.create_task(reflected_after(view, add_seq, started)))
    sent = time.perf_counter() - t0
    await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
    cpu1 = cpu_now(consumers, server_pid)
    ack_lat = await asyncio.gather(*from_ack)
    # The slowest samples, with when they were sent (s after the phase began): a stall
    # shows as a run of neighbours; ``began_unix`` lines them up with the consumers' logs.
    worst = sorted(range(len(ack_lat)), key=ack_lat.__getitem__)[-5:]
    start_lat = await asyncio.gather(*from_start)
    s1 = await streams_now(nc, config, view)
    return {
        "events": events,
        "offered_rate": args.paced_rate,
        "achieved_rate": events / sent,
        "steps_late": late,
        "began_unix": began_unix,
        "worst": [(round(k * interval, 3), round(ack_lat[k] * 1e3, 1)) for k in worst],
        "ack_to_view": latency_summary(ack_lat),
        "start_to_view": latency_summary(start_lat),
        **costs(events, cpu0, cpu1, s0, s1),
    }
