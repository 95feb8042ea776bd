// seqstate's registry bucket, read by docs/bucket-format.md alone: the keys, the load values
// (integers kept exact as BigInt), the prefill decay, and a view that shows a flush's values
// only once its position arrives (the page's "Torn reads").

export const HOLD_MS = 500; // values no position follows are shown after this long

// ---- exact JSON ------------------------------------------------------------------------------
// Worker ids are u64 drawn at random and log times are ~1.8e18 ns: both are past 2^53, where
// a JavaScript number loses digits. So every integer of a value is read as a BigInt from its
// text; JSON.parse would round 18446744073709551557 to 18446744073709552000.

export function parseExact(text) {
  let i = 0;
  const ws = () => {
    while (i < text.length && " \t\n\r".includes(text[i])) i++;
  };
  const fail = (what) => {
    throw new SyntaxError(`${what} at offset ${i} of the JSON value`);
  };
  const value = () => {
    ws();
    const c = text[i];
    if (c === "{") {
      i++;
      const out = {};
      ws();
      if (text[i] === "}") return i++, out;
      for (;;) {
        ws();
        if (text[i] !== '"') fail("expected a key");
        const key = string();
        ws();
        if (text[i++] !== ":") fail("expected ':'");
        out[key] = value();
        ws();
        if (text[i] === ",") i++;
        else if (text[i] === "}") return i++, out;
        else fail("expected ',' or '}'");
      }
    }
    if (c === "[") {
      i++;
      const out = [];
      ws();
      if (text[i] === "]") return i++, out;
      for (;;) {
        out.push(value());
        ws();
        if (text[i] === ",") i++;
        else if (text[i] === "]") return i++, out;
        else fail("expected ',' or ']'");
      }
    }
    if (c === '"') return string();
    const m = /^-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/.exec(text.slice(i, i + 400));
    if (m) {
      i += m[0].length;
      return m[1] || m[2] ? Number(m[0]) : BigInt(m[0]);
    }
    for (const [word, v] of [["null", null], ["true", true], ["false", false]]) {
      if (text.startsWith(word, i)) return (i += word.length), v;
    }
    fail("unexpected character");
  };
  const string = () => {
    const m = /^"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/.exec(text.slice(i));
    if (!m) fail("bad string");
    i += m[0].length;
    return JSON.parse(m[0]);
  };
  const out = value();
  ws();
  if (i !== text.length) fail("trailing data");
  return out;
}

// Compact JSON with BigInts as their digits: the bytes `seqstate loads --json` prints.
export function stringifyExact(value) {
  if (value === null) return "null";
  if (typeof value === "bigint") return value.toString();
  if (Array.isArray(value)) return `[${value.map(stringifyExact).join(",")}]`;
  if (typeof value === "object") {
    return `{${Object.entries(value)
      .map(([k, v]) => `${JSON.stringify(k)}:${stringifyExact(v)}`)
      .join(",")}}`;
  }
  return JSON.stringify(value);
}

// ---- keys ------------------------------------------------------------------------------------

const U64_MAX = (1n << 64n) - 1n;
const U32_MAX = (1n << 32n) - 1n;
const DECIMAL = /^(0|[1-9][0-9]*)$/;

// `<ns>.load.<worker>.<rank>` -> {worker, rank} (BigInts), or null for any other key.
export function loadKey(namespace, key) {
  const parts = key.split(".");
  if (parts.length !== 4 || parts[0] !== namespace || parts[1] !== "load") return null;
  if (!DECIMAL.test(parts[2]) || !DECIMAL.test(parts[3])) return null;
  const worker = BigInt(parts[2]);
  const rank = BigInt(parts[3]);
  if (worker > U64_MAX || rank > U32_MAX) return null;
  return { worker, rank };
}

// ---- load values and decay -------------------------------------------------------------------

const u64 = (v, name) => {
  if (typeof v !== "bigint" || v < 0n || v > U64_MAX) {
    throw new TypeError(`${name} is not a u64: ${v}`);
  }
  return v;
};
const u64OrNull = (v, name) => (v === null ? null : u64(v, name));

// A load value's bytes -> its fields (BigInt or null), checked; throws on a value that does
// not decode (the page: such a rank is not served until a readable value replaces it).
export function decodeLoad(bytes) {
  const v = parseExact(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  if (v === null || typeof v !== "object" || Array.isArray(v)) throw new TypeError("not an object");
  const p = v.prefill;
  if (p === null || typeof p !== "object" || Array.isArray(p)) throw new TypeError("no prefill");
  return {
    worker_id: u64(v.worker_id, "worker_id"),
    dp_rank: u64(v.dp_rank, "dp_rank"),
    active_blocks: u64(v.active_blocks, "active_blocks"),
    active_requests: u64(v.active_requests, "active_requests"),
    prefill: {
      full_tokens: u64(p.full_tokens, "prefill.full_tokens"),
      anchor_tokens: u64(p.anchor_tokens, "prefill.anchor_tokens"),
      anchor_duration_ns: u64OrNull(p.anchor_duration_ns, "prefill.anchor_duration_ns"),
      anchored_since_ns: u64OrNull(p.anchored_since_ns, "prefill.anchored_since_ns"),
      modeled_ms: u64OrNull(p.modeled_ms, "prefill.modeled_ms"),
    },
    applied_seq: u64(v.applied_seq, "applied_seq"),
    as_of: u64(v.as_of, "as_of"),
  };
}

// BigInt division rounds toward zero; the page's floor and ceiling are of non-negative values.
const ceilDiv = (a, b) => (a + b - 1n) / b;

// Prefill tokens still pending at `now` (ns, log time): the page's "Prefill decay".
export function activePrefillTokens(p, now) {
  const A = p.anchored_since_ns;
  if (A === null) return 0n;
  const e = now > A ? now - A : 0n;
  const S = p.full_tokens;
  const Ta = p.anchor_tokens;
  const Da = p.anchor_duration_ns;
  if (p.modeled_ms === null) {
    let remaining;
    if (Da === null) remaining = Ta;
    else if (Da === 0n || e >= Da) remaining = 0n;
    else remaining = ceilDiv(Ta * (Da - e), Da);
    return S - Ta + remaining;
  }
  if (Da === null) return S;
  const completed = Da === 0n ? Ta : (Ta * e) / Da;
  return S > completed ? S - completed : 0n;
}

// Modeled milliseconds of prefill left at `now`, or null when a prefill is unmodeled.
export function modeledRemainingMs(p, now) {
  const M = p.modeled_ms;
  if (M === null) return null;
  const A = p.anchored_since_ns;
  if (A === null) return M;
  if (p.anchor_duration_ns === null) return null;
  const elapsedMs = now > A ? (now - A) / 1_000_000n : 0n;
  return M > elapsedMs ? M - elapsedMs : 0n;
}

// One row of `seqstate loads --json`, its fields in that order.
export function loadRow(load, now) {
  return {
    worker_id: load.worker_id,
    dp_rank: load.dp_rank,
    active_blocks: load.active_blocks,
    active_prefill_tokens: activePrefillTokens(load.prefill, now),
    active_requests: load.active_requests,
    modeled_remaining_prefill_ms: modeledRemainingMs(load.prefill, now),
  };
}

// ---- a live view of one namespace ------------------------------------------------------------

const monotonicNs = () => process.hrtime.bigint();

// Folds a KV watch's entries into each rank's load. A flush's values are held until its
// `<ns>.position` (written last) arrives, so the view always shows the state after one event
// sequence, whole; values no position follows are shown after HOLD_MS. The log's "now" is the
// largest log time received (`as_of` of a load or a position) plus the local monotonic time
// elapsed since: no clock shared with the server is needed.
export class LoadView {
  constructor(namespace, { onChange } = {}) {
    this.namespace = namespace;
    this.loads = new Map(); // "worker.rank" -> decoded load
    this.unreadable = new Map(); // "worker.rank" -> why
    this.appliedSeq = 0n;
    this.badValues = 0;
    this.onChange = onChange;
    this.ready = false;
    this._held = [];
    this._timer = null;
    this._offset = null; // log time minus monotonic time, the largest seen
  }

  nowNs() {
    if (this._offset === null) return BigInt(Date.now()) * 1_000_000n;
    return monotonicNs() + this._offset;
  }

  _observe(asOf) {
    const offset = asOf - monotonicNs();
    if (this._offset === null || offset > this._offset) this._offset = offset;
  }

  // One watch entry: key, operation ("PUT", "DEL", "PURGE"), value bytes.
  entry(key, operation, value) {
    if (key === `${this.namespace}.lease`) return; // who writes, not what
    const deleted = operation !== "PUT";
    if (this.ready && key !== `${this.namespace}.position`) {
      if (this._held.length === 0) {
        this._timer = setTimeout(() => this._release(), HOLD_MS);
        this._timer.unref();
      }
      this._held.push([key, deleted, value]);
      return;
    }
    // A position (or a value before the view is ready): what was held first, then it, and
    // one change for both, at the new position.
    this._release(false);
    this._fold(key, deleted, value);
    if (this.ready) this._changed();
  }

  // The watch delivered every current value: from now on a flush waits for its position.
  initialized() {
    this.ready = true;
    this._changed();
  }

  // Shows the held values: at their position, or alone once HOLD_MS passed without one.
  _release(notify = true) {
    if (this._timer !== null) clearTimeout(this._timer);
    this._timer = null;
    const held = this._held;
    this._held = [];
    for (const [key, deleted, value] of held) this._fold(key, deleted, value);
    if (notify && held.length && this.ready) this._changed();
  }

  _changed() {
    if (this.onChange) this.onChange(this);
  }

  _fold(key, deleted, value) {
    if (key === `${this.namespace}.position`) {
      if (deleted || value.length === 0) return;
      try {
        const position = parseExact(new TextDecoder().decode(value));
        const seq = u64(position.applied_seq, "applied_seq");
        if (seq > this.appliedSeq) this.appliedSeq = seq;
        this._observe(u64(position.as_of, "as_of"));
      } catch {
        this.badValues++;
      }
      return;
    }
    const rank = loadKey(this.namespace, key);
    if (rank === null) return; // request slots, the tracker, keys this reader does not know
    const id = `${rank.worker}.${rank.rank}`;
    if (deleted || value.length === 0) {
      this.loads.delete(id);
      this.unreadable.delete(id);
      return;
    }
    try {
      const load = decodeLoad(value);
      this.loads.set(id, load);
      this.unreadable.delete(id);
      this._observe(load.as_of);
    } catch (err) {
      // Unknown is not idle: the rank is not served until a readable value replaces it.
      this.loads.delete(id);
      this.unreadable.set(id, String(err.message || err));
      this.badValues++;
    }
  }

  // Every rank's row at the view's "now", sorted by (worker_id, dp_rank).
  rows(now = this.nowNs()) {
    const loads = [...this.loads.values()];
    loads.sort((a, b) =>
      a.worker_id !== b.worker_id
        ? a.worker_id < b.worker_id
          ? -1
          : 1
        : a.dp_rank < b.dp_rank
          ? -1
          : a.dp_rank > b.dp_rank
            ? 1
            : 0,
    );
    return loads.map((load) => loadRow(load, now));
  }
}
