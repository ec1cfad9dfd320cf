#!/usr/bin/env python3
"""The most any predictor of "hits in the next H tokens" can give the replay (issue #21).

`nq replay` scores a policy by the share of routed calls that find their expert at 4 bits when
each 16-token block is served by the floating slots chosen at the block's start. A predictor
trained for expected hits over the next H tokens can at best rank experts by their true hits over
those H tokens. This script plays exactly that hindsight policy (the true future counts, no
prediction error) beside the oracle (the block's own top-F) and the previous block's top-F, with
the release's fixed sets always at 4 bits, as `nq replay` does. A target above the hindsight
share of a horizon cannot be met by any model of that horizon, however well trained.

  python3 scripts/predictor/hindsight_ceiling.py --trace heldout.nqrt[.gz] \
      --release build/cpu/embedded-model/release [--slots 8] [--block 16] [--horizons 16,32,64]

Blocks restart at each sequence start; the first block of a sequence keeps nothing from the
previous one under the history policies (the hindsight policies still see its future).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jf_reference as ref  # noqa: E402


def window_counts(trace, begin, end):
    """calls[l][e] over tokens [begin, end)."""
    counts = [[0] * trace.experts_per_layer for _ in range(trace.num_layers)]
    for t in range(begin, end):
        for l, ids in enumerate(trace.experts[t]):
            for e in ids:
                counts[l][e] += 1
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--release", required=True, help="release directory (its manifest's fixed sets)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--horizons", default="16,32,64,128")
    args = ap.parse_args()
    trace = ref.read_trace(args.trace)
    with open(os.path.join(args.release, "manifest.json")) as f:
        manifest = json.load(f)
    fixed_by_layer = {entry["layer"]: set(entry.get("fixed_4bit", [])) for entry in manifest["layers"]}
    missing = [lid for lid in trace.layer_ids if lid not in fixed_by_layer]
    if missing:
        sys.exit(f"the release has no entry for trace layers {missing}: another model's release?")
    fixed = [fixed_by_layer[lid] for lid in trace.layer_ids]
    E = trace.experts_per_layer
    floating = [[x for x in range(E) if x not in fixed[l]] for l in range(trace.num_layers)]
    horizons = [int(h) for h in args.horizons.split(",")]
    # policy -> how it scores experts at a block starting at s of a sequence [b, e)
    policies = {"oracle (block's own top-F)": lambda b, e, s: window_counts(trace, s, min(s + args.block, e))}
    for h in horizons:
        policies[f"hindsight: true hits in the next {h}"] = (
            lambda b, e, s, h=h: window_counts(trace, s, min(s + h, e)))
    for h in (args.block, 64):
        policies[f"history: hits in the previous {h}"] = (
            lambda b, e, s, h=h: window_counts(trace, max(b, s - h), s) if s > b else None)
    served = {name: 0 for name in policies}
    total = 0
    for (b, e) in trace.sequences():
        for s in range(b, e, args.block):
            block = window_counts(trace, s, min(s + args.block, e))
            total += sum(map(sum, block))
            for name, score in policies.items():
                counts = score(b, e, s)
                for l in range(trace.num_layers):
                    chosen = set() if counts is None else set(
                        sorted(floating[l], key=lambda x: (-counts[l][x], x))[:args.slots])
                    served[name] += sum(block[l][x] for x in range(E) if x in fixed[l] or x in chosen)
    oracle = served["oracle (block's own top-F)"]
    print(f"{trace.num_tokens} tokens, {len(trace.sequences())} sequences, F = {args.slots}, "
          f"blocks of {args.block}, {total} calls")
    print("| policy | 4-bit share of calls | of the oracle's |")
    print("| --- | ---: | ---: |")
    for name, value in served.items():
        print(f"| {name} | {value / total:.4f} | {value / oracle:.3f} |")


if __name__ == "__main__":
    main()
