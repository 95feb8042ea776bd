"""A running writer and projector are NATS services (nats.micro), found with
the discovery requests ``nats micro list|info|stats`` send, their stats saying where they are;
and gone once they stop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.nats.server import NatsServer
from projector.nats.services import NAMES, status_subject
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config

WAIT_S = 10.0


async def answers(nc: Client, subject: str, config: Config, done: Any) -> list[dict[str, Any]]:
    """Every service's answer to a discovery request, gathered until one of ``config``'s
    namespace satisfies ``done`` (services of other tests on this server answer too)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    ours: list[dict[str, Any]] = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            timeout = deadline - asyncio.get_running_loop().time()
            assert timeout > 0, f"no answer of namespace {config.namespace} to {subject}: {ours}"
            answer = json.loads((await sub.next_msg(timeout=timeout)).data)
            if namespace_of(answer) == config.namespace:
                ours.append(answer)
                if done(answer):
                    return ours
    finally:
        await sub.unsubscribe()


def namespace_of(answer: dict[str, Any]) -> str | None:
    if answer.get("metadata"):
        return str(answer["metadata"].get("namespace"))
    for endpoint in answer.get("endpoints", []):
        data = endpoint.get("data") or {}
        if "namespace" in data:
            return str(data["namespace"])
    return None


@pytest.mark.parametrize("kind", ["writer", "projector"])
async def test_a_running_consumer_is_a_nats_service_with_its_position(
    nc: Client, nats_server: NatsServer, kind: str
) -> None:
    config = fresh_config("dv")
    name = NAMES[kind]
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, router_id="r", config=config)
        await pub.add("a", 1, block_hashes=[1, 2], prefill_tokens=10)
        await pub.add("a", 1, block_hashes=[3])  # a duplicate
        last = await pub.free("a", 1)
        await pipeline.projector.wait_flushed(last)

        info = (await answers(nc, f"$SRV.INFO.{name}", config, lambda a: True))[0]
        assert info["type"] == "io.nats.micro.v1.info_response"
        assert info["name"] == name and info["version"]
        assert info["metadata"] == {
            "namespace": config.namespace,
            "events_stream": config.events_stream,
            "deltas_stream": config.deltas_stream,
            "registry_bucket": config.registry_bucket,
        }
        assert [e["subject"] for e in info["endpoints"]] == [status_subject(config, kind)]

        stats = (
            await answers(
                nc,
                f"$SRV.STATS.{name}",
                config,
                lambda a: a["endpoints"][0]["data"]["applied_seq"] == last,
            )
        )[-1]
        data = stats["endpoints"][0]["data"]
        assert (data["kind"], data["applied_seq"]) == (kind, last)
        if kind == "writer":
            assert (data["applied"], data["dead_letters"]) == (3, 0)
            assert data["outcomes"] == {"applied": 2, "duplicate": 1}
        else:
            assert data["holds_lease"] is True and data["deltas"] == 3

        status = json.loads((await nc.request(status_subject(config, kind), b"", WAIT_S)).data)
        assert (status["kind"], status["applied_seq"]) == (kind, last)
        pings = await answers(nc, f"$SRV.PING.{name}", config, lambda a: True)
        assert pings[0]["type"] == "io.nats.micro.v1.ping_response"
    with pytest.raises(nats.errors.NoRespondersError):  # stopped: no longer a service
        await nc.request(status_subject(config, kind), b"", WAIT_S)
