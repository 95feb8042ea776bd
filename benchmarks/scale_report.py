"""``scale.py``'s report: each point's medians over its runs, the targets' verdicts, the
tables and the plot of CPU and stored bytes per event against the active set and the request
size."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, Final

from harness.measure import median
from harness.report import PASS_FAIL, print_head, print_software, verdict
from scale_workload import WORKERS, Point

TARGET_CHURN_RATIO: Final = 2 / 3
TARGET_FRESH_P99_MS: Final = 50.0
TARGET_COLD_START_S: Final = 3.0
TARGET_COLD_SET: Final = 262_144


def summarize(point: Point, runs: list[dict[str, Any]]) -> dict[str, Any]:
    c = [r["churn"] for r in runs]
    p = [r["paced"] for r in runs]
    k = [r["cold"] for r in runs]
    out: dict[str, Any] = {
        "set_per_rank": point.set_per_rank,
        "blocks": point.blocks,
        "requests_per_rank": point.requests_per_rank,
        "runs": len(runs),
        "fill_events_per_s": median([r["fill"]["events"] / r["fill"]["seconds"] for r in runs]),
        "churn_events_per_s": median([x["events_per_s"] for x in c]),
        "churn_events_per_s_runs": [x["events_per_s"] for x in c],
        "churn_hashes_per_s": median([x["hashes_per_s"] for x in c]),
        "churn_lag_p50_ms": median([x["lag_at_saturation"]["p50_ms"] for x in c]),
        "churn_lag_p99_ms": median([x["lag_at_saturation"]["p99_ms"] for x in c]),
        "fresh_p50_ms": median([x["ack_to_view"]["p50_ms"] for x in p]),
        "fresh_p99_ms": median([x["ack_to_view"]["p99_ms"] for x in p]),
        "fresh_p99_ms_runs": [x["ack_to_view"]["p99_ms"] for x in p],
        "fresh_max_ms": max(x["ack_to_view"]["max_ms"] for x in p),
        "fresh_start_p99_ms": median([x["start_to_view"]["p99_ms"] for x in p]),
        "paced_achieved_rate": median([x["achieved_rate"] for x in p]),
        "cold_ready_s": median([x["ready_s"] for x in k]),
        "cold_ready_s_runs": [x["ready_s"] for x in k],
        "cold_cpu_s": median([x["cpu_s"] for x in k]),
        "cold_rss_growth_mb": median([x["rss_growth_mb"] for x in k]),
        "cold_peak_growth_mb": median([x["peak_growth_mb"] for x in k]),
        "cold_present_hashes": k[-1]["present_hashes"],
        "cold_exact": all(x["exact"] for x in k),
        "live_view_exact": all(x["live_view_equals_fold"] for x in k),
    }
    for phase, xs in (("churn", c), ("paced", p)):
        for part in ("cpu_us_per_event", "bytes_per_event", "messages_per_event"):
            for name in xs[0][part]:
                out[f"{phase}_{part}_{name}"] = median([x[part][name] for x in xs])
    return out


def targets(args: argparse.Namespace, summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(s["set_per_rank"], s["blocks"]): s for s in summary}
    out: list[dict[str, Any]] = []
    small, large = (
        by.get((min(args.sets), args.fixed_blocks)),
        by.get((max(args.sets), args.fixed_blocks)),
    )
    if small and large and small is not large:
        ratio = large["churn_events_per_s"] / small["churn_events_per_s"]
        out.append(
            {
                "name": f"churn events/s at {large['set_per_rank']:,}/rank >= 2/3 of "
                f"{small['set_per_rank']:,}/rank",
                "ok": ratio >= TARGET_CHURN_RATIO,
                "detail": f"{large['churn_events_per_s']:,.0f} vs "
                f"{small['churn_events_per_s']:,.0f} events/s: {ratio:.2f} "
                f"(target >= {TARGET_CHURN_RATIO:.2f})",
            }
        )
    worst = max(summary, key=lambda s: s["fresh_p99_ms"])
    out.append(
        {
            "name": f"freshness p99 <= {TARGET_FRESH_P99_MS:g} ms at every point "
            f"(paced at {args.paced_rate:,} events/s)",
            "ok": all(s["fresh_p99_ms"] <= TARGET_FRESH_P99_MS for s in summary),
            "detail": f"worst median p99 {worst['fresh_p99_ms']:.1f} ms at "
            f"{worst['set_per_rank']:,}/rank x {worst['blocks']}; all: "
            + ", ".join(f"{s['fresh_p99_ms']:.1f}" for s in summary),
        }
    )
    cold = by.get((TARGET_COLD_SET, args.fixed_blocks))
    if cold:
        ok = cold["cold_ready_s"] <= TARGET_COLD_START_S and cold["cold_exact"]
        out.append(
            {
                "name": f"view cold start at {WORKERS} x {TARGET_COLD_SET:,} active hashes "
                f"<= {TARGET_COLD_START_S:g} s and exact",
                "ok": ok,
                "detail": f"ready in {cold['cold_ready_s']:.2f} s (runs "
                + ", ".join(f"{x:.2f}" for x in cold["cold_ready_s_runs"])
                + f"), {cold['cold_present_hashes']:,} hashes, exact: "
                f"{cold['cold_exact']}",
            }
        )
    return out


def table(rows: list[dict[str, Any]], key: str, title: str) -> list[str]:
    head = (
        f"| {title} | churn events/s | hashes/s | fresh p50 / p99 ms | lag at saturation "
        "p99 ms | CPU µs/event writer / projector / server / this | bytes/event events / "
        "deltas / KV | cold start s | view RSS MB | exact |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in rows:
        cpu = "churn_cpu_us_per_event_"
        byt = "churn_bytes_per_event_"
        lines.append(
            f"| {s[key]:,} | {s['churn_events_per_s']:,.0f} | {s['churn_hashes_per_s']:,.0f} | "
            f"{s['fresh_p50_ms']:.1f} / {s['fresh_p99_ms']:.1f} | {s['churn_lag_p99_ms']:,.0f} | "
            f"{s[cpu + 'writer']:.0f} / {s[cpu + 'projector']:.0f} / "
            f"{s[cpu + 'nats_server']:.0f} / {s[cpu + 'bench']:.0f} | "
            f"{s[byt + 'events']:,.0f} / {s[byt + 'deltas']:,.0f} / {s[byt + 'kv']:,.0f} | "
            f"{s['cold_ready_s']:.3f} | {s['cold_rss_growth_mb']:.0f} | "
            f"{'yes' if s['cold_exact'] and s['live_view_exact'] else 'NO'} |"
        )
    return lines


def _runs_of(s: dict[str, Any], key: str, spec: str) -> str:
    return ", ".join(format(x, spec) for x in s[key])


def _cpu_of(s: dict[str, Any], phase: str) -> str:
    names = ("writer", "projector", "nats_server", "bench", "view_fold")
    return "/".join(f"{s[f'{phase}_cpu_us_per_event_{name}']:.0f}" for name in names)


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    m, summary = report["machine"], report["summary"]
    print_head("seqstate fleet-scale benchmark (benchmarks/scale.py)", m)
    print_software(m, report["nats_server"])
    print(
        f"  workload   : {WORKERS} workers (dp 0); churn {args.churn_events:,} events "
        f"(publish_many chunks of {args.chunk}, lag sampled every {args.sample_every}th); "
        f"paced {args.paced_events:,} events at {args.paced_rate:,}/s; {args.runs} runs per "
        "point, interleaved, fresh server per run"
    )
    print("  CPU 'this' = this process: publisher + live view (its fold alone in 'view fold')")
    sweep_a = [s for s in summary if s["blocks"] == args.fixed_blocks]
    sweep_b = [s for s in summary if s["set_per_rank"] == args.fixed_set]
    print(f"\nActive set sweep ({args.fixed_blocks} blocks per request), medians:")
    print(
        "\n".join(
            table(sorted(sweep_a, key=lambda s: s["set_per_rank"]), "set_per_rank", "hashes/rank")
        )
    )
    print(f"\nRequest size sweep ({args.fixed_set:,} hashes per rank), medians:")
    print("\n".join(table(sorted(sweep_b, key=lambda s: s["blocks"]), "blocks", "blocks")))
    print("\nPer point (medians over runs; each run's value in brackets):")
    for s in summary:
        runs_of = functools.partial(_runs_of, s)
        cpu = functools.partial(_cpu_of, s)
        print(
            f"  {s['set_per_rank']:,} hashes/rank x {s['blocks']} blocks "
            f"({s['requests_per_rank']:,} live requests per rank):"
        )
        print(
            f"    saturated churn [{runs_of('churn_events_per_s_runs', ',.0f')}] events/s; "
            f"CPU µs/event writer/projector/server/this/view-fold {cpu('churn')}; messages "
            f"per event: deltas {s['churn_messages_per_event_deltas']:.3f}, KV "
            f"{s['churn_messages_per_event_kv']:.2f}"
        )
        print(
            f"    paced at {s['paced_achieved_rate']:,.0f}/s: ack->view p99 "
            f"[{runs_of('fresh_p99_ms_runs', '.1f')}] ms (max {s['fresh_max_ms']:.1f}); "
            f"start->view p99 {s['fresh_start_p99_ms']:.1f} ms; CPU µs/event {cpu('paced')}; "
            f"bytes/event events/deltas/KV {s['paced_bytes_per_event_events']:,.0f}/"
            f"{s['paced_bytes_per_event_deltas']:,.0f}/{s['paced_bytes_per_event_kv']:,.0f}"
        )
        print(
            f"    cold start [{runs_of('cold_ready_s_runs', '.2f')}] s, CPU "
            f"{s['cold_cpu_s']:.2f} s, RSS +{s['cold_rss_growth_mb']:.0f} MB (peak "
            f"+{s['cold_peak_growth_mb']:.0f} MB), {s['cold_present_hashes']:,} hashes; fill "
            f"{s['fill_events_per_s']:,.0f} events/s"
        )
    print("\nTargets:")
    for t in report["targets"]:
        print(f"  {verdict(t['ok'], PASS_FAIL)}: {t['name']}: {t['detail']}")
    if report.get("plot"):
        print(f"\nplot: {report['plot']}")
    print(f"wall time: {report['wall_s']:.0f} s")


def plot(summary: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "scale.py: matplotlib is not installed, no plot written (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return None
    sweeps = (
        (
            "set_per_rank",
            f"active hashes per rank ({args.fixed_blocks} blocks per request)",
            sorted(
                (s for s in summary if s["blocks"] == args.fixed_blocks),
                key=lambda s: s["set_per_rank"],
            ),
        ),
        (
            "blocks",
            f"blocks per request ({args.fixed_set:,} hashes per rank)",
            sorted(
                (s for s in summary if s["set_per_rank"] == args.fixed_set),
                key=lambda s: s["blocks"],
            ),
        ),
    )
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    components = (
        ("writer", "writer"),
        ("projector", "projector"),
        ("nats_server", "nats-server"),
        ("bench", "publisher + view (bench)"),
        ("view_fold", "view fold alone"),
    )
    streams = (
        ("events", "SEQSTATE_EVENTS"),
        ("deltas", "SEQSTATE_DELTAS"),
        ("kv", "KV bucket stream"),
    )
    titles = {"set_per_rank": "active hashes per rank", "blocks": "blocks per request"}
    for col, (key, xlabel, rows) in enumerate(sweeps):
        xs = [s[key] for s in rows]
        for row, (part, items, ylabel) in enumerate(
            (
                ("cpu_us_per_event", components, "CPU µs per event"),
                ("bytes_per_event", streams, "stored bytes per event"),
            )
        ):
            ax = axes[row][col]
            for name, label in items:
                ax.plot(
                    xs,
                    [s[f"churn_{part}_{name}"] for s in rows],
                    marker="o",
                    label=label,
                    linestyle=":" if name == "view_fold" else "-",
                )
            ax.set_xscale("log", base=2 if key == "blocks" else 10)
            ax.set_xticks(xs, [f"{x:,}" for x in xs])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_ylabel(f"{ylabel} (saturated churn)")
            ax.set_title(f"{ylabel.split(' per')[0]} per event vs {titles[key]}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            if row == 1:
                ax.set_xlabel(xlabel)
    fig.suptitle(
        f"seqstate fleet scale: {WORKERS} ranks, Free+Add+MarkPrefillCompleted churn "
        f"(medians of {args.runs} runs)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
