"""The Dynamo dashboard's queries read what a running writer, projector and frontend export.

``seqstate writer`` and ``seqstate projector`` run as the commands Kubernetes and compose run
(``--dynamo-endpoint``, ``--metrics-port``) while the shared capture of a real fleet's replica
sync is published on Dynamo's subject, less one frontend message (a hole) and plus one edge
the fold refuses (a dead letter). Both /metrics are scraped over HTTP: the capture rate per
publisher counts exactly each publisher's messages, the hole and the dead letter are counted
once, and every query of deploy/grafana/dashboards/seqstate-dynamo.json names only metrics and
labels that these scrapes, or a real Dynamo 1.6.1 frontend's /metrics (recorded in tests/data
by tests/dynamo/test_dashboard_live.py, which checks it against a live fleet), carry.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_capture import CAPTURE, EDGES, ENDPOINT, FRONTEND_A, SUBJECT
from eventually import eventually
from http_kit import http_get
from nats.aio.client import Client
from pipeline_kit import REPO, fresh_config, logged, name_flags
from promql_labels import dashboard_queries, exported, problems
from test_metrics import command, free_port, parse, pick

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from seqstate.dynamo import decode_dynamo

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "seqstate-dynamo.json"
FRONTEND_TEXT = REPO / "tests" / "data" / "dynamo-frontend-metrics-1.6.1.txt"


async def scrape(port: int) -> str:
    status, _, body = await http_get(port, "/metrics")
    assert status == 200
    return body


async def test_every_query_reads_what_the_pipeline_and_a_frontend_export(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("dash", dynamo_endpoint=ENDPOINT)
    await ensure(nc, config)
    messages = [decode_dynamo(m.data) for m in CAPTURE]
    # A message of frontend A between two others of A, the later revealing it missing: one
    # hole (a publisher's first message heard is where its count starts, never a hole).
    of_a = [i for i, m in enumerate(messages) if m.publisher_id == FRONTEND_A]
    dropped = of_a[1]
    sent = [m.data for i, m in enumerate(CAPTURE) if i != dropped]
    edge, _reason = next(iter(EDGES.values()))
    expected: dict[str, int] = {}
    for i, m in enumerate(messages):
        if i != dropped:
            expected[str(m.publisher_id)] = max(
                expected.get(str(m.publisher_id), 0), m.sequence + 1
            )

    ports = {"writer": free_port(), "projector": free_port()}
    own = {"writer": ["--idle-tick-s", "3600", "--tick-every-s", "3600"], "projector": []}

    def started(role: str):  # as an operator (compose, Kubernetes) starts each
        flags = [*name_flags(config), "--dynamo-endpoint", ENDPOINT, "--lag-check-s", "0.2"]
        flags += [*own[role], "--metrics-port", str(ports[role])]
        return command(nats_server.url, tmp_path / f"{role}.log", role, *flags)

    async with started("writer"), started("projector"):
        # The edge amid the traffic: the projector's position moves with the writer's deltas,
        # and a message dead-lettered last would leave it one short until the next Tick.
        for data in [*sent[:10], edge, *sent[10:]]:
            await nc.publish(SUBJECT, data)
        await nc.flush()
        last = await logged(nc, config, len(sent) + 1)
        ns = config.namespace

        texts = {}
        for role, port in ports.items():
            at = {"namespace": ns, "role": role}
            texts[role] = await eventually(
                lambda port=port: scrape(port),
                lambda text, at=at: (
                    pick(parse(text), "seqstate_applied_seq", **at) == last
                    and pick(parse(text), "seqstate_lag_events", **at) == 0
                    # the writer's capture measured too (the projector exports none)
                    and (
                        at["role"] == "projector"
                        or pick(parse(text), "seqstate_capture_waiting_messages", namespace=ns)
                        is not None
                    )
                ),
                what=f"the {role} at the last captured message, its lag measured",
                interval=0.05,
                retry_on=(OSError,),
            )
        ours, theirs = texts["writer"], texts["projector"]

    got = parse(ours)
    per_publisher = {
        dict(labels)["publisher"]: value
        for (name, labels), value in got.items()
        if name == "seqstate_dynamo_publisher_messages_total" and dict(labels)["namespace"] == ns
    }
    assert per_publisher == expected
    lost = "seqstate_dynamo_messages_lost_total"
    assert pick(got, lost, namespace=ns, publisher="all") == 1
    assert pick(got, lost, namespace=ns, publisher=str(FRONTEND_A)) == 1
    dead = "seqstate_dead_letters_total"
    assert pick(got, dead, namespace=ns, role="writer", reason="undecodable") == 1
    assert pick(got, "seqstate_capture_waiting_messages", namespace=ns) == 0

    names = exported(ours)
    for text in (theirs, FRONTEND_TEXT.read_text()):
        for name, labels in exported(text).items():
            names.setdefault(name, set()).update(labels)
    found = {expr: problems(expr, names) for expr in dashboard_queries(DASHBOARD)}
    assert not any(found.values()), {e: p for e, p in found.items() if p}
