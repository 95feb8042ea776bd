"""Fuzzed bytes on every subject a role may publish to, sent to real processes.

A ``seqstate writer``, a ``seqstate projector`` and a ``seqstate watch --json`` (a view) run as
the operator starts them. A fixed-seed corpus (``tests/support/fuzz_bytes.py``: valid events at
the edges of their ranges, cut short, flipped, spliced, with integers past 64 bits, headers
that claim 2^32-1 items, nesting up to 200,000 deep, types no field has, events near and past
the writer's size rule) goes on routers' worker and routers subjects and the operator's control
subject; broken and forged messages go on the deltas subject, which the writer's role may
publish to. Half way, the writer and the projector are SIGKILLed and started again over what
they had folded. Every process stays up; the writer's snapshot and the bucket are what one
uninterrupted fold of the log gives; ``seqstate replay --verify`` (its default, fast, reader)
says identical and a replay from the first event counts every dead letter; the view followed to
the last event.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from eventually import eventually
from fault_kit import (
    ROOT,
    Service,
    assert_exact,
    fault_config,
    stop_all,
    wait_current,
)
from fuzz_bytes import messages, mutate
from nats.aio.client import Client
from pipeline_kit import name_flags, read_events

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.headers import PREV_SOURCE_SEQ
from seqstate import Fold, Refusal

SEED = 2112
EVENTS = 1_500
FORGED = 60  # on the deltas subject


def run_cli(config: Config, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = Service(args[0], config, url, Path(".")).env()
    argv = [sys.executable, "-m", "projector", *args, *name_flags(config)]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def forged_deltas(rng: random.Random, stored: list[bytes]) -> list[tuple[bytes, dict[str, str]]]:
    """What the writer's role could store that no writer writes: broken bytes, no chain
    header, a chain that breaks, slots no writer names."""
    out = [(data, {}) for data in stored]  # exact copies of older messages, no chain header
    for n in range(FORGED - len(out)):
        data = mutate(rng, rng.choice(stored), rng.choice(stored))
        headers = rng.choice([{}, {PREV_SOURCE_SEQ: "x"}, {PREV_SOURCE_SEQ: str(10**6 + n)}])
        out.append((data, headers))
    return out


async def test_fuzzed_bytes_on_every_subject_a_role_may_publish_to_stop_nothing(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fault_config("z", expiry_s=30.0, idle_tick_s=3600.0, tick_every_s=3600.0)
    await ensure(nc, config)
    js = nc.jetstream()
    url = nats_server.url
    writer = Service("writer", config, url, tmp_path)
    projector = Service("projector", config, url, tmp_path)
    services = [writer, projector]
    view_log = tmp_path / "watch.jsonl"
    watch_argv = [sys.executable, "-m", "projector", "watch", "--json", *name_flags(config)]
    rng = random.Random(SEED)
    corpus = messages(rng, config.namespace, EVENTS, hostile=0.5, big=0.003)
    view: subprocess.Popen[bytes] | None = None
    try:
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        # Once a projector has run the namespace: before, a watch refuses it as unknown.
        with view_log.open("wb") as out:
            view = subprocess.Popen(
                watch_argv, stdout=out, stderr=subprocess.STDOUT, env=writer.env(), cwd=ROOT
            )
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="fz", config=config)
        await pub.add("first", 1, block_hashes=[1, 2])
        half = len(corpus) // 2
        for subject, data in corpus[:half]:
            await js.publish(subject, data)
        stored = [(await js.get_msg(config.deltas_stream, 1)).data]
        for data, headers in forged_deltas(rng, stored):
            await js.publish(config.deltas_subject, data, headers=headers)
        for service in services:  # killed over the fuzz, started again over it
            service.kill()
            await service.start(js, 0)
            await service.wait_ready(js)
        for subject, data in corpus[half:]:
            await js.publish(subject, data)
        last = await pub.add("last", 1, block_hashes=[3])

        await wait_current(js, writer, projector, last)

        def seen() -> int:
            lines = view_log.read_text(errors="replace").splitlines()
            return max(
                (json.loads(x).get("applied_seq", 0) for x in lines if x[:1] == "{"), default=0
            )

        def view_alive() -> None:
            assert view is not None
            if view.poll() is not None:
                raise AssertionError(
                    f"the view exited with {view.returncode}\n{view_log.read_text()}"
                )

        await eventually(seen, lambda seq: seq >= last, what="the view followed", check=view_alive)
        await stop_all(services)
    finally:
        for service in services:
            service.close()
        if view is not None and view.poll() is None:
            view.kill()
            view.wait(10)
    await assert_exact(nc, config, last)
    # The dead letters: each message the one fold refuses, once, and each forged delta.
    fold = Fold(config.new_state(), config.fold_rules)
    refused = sum(type(fold(*message)) is Refusal for message in await read_events(nc, config))
    assert refused > EVENTS // 3
    dead = await js.stream_info(dead_letter_stream(config))
    assert dead.state.messages == refused + FORGED
    out = run_cli(config, url, "replay", "--verify")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout + out.stderr
    out = run_cli(config, url, "replay", "--from-seq", "1")
    assert out.returncode == 0 and f"({refused} dead-lettered)" in out.stdout, (
        out.stdout + out.stderr
    )
