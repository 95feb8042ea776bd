// LoadView by the page's "Torn reads": a flush's values are shown at the position written
// after them, together, never before it. Run: node --test examples/js/test/
import assert from "node:assert/strict";
import { test } from "node:test";
import { LoadView, stringifyExact } from "../bucket.mjs";

const W = "18446744073709551557";
const bytes = (text) => new TextEncoder().encode(text);
const load = (requests, seq) =>
  bytes(
    `{"worker_id":${W},"dp_rank":0,"active_blocks":${requests},"active_requests":${requests},` +
      `"prefill":{"full_tokens":0,"anchor_tokens":0,"anchor_duration_ns":null,` +
      `"anchored_since_ns":null,"modeled_ms":0},"applied_seq":${seq},"as_of":1764000000123456789}`,
  );
const position = (seq) =>
  bytes(`{"applied_seq":${seq},"as_of":1764000000123456789,"delta_seq":${seq}}`);

test("a flush is shown at its position, whole", () => {
  const shown = [];
  const view = new LoadView("ns", {
    onChange: (v) => shown.push([v.appliedSeq, stringifyExact(v.rows().map((r) => r.active_requests))]),
  });
  view.entry(`ns.load.${W}.0`, "PUT", load(1, 1));
  view.entry("ns.position", "PUT", position(1));
  view.initialized();
  assert.deepEqual(shown, [[1n, "[1]"]]);

  view.entry(`ns.load.${W}.0`, "PUT", load(2, 2));
  view.entry(`ns.req.${W}.0.1`, "PUT", bytes("\x80"));
  assert.equal(view.rows()[0].active_requests, 1n, "held until its position");
  view.entry("ns.lease", "PUT", bytes("{}"));
  assert.equal(view.rows()[0].active_requests, 1n, "a lease renewal is no position");
  view.entry("ns.position", "PUT", position(2));
  assert.deepEqual(shown.at(-1), [2n, "[2]"]);
  assert.equal(shown.length, 2);
  assert.equal(view.rows()[0].worker_id, BigInt(W));

  view.entry(`ns.load.${W}.0`, "DEL", bytes(""));
  view.entry("ns.position", "PUT", position(3));
  assert.deepEqual(shown.at(-1), [3n, "[]"]);
});

test("an unreadable load value is not served, and a readable one serves it again", () => {
  const view = new LoadView("ns");
  view.entry(`ns.load.${W}.0`, "PUT", bytes(`{"worker_id":1.5}`));
  assert.deepEqual(view.rows(), []);
  assert.equal(view.unreadable.size, 1);
  view.entry(`ns.load.${W}.0`, "PUT", load(3, 4));
  assert.equal(view.rows()[0].active_requests, 3n);
  assert.equal(view.unreadable.size, 0);
});
