// Encoding throughput of the reference (@lenml/tokenizers) on the same 1 MiB text as
// tokenizer_bench (bench_text.h builds it the same way). Run after `npm ci` in
// scripts/tokenizer:
//   node bench/tokenizer/bench_reference.mjs [runs]
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "../..");
// The reference packages are installed by scripts/tokenizer/package.json.
const require = createRequire(path.join(root, "scripts/tokenizer/package.json"));

const BENCH_TEXT_BYTES = 1 << 20;

function benchText() {
  const corpus = JSON.parse(readFileSync(path.join(root, "tests/tokenizer/data/corpus.json"), "utf8"));
  let block = "";
  for (const e of corpus.entries) if (e.text !== undefined) block += e.text + "\n";
  let text = "";
  while (Buffer.byteLength(text, "utf8") < BENCH_TEXT_BYTES) text += block;
  return text;
}

const runs = Number(process.argv[2] ?? 5);
const text = benchText();
const bytes = Buffer.byteLength(text, "utf8");
console.log(`text: ${bytes} bytes, node ${process.version}`);
for (const name of ["deepseek_v3", "qwen3", "llama3"]) {
  const tokenizer = require(`@lenml/tokenizer-${name}`).fromPreTrained();
  // Wall and CPU time (process.cpuUsage: all of node's threads, so GC helpers count too);
  // CPU time is what to compare on a shared machine.
  const measure = () => {
    const wall0 = performance.now();
    const cpu0 = process.cpuUsage();
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const cpu = process.cpuUsage(cpu0);
    return { ids, wall: performance.now() - wall0, cpu: (cpu.user + cpu.system) / 1e3 };
  };
  const first = measure();
  const runsOut = [];
  for (let r = 0; r < runs; ++r) runsOut.push(measure());
  const median = (key) => runsOut.map((x) => x[key]).sort((a, b) => a - b)[Math.floor(runs / 2)];
  const mbps = (ms) => (bytes / 1e6 / (ms / 1e3)).toFixed(2);
  console.log(
    `${name}: ${first.ids.length} ids; first run ${first.wall.toFixed(0)} ms; median of ${runs}: ` +
      `wall ${median("wall").toFixed(0)} ms (${mbps(median("wall"))} MB/s), ` +
      `cpu ${median("cpu").toFixed(0)} ms (${mbps(median("cpu"))} MB/s)`
  );
}
