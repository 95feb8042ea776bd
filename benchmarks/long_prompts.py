"""What a long prompt costs, from the router's publish until a scheduler's view shows it.

Why this exists: the bucket holds a request's prompt hashes in keys of at most 4,096 hashes (a
head and its parts, ``projector/wire/values.py``), so a 1M-token prompt (62,500 blocks of 16
tokens) is 16 keys and its cost must follow its size, never stop the projector. This measures,
for prompts of several sizes, the time from ``RouterPublisher.add`` to the moment a
``RegistryView`` has applied it (``wait_for``), the same for its ``Free``, and the keys the
booking wrote, each as a ratio to a typical 16-hash prompt measured in the same run.

    .venv/bin/python benchmarks/long_prompts.py [--repeats 7]

One process: its own nats-server (JetStream, temporary store), a writer and a projector
(``Pipeline``), a publisher and a view, each on its own connection. Sizes are measured
interleaved (every size once per repeat), and each figure is the median over the repeats.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time

import nats
from harness.cli import argument_parser
from harness.report import git_revision

from projector.bucket.reader import RegistryView
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.values import KEY_HASHES
from seqstate import Free, WorkerAdded

rng = random.Random(7)
SIZES = {
    "16 hashes (typical)": [rng.getrandbits(64) for _ in range(16)],
    "4,096 hashes (one key)": [rng.getrandbits(64) for _ in range(KEY_HASHES)],
    "62,500 hashes (1M tokens)": [rng.getrandbits(64) for _ in range(62_500)],
    "140,000 small hashes": list(range(1, 140_001)),
}
REFERENCE = "16 hashes (typical)"


def keys_of(hashes: list[int]) -> int:
    """The bucket keys one booking writes: its head, and a part per further 4,096 hashes."""
    return max(1, -(-len(hashes) // KEY_HASHES))


async def run(repeats: int) -> None:
    with NatsServer() as server:
        pipe_nc, pub_nc, view_nc = [await nats.connect(server.url) for _ in range(3)]
        config = Config(namespace="longbench")
        async with Pipeline(pipe_nc, config):
            pub = RouterPublisher(pub_nc, namespace=config.namespace, router_id="bench")
            view = await RegistryView(view_nc, config=config).start()
            await view.wait_for(await pub.publish(WorkerAdded(worker_id=1)), timeout=30)
            add_ms: dict[str, list[float]] = {name: [] for name in SIZES}
            free_ms: dict[str, list[float]] = {name: [] for name in SIZES}
            for repeat in range(repeats):
                for name, hashes in SIZES.items():
                    rid = f"{name}-{repeat}"
                    started = time.perf_counter()
                    seq = await pub.add(rid, 1, block_hashes=hashes, prefill_tokens=len(hashes))
                    await view.wait_for(seq, timeout=60)
                    add_ms[name].append(1000 * (time.perf_counter() - started))
                    (row,) = view.loads()
                    assert row.active_blocks == len(set(hashes)), (name, row)
                    started = time.perf_counter()
                    await view.wait_for(await pub.publish(Free(rid, 1)), timeout=60)
                    free_ms[name].append(1000 * (time.perf_counter() - started))
            await view.stop()
        for nc in (pipe_nc, pub_nc, view_nc):
            await nc.close()
    ref_add = statistics.median(add_ms[REFERENCE])
    ref_free = statistics.median(free_ms[REFERENCE])
    print(f"# long prompts, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# commit {git_revision()}, {os.cpu_count()} CPUs, {repeats} repeats, medians")
    print("\n| prompt | keys | add to view ms | ratio | free to view ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, hashes in SIZES.items():
        add, free = statistics.median(add_ms[name]), statistics.median(free_ms[name])
        print(
            f"| {name} | {keys_of(hashes)} | {add:.1f} | {add / ref_add:.1f}x | "
            f"{free:.1f} | {free / ref_free:.1f}x |"
        )


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--repeats", type=int, default=7)
    asyncio.run(run(p.parse_args().repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
