"""The Dynamo dashboard's queries against a real fleet's frontends and seqstate's own /metrics.

deploy/grafana/dashboards/seqstate-dynamo.json sets the ledger's per-rank blocks beside each
frontend's ``dynamo_frontend_worker_active_decode_blocks``. With requests held in flight
through both frontends and seqstate agreeing with them (seqstate_kit.agree), both /metrics
are scraped over HTTP: every query of the dashboard must name only metrics and labels the
scrapes carry, the "ledger minus frontends" panel's join must read 0 on every rank (its
``label_replace`` of ``worker_id`` into ``worker`` meets the ledger's series), and the frontend's
text, as scraped, must still be what tests/data/dynamo-frontend-metrics-1.6.1.txt (the file the
suite without a fleet checks the dashboard against) says of those metrics.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from dynamo_kit import close_all, http_get
from prometheus_client.parser import text_string_to_metric_families
from promql_labels import dashboard_queries, exported, problems
from seqstate_kit import NAMESPACE, REPO, agree, per_rank
from test_seqstate import hold

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "seqstate-dynamo.json"
FRONTEND_TEXT = REPO / "tests" / "data" / "dynamo-frontend-metrics-1.6.1.txt"
DECODE = "dynamo_frontend_worker_active_decode_blocks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


METRICS_PORT = free_port()
SEQSTATE_ARGS = ("--dynamo-resync", "off", "--metrics-port", str(METRICS_PORT))


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """``name``'s values by (worker label, dp_rank)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                worker = s.labels.get("worker", s.labels.get("worker_id", ""))
                out[(worker, s.labels["dp_rank"])] = s.value
    return out


async def test_the_dashboard_reads_what_the_frontends_and_seqstate_export(
    live, seqstate, tmp_path: Path
):
    rids, streams = await hold(live, 7000, 4)
    try:
        await agree(live, seqstate, per_rank(live, rids), "four requests held")
        fronts = []
        for front in live.frontends:
            status, body = await http_get(front.http_port, "/metrics")
            assert status == 200
            fronts.append(body.decode())
        status, body = await http_get(METRICS_PORT, "/metrics")
        assert status == 200
        ours = body.decode()
    finally:
        await close_all(streams)
    (tmp_path / "frontend-metrics.txt").write_text(fronts[0])  # kept with the run's logs

    names = exported(ours)
    for text in fronts:
        names.update(exported(text))
    found = {expr: problems(expr, names) for expr in dashboard_queries(DASHBOARD)}
    assert not any(found.values()), {e: p for e, p in found.items() if p}

    # The join of the comparison panel: each frontend's gauge, keyed as the ledger's series.
    ledger = {
        key: value for key, value in samples(ours, "seqstate_worker_active_blocks").items() if value
    }
    assert ledger, "no rank of the ledger holds a block"
    for text in fronts:
        assert {k: v for k, v in samples(text, DECODE).items() if v} == ledger
    assert f'namespace="{NAMESPACE}"' in ours

    # The fixture the fleet-less suite reads says the same of the dashboard's Dynamo metrics.
    recorded = exported(FRONTEND_TEXT.read_text())
    for name, labels in exported(fronts[0]).items():
        if name.startswith("dynamo_frontend_worker_"):
            assert recorded.get(name) == labels, (name, labels, recorded.get(name))
