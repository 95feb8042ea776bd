#!/usr/bin/env node
// Every rank's load from seqstate's registry bucket, read by docs/bucket-format.md alone.
//
//   node loads.mjs [--nats-url URL] [--namespace NS] [--registry-bucket NAME] [--json]
//   node loads.mjs ... --watch [--duration SECONDS]
//
// --json prints what `seqstate loads --json` prints, byte for byte; --watch keeps a live view
// from the KV watch and prints, as `seqstate watch --json` does, each rank whose load changed
// as one JSON line with the position it reflects (a removed rank as {"removed": true}).

import { parseArgs } from "node:util";
import { connect } from "@nats-io/transport-node";
import { Kvm } from "@nats-io/kv";
import { LoadView, stringifyExact } from "./bucket.mjs";

const USAGE =
  "usage: node loads.mjs [--nats-url URL] [--namespace NS] [--registry-bucket NAME] " +
  "[--json] [--watch [--duration SECONDS]]";

function die(message) {
  process.stderr.write(`loads.mjs: ${message}\n`);
  process.exit(1);
}

function options() {
  try {
    const { values } = parseArgs({
      options: {
        "nats-url": { type: "string", default: process.env.NATS_URL ?? "nats://127.0.0.1:4222" },
        namespace: { type: "string", default: process.env.SEQSTATE_NAMESPACE ?? "default" },
        "registry-bucket": {
          type: "string",
          default: process.env.SEQSTATE_REGISTRY_BUCKET ?? "seqstate-registry",
        },
        json: { type: "boolean", default: false },
        watch: { type: "boolean", default: false },
        duration: { type: "string" },
        help: { type: "boolean", short: "h", default: false },
      },
    });
    if (values.help) {
      process.stdout.write(`${USAGE}\n`);
      process.exit(0);
    }
    if (values.duration !== undefined && !(Number(values.duration) > 0)) {
      throw new Error(`--duration takes a positive number of seconds, not ${values.duration}`);
    }
    if (!values.namespace || values.namespace.includes(".")) {
      throw new Error(`--namespace is one token with no '.': ${values.namespace}`);
    }
    return values;
  } catch (err) {
    die(`${err.message}\n${USAGE}`);
  }
}

async function openBucket(nc, name, namespace) {
  let kv;
  try {
    kv = await new Kvm(nc).open(name, { bindOnly: true });
    await kv.status(); // bindOnly does not look: this does
  } catch (err) {
    die(`no registry bucket ${name} on this server (${err.message})`);
  }
  // A namespace is known where the bucket holds a key directly under it (a projector's lease
  // or position, a tracker's block size; a released lease leaves its delete marker): a
  // mistyped namespace is said so, never answered with an empty table.
  for (const key of ["position", "lease", "tracker", "trimmed"]) {
    if ((await kv.get(`${namespace}.${key}`)) !== null) return kv;
  }
  die(`namespace ${namespace} is unknown to bucket ${name}: no ${namespace}.position or lease`);
}

// Fills `view` from a watch of the namespace's keys; resolves once every current value is in.
async function follow(kv, view) {
  const watch = await kv.watch({ key: `${view.namespace}.>` });
  let resolveInitial;
  const initial = new Promise((resolve) => (resolveInitial = resolve));
  (async () => {
    for await (const e of watch) {
      view.entry(e.key, e.operation, e.value);
      if (!view.ready && e.delta === 0) {
        view.initialized();
        resolveInitial();
      }
    }
  })().catch((err) => die(`the bucket's watch ended: ${err.message}`));
  await initial;
  return watch;
}

function table(rows, appliedSeq) {
  const head = ["worker_id", "dp_rank", "blocks", "prefill_tokens", "requests", "prefill_ms"];
  const cells = rows.map((r) => [
    r.worker_id,
    r.dp_rank,
    r.active_blocks,
    r.active_prefill_tokens,
    r.active_requests,
    r.modeled_remaining_prefill_ms ?? "-",
  ]);
  const all = [head, ...cells].map((row) => row.map(String));
  const widths = head.map((_, i) => Math.max(...all.map((row) => row[i].length)));
  const lines = all.map((row) => row.map((c, i) => c.padStart(widths[i])).join("  "));
  return `${lines.join("\n")}\nas of event ${appliedSeq}`;
}

// `seqstate watch --json`'s records: the changed ranks' rows, then the removed ranks.
function printChanges(view, last) {
  const rows = view.rows();
  const now = new Map(rows.map((r) => [`${r.worker_id}.${r.dp_rank}`, r]));
  const out = [];
  for (const [id, row] of now) {
    const load = stringifyExact(view.loads.get(id));
    if (last.get(id) !== load) {
      out.push(stringifyExact({ ...row, applied_seq: view.appliedSeq }));
      last.set(id, load);
    }
  }
  for (const id of [...last.keys()]) {
    if (!now.has(id)) {
      last.delete(id);
      const [worker, rank] = id.split(".").map(BigInt);
      out.push(
        stringifyExact({ worker_id: worker, dp_rank: rank, removed: true, applied_seq: view.appliedSeq }),
      );
    }
  }
  if (out.length) process.stdout.write(`${out.join("\n")}\n`);
}

async function main() {
  const opts = options();
  let nc;
  try {
    nc = await connect({ servers: opts["nats-url"], name: "seqstate-js-loads" });
  } catch (err) {
    die(`cannot connect to ${opts["nats-url"]}: ${err.message}`);
  }
  const kv = await openBucket(nc, opts["registry-bucket"], opts.namespace);
  if (!opts.watch) {
    const view = new LoadView(opts.namespace);
    const watch = await follow(kv, view);
    const rows = view.rows();
    watch.stop();
    if (opts.json) {
      process.stdout.write(rows.map((r) => `${stringifyExact(r)}\n`).join(""));
    } else {
      process.stdout.write(`${table(rows, view.appliedSeq)}\n`);
    }
    await nc.close();
    return;
  }
  const last = new Map();
  const view = new LoadView(opts.namespace, { onChange: (v) => printChanges(v, last) });
  const watch = await follow(kv, view);
  const stop = async () => {
    watch.stop();
    await nc.close();
    process.exit(0);
  };
  process.on("SIGINT", stop);
  process.on("SIGTERM", stop);
  if (opts.duration !== undefined) setTimeout(stop, Number(opts.duration) * 1000);
}

await main();
