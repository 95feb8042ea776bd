#!/usr/bin/env node
// Checks this reader against docs/bucket-format.md's test vectors: each stored load value,
// decoded and decayed at the vector's `now`, must print the vector's row byte for byte.
//
//   node vectors.mjs [PATH/TO/bucket-format.md]

import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { decodeLoad, loadRow, stringifyExact } from "./bucket.mjs";

const page =
  process.argv[2] ?? fileURLToPath(new URL("../../docs/bucket-format.md", import.meta.url));
const block = /### Test vectors[\s\S]*?```text\n([\s\S]*?)```/.exec(readFileSync(page, "utf8"));
if (!block) {
  process.stderr.write(`vectors.mjs: no "Test vectors" block in ${page}\n`);
  process.exit(1);
}
let value = null;
let now = null;
let checked = 0;
const wrong = [];
for (const line of block[1].split("\n")) {
  const at = line.indexOf(":");
  const [label, text] = [line.slice(0, at), line.slice(at + 1).trim()];
  if (label === "value") value = new TextEncoder().encode(text);
  else if (label === "now") now = BigInt(text);
  else if (label === "row") {
    const got = stringifyExact(loadRow(decodeLoad(value), now));
    checked++;
    if (got !== text) wrong.push(`at ${now}:\n  page: ${text}\n  this: ${got}`);
  }
}
if (checked === 0 || wrong.length) {
  process.stderr.write(`vectors.mjs: ${wrong.length} of ${checked} vectors differ\n${wrong.join("\n")}\n`);
  process.exit(1);
}
process.stdout.write(`${checked} vectors: every row as the page says\n`);
