#!/usr/bin/env node
// A request's lifecycle published to seqstate's events stream, by docs/events-format.md alone.
//
//   node publish.mjs [--nats-url URL] [--namespace NS] [--router-id ID]
//                    --request-id ID --worker-id N [--dp-rank N] [--hashes H,H,...]
//                    [--prefill-tokens N] [--expected-prefill-ms MS] [STEP ...]
//
// STEPs are `add`, `mark` and `free` (default: all three, in that order). Each is one
// JetStream publish, acknowledged before the next; its stream sequence is printed as
// `<step> <seq>`, one line each.

import { randomBytes } from "node:crypto";
import { parseArgs } from "node:util";
import { connect } from "@nats-io/transport-node";
import { jetstream } from "@nats-io/jetstream";
import { encode } from "@msgpack/msgpack";

const SCHEMA_VERSION = 1;
const STEPS = { add: "AddRequest", mark: "MarkPrefillCompleted", free: "Free" };
const U64 = /^(0|[1-9][0-9]*)$/;
const U64_MAX = (1n << 64n) - 1n;

function die(message) {
  process.stderr.write(`publish.mjs: ${message}\n`);
  process.exit(1);
}

function u64(text, flag, max = U64_MAX) {
  if (!U64.test(text) || BigInt(text) > max) die(`${flag} takes an integer 0 to ${max}, not ${text}`);
  return BigInt(text); // a worker id or a hash is a u64: past 2^53 a Number would round it
}

function options() {
  let parsed;
  try {
    parsed = parseArgs({
      allowPositionals: true,
      options: {
        "nats-url": { type: "string", default: process.env.NATS_URL ?? "nats://127.0.0.1:4222" },
        namespace: { type: "string", default: process.env.SEQSTATE_NAMESPACE ?? "default" },
        "router-id": { type: "string", default: "js-example" },
        "request-id": { type: "string" },
        "worker-id": { type: "string" },
        "dp-rank": { type: "string", default: "0" },
        hashes: { type: "string", default: "" },
        "prefill-tokens": { type: "string", default: "0" },
        "expected-prefill-ms": { type: "string" },
      },
    });
  } catch (err) {
    die(err.message);
  }
  const { values, positionals } = parsed;
  if (!values["request-id"]) die("--request-id is required");
  if (values["worker-id"] === undefined) die("--worker-id is required");
  const steps = positionals.length ? positionals : ["add", "mark", "free"];
  for (const step of steps) if (!(step in STEPS)) die(`unknown step ${step}: add, mark or free`);
  const ms = values["expected-prefill-ms"];
  if (ms !== undefined && !(Number(ms) >= 0)) die(`--expected-prefill-ms takes ms >= 0, not ${ms}`);
  return {
    url: values["nats-url"],
    namespace: values.namespace,
    routerId: values["router-id"],
    requestId: values["request-id"],
    workerId: u64(values["worker-id"], "--worker-id"),
    dpRank: u64(values["dp-rank"], "--dp-rank", (1n << 32n) - 1n),
    hashes: values.hashes ? values.hashes.split(",").map((h) => u64(h, "--hashes")) : [],
    prefillTokens: u64(values["prefill-tokens"], "--prefill-tokens"),
    expectedPrefillMs: ms === undefined ? undefined : Number(ms),
    steps,
  };
}

// The event's map: "type" first, then its fields; a field at its default may be left out.
function event(step, o) {
  const fields = { type: STEPS[step], request_id: o.requestId, worker_id: o.workerId };
  if (o.dpRank !== 0n) fields.dp_rank = o.dpRank;
  if (step === "add") {
    if (o.hashes.length) fields.block_hashes = o.hashes;
    if (o.prefillTokens !== 0n) fields.prefill_tokens = o.prefillTokens;
    if (o.expectedPrefillMs !== undefined) fields.expected_prefill_ms = o.expectedPrefillMs;
  }
  fields.router_id = o.routerId;
  return fields;
}

// "<router_id>:<n>:<tag>": the router id with "%" and every character outside printable
// ASCII (space included) percent-encoded as UTF-8, n counting from 1, a tag of 64 random bits.
function msgIdPrefix(routerId) {
  return [...routerId]
    .map((c) =>
      c > " " && c <= "~" && c !== "%"
        ? c
        : [...new TextEncoder().encode(c)]
            .map((b) => `%${b.toString(16).toUpperCase().padStart(2, "0")}`)
            .join(""),
    )
    .join("");
}

async function main() {
  const o = options();
  let nc;
  try {
    nc = await connect({ servers: o.url, name: "seqstate-js-publish" });
  } catch (err) {
    die(`cannot connect to ${o.url}: ${err.message}`);
  }
  const js = jetstream(nc);
  const subject = `seqstate.events.${o.namespace}.${o.workerId}.${o.dpRank}`;
  const prefix = msgIdPrefix(o.routerId);
  const tag = randomBytes(8).toString("hex");
  let n = 0;
  for (const step of o.steps) {
    n += 1;
    const data = encode([SCHEMA_VERSION, event(step, o)], { useBigInt64: true });
    try {
      // msgID is the Nats-Msg-Id header: a publish retried after a lost ack is stored once.
      const ack = await js.publish(subject, data, { msgID: `${prefix}:${n}:${tag}` });
      process.stdout.write(`${step} ${ack.seq}\n`);
    } catch (err) {
      die(`${step} of ${o.requestId} not stored on ${subject}: ${err.message}`);
    }
  }
  await nc.close();
}

await main();
