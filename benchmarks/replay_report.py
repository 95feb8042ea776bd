"""``replay.py``'s text report: the setup, (r1), (r2) and, when it ran, the profile."""

from __future__ import annotations

from typing import Any

from harness.report import fmt_rates, print_head, print_software, verdict


def print_report(report: dict[str, Any]) -> None:
    m, w, r = report["machine"], report["workload"], report["result"]
    print_head("seqstate replay and restart benchmark (benchmarks/replay.py)", m)
    print_software(m, r["nats_server"], f"; compiled {w['compiled_core']}")
    if m.get("git_at_end", m["git"]) != m["git"]:
        print(f"  WARNING    : the checkout changed during the run: now {m['git_at_end']}")
    print(
        f"  workload   : {w['trace']} ({w['trace_events']:,} events per pass), "
        f"{w['events']:,} events in the stream ({w['workers']} WorkerAdded + lifecycles, "
        f"{w['workers']} workers round-robin), {w['runs']} runs each"
    )
    s = r["setup"]
    print(
        f"\nsetup (untimed for the targets): {s['events']:,} events encoded in "
        f"{s['build_s']:.1f} s, published in {s['seconds']:.1f} s ({s['events_per_s']:,.0f} "
        f"events/s, publish_async pipelined, max pending {s['max_pending']}, every ack "
        f"checked); stream {s['stream_bytes'] / 1e6:.0f} MB"
    )

    a = r["replay"]
    path = "fast path (reader process)" if a["fast_path_available"] else "nats-py ordered consumer"
    print(
        f"\n(r1) replay throughput: fold_stream(start_seq=1, end_seq={s['last_seq']:,}) into a "
        f"fresh SequenceState, no snapshot; {path}"
    )
    print(
        f"    median {a['median_events_per_s']:,.0f} events/s ({a['median_seconds']:.2f} s)   "
        f"target >= {a['target_events_per_s']:,} events/s: {verdict(a['meets_target'])}"
    )
    print(f"    runs (events/s): {fmt_rates([x['events_per_s'] for x in a['runs']])}")
    print(
        "    CPU this process + reader child + nats-server / wall (per run; 2 vCPUs give "
        "2 CPU-s per s): "
        + ", ".join(
            f"{x['cpu_s']:.2f} + {x['child_cpu_s']:.2f} + {x['server_cpu_s']:.2f} / "
            f"{x['seconds']:.2f} s"
            for x in a["runs"]
        )
    )
    fell_back = [msg for x in a["runs"] for msg in x["warnings"]]
    print(f"    fallbacks or warnings: {fell_back or 'none'}")
    x = a["runs"][-1]
    print(
        f"    every run's final state identical: yes (sha256 {x['digest']}); live at end "
        f"{x['live_requests']}; outcomes {x['outcomes']}"
    )
    if "replay_client_path" in r:
        c = r["replay_client_path"]
        print(
            f"    for comparison, fold_stream(fast=False) (nats-py ordered consumer): median "
            f"{c['median_events_per_s']:,.0f} events/s ("
            + ", ".join(
                f"{y['events_per_s']:,.0f}/s, CPU {y['cpu_s']:.1f} + server "
                f"{y['server_cpu_s']:.1f} / {y['seconds']:.1f} s"
                for y in c["runs"]
            )
            + "); same final state"
        )

    snap, b = r["snapshot"], r["ready"]
    print(
        f"\n(r2) start to ready: build_writer(nc, config) → writer.caught_up, snapshot at event "
        f"{snap['applied_seq']:,} (last - {b['tail']:,})"
    )
    print(
        f"    snapshot: {snap['bytes'] / 1e6:.2f} MB ({snap['live_requests']:,} live requests, "
        f"{snap['ended_ids']:,} ended ids, {snap['tombstones']:,} tombstones); prepared by "
        f"folding to it in {snap['fold_s']:.1f} s, encoded in {snap['encode_s'] * 1000:.0f} ms, "
        f"saved + verified in {snap['save_s'] * 1000:.0f} ms; "
        f"SequenceState.restore in this process {snap['decode_in_process_s'] * 1000:.0f} ms"
    )
    print(
        f"    median {b['median_s'] * 1000:.0f} ms   target < {b['target_s']:g} s: "
        f"{verdict(b['meets_target'])}   (+ connect {b['median_connect_s'] * 1000:.1f} ms, "
        f"+ a fresh interpreter's imports {w['import_s'] * 1000:.0f} ms)"
    )
    print("    runs (ms): " + ", ".join(f"{x['seconds'] * 1000:.0f}" for x in b["runs"]))
    labels = {
        "start_before_restore": "ensure + newest delta + open store",
        "snapshot_load": "snapshot load (list + fetch + decode)",
        "snapshot_fetch": "  of which fetch (object store get)",
        "snapshot_decode_and_list": "  of which list + decode",
        "coverage_and_target": "coverage check + stream's last seq",
        "subscribe": "create the ordered consumer",
        "tail_fold": f"fold the {b['tail']:,}-event tail + its deltas",
    }
    for key, label in labels.items():
        print(f"    {label:<40} median {b['median_phases_s'][key] * 1000:7.1f} ms")
    x = b["runs"][-1]
    print(
        f"    tail: {x['tail_events']:,} events at {x['tail_events_per_s']:,.0f} events/s, "
        f"{x['batches_published']} delta batches; restored_from == {x['restored_from']:,} and "
        f"state == full replay in every run: "
        f"{all(y['state_equals_full_replay'] for y in b['runs'])}"
    )

    if "profile" in r:
        p = r["profile"]
        p1, p1b, p2, p3 = p["client_alone"], p["reader_alone"], p["core_alone"], p["cprofile"]
        print("\nprofile: where (r1)'s time goes")
        print(
            f"    (p1) nats-py alone (the fallback's ordered consumer, callback reads seq/time "
            f"and keeps the payload): {p1['events_per_s']:,.0f} events/s ({p1['seconds']:.2f} s, "
            f"CPU {p1['cpu_s']:.2f} s)"
        )
        if p1b is not None:
            print(
                f"    (p1b) fast path's reader process + pipe alone (callback folds nothing): "
                f"{p1b['events_per_s']:,.0f} events/s ({p1b['seconds']:.2f} s; CPU parent "
                f"{p1b['cpu_s']:.2f} s, reader {p1b['child_cpu_s']:.2f} s)"
                + (f"; gave up: {p1b['gave_up']}" if p1b["gave_up"] else "")
            )
        print(
            f"    (p2) core alone, in process on the stream's payloads: decode "
            f"{p2['decode_us']:.2f} us/event; decode + apply as fold_stream folds (registry "
            f"deferred, GC off) {p2['like_fold_stream_us']:.2f} us = "
            f"{p2['like_fold_stream_events_per_s']:,.0f} events/s; with the registry kept "
            f"current and GC on {p2['registry_current_gc_on_us']:.2f} us = "
            f"{p2['registry_current_gc_on_events_per_s']:,.0f} events/s"
        )
        print(
            f"    per event: replay {1e6 / a['median_events_per_s']:.2f} us; nats-py alone "
            f"{1e6 / p1['events_per_s']:.2f} us"
            + (f"; reader + pipe alone {1e6 / p1b['events_per_s']:.2f} us" if p1b else "")
            + f"; fold alone {p2['like_fold_stream_us']:.2f} us"
        )
        print(
            f"    (p3) cProfile over one fold_stream, this process only "
            f"({p3['wall_s_under_profiler']:.1f} s under the profiler), share of profiled time:"
        )
        for label, share in p3["shares"].items():
            print(f"        {share * 100:5.1f}%  {label}")
        print("        top functions by own time:")
        for row in p3["top"]:
            print(f"        {row['share'] * 100:5.1f}%  {row['calls']:>9,}  {row['function']}")
    print(f"\nwall time: {report['wall_s']:.1f} s")
