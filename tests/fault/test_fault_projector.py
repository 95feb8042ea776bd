"""The projector is SIGKILLed at random points while deltas flow, restarted each time,
and its bucket ends byte for byte as that of one uninterrupted projector over the same deltas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
from eventually import eventually
from fault_kit import (
    BUSY,
    Service,
    bucket_position,
    bucket_values,
    fault_config,
    kill_schedule,
    run_with_kills,
    wait_current,
    workload,
)
from nats.aio.client import Client

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.wire.values import (
    decode_load,
    decode_position,
    decode_request,
    parse_key,
    position_key,
)

KILLS = 4


def decoded(namespace: str, values: dict[str, bytes]) -> dict[str, object]:
    """The bucket's values in readable form, for a failure message that names the difference."""
    out: dict[str, object] = {}
    for key, raw in values.items():
        kind = parse_key(namespace, key).kind
        if kind == "load":
            out[key] = msgspec.to_builtins(decode_load(raw))
        elif kind == "req":
            value = decode_request(raw)
            out[key] = (value.applied_seq, value.request_id, value.hash_list())
        elif kind == "position":
            out[key] = msgspec.to_builtins(decode_position(raw))
        else:
            out[key] = raw
    return out


@pytest.mark.parametrize("seed", [21, 22, 23])
async def test_a_projector_killed_at_random_points_writes_the_uninterrupted_bucket(
    nc: Client, nats_server: NatsServer, tmp_path: Path, seed: int
) -> None:
    config = fault_config("p", expiry_s=2.0, idle_tick_s=3600.0)
    # The reference: the same namespace and deltas, into a bucket of its own.
    reference = dataclasses.replace(config, registry_bucket=f"{config.registry_bucket}-ref")
    await ensure(nc, config)
    await ensure(nc, reference)
    js = nc.jetstream()
    steps = workload(seed, config, requests=800)
    writer = Service("writer", config, nats_server.url, tmp_path)
    projector = Service("projector", config, nats_server.url, tmp_path)
    uninterrupted = Service("projector", reference, nats_server.url, tmp_path)

    async def applied() -> int:
        return (await bucket_position(js, config)).applied_seq

    async def applied_ref() -> int:
        return (await bucket_position(js, reference)).applied_seq

    async def further() -> int:
        return await applied() + 150

    try:
        await writer.start(js, 0)
        # A late kill lets the projector apply 150 more events first, publishing on.
        last = await run_with_kills(
            nc,
            config,
            steps,
            projector,
            kill_schedule(seed, len(steps), KILLS),
            progress=applied,
            late_probe=applied,
            late_target=further,
            router_id=f"fault-p{seed}",
        )
        assert await last_seq_of(js, config.events_stream, config.events_subjects) == last
        await wait_current(js, writer, projector, last)
        code = await projector.stop()
        assert code == 0, f"projector exited with {code} on SIGTERM\n{projector.logs()}"
        code = await writer.stop()
        assert code == 0, f"writer exited with {code} on SIGTERM\n{writer.logs()}"

        await uninterrupted.start(js, 0)
        await eventually(
            applied_ref,
            lambda seq: seq >= last,
            what="the uninterrupted projector caught up",
            retry_on=BUSY,
            watch=uninterrupted.logs,
            check=uninterrupted.check,
        )
        code = await uninterrupted.stop()
        assert code == 0, f"projector exited with {code} on SIGTERM\n{uninterrupted.logs()}"
    finally:
        for service in (projector, writer, uninterrupted):
            service.close()
    assert projector.kills == KILLS

    got = await bucket_values(nc, config)
    want = await bucket_values(nc, reference)
    ns = config.namespace
    position = decode_position(want[position_key(ns)])
    assert position.applied_seq == last
    assert position.delta_seq == await last_seq_of(js, config.deltas_stream, config.deltas_subject)
    assert any(parse_key(ns, key).kind == "req" for key in want)
    assert sorted(got) == sorted(want), "the killed projector's keys differ"
    differing = sorted(key for key in want if got[key] != want[key])
    shown = [
        f"{k}: {decoded(ns, {k: got[k]})[k]} != {decoded(ns, {k: want[k]})[k]}"
        for k in differing[:5]
    ]
    assert not differing, f"{len(differing)} values differ: " + "; ".join(shown)
