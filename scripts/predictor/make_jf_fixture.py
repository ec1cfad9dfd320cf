#!/usr/bin/env python3
"""The committed jF fixture (tests/fixtures/jf/): a small routing trace, a deterministic jF
model and the features and outputs the pure-Python reference computes for them, which
tests/streamer/jf_features_test.cc and jf_model_test.cc compare the C++ against.

Usage: python3 scripts/predictor/make_jf_fixture.py [--out tests/fixtures/jf]
No numpy, no torch. train_jf.py writes reference.json in the same layout for a trained model
(the torch forward's outputs), so the same C++ test checks a trained file.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jf_reference as ref  # noqa: E402

GEOMETRY = {"num_layers": 2, "experts_per_layer": 8, "top_k": 2, "features": ref.NUM_FEATURES,
            "hidden": 8, "queries": 2, "horizon": ref.HORIZON}
SEQUENCES = (40, 25, 50)  # lengths: a partial block at each end, three resets


def synthetic_trace(seed=7):
    state = [seed]

    def rand():
        state[0] = (1103515245 * state[0] + 12345) & 0x7FFFFFFF
        return state[0] / 2.0 ** 31

    L, E, k = GEOMETRY["num_layers"], GEOMETRY["experts_per_layer"], GEOMETRY["top_k"]
    trace = ref.Trace([1, 3], E, k)
    trace.norms = []
    for length in SEQUENCES:
        trace.sequence_starts.append(trace.num_tokens)
        for t in range(length):
            tok_e, tok_w, tok_n = [], [], []
            for l in range(L):
                # A hot pair that drifts through the sequence, and a random other expert.
                hot = (t // 12 + l) % E
                other = int(rand() * E)
                if other == hot:
                    other = (other + 1) % E
                tok_e.append([hot, other])
                w = 0.5 + 0.4 * rand()
                tok_w.append([ref.f32(w), ref.f32(1.0 - w)])
                tok_n.append(ref.f32(0.5 + 3.0 * rand()))
            trace.experts.append(tok_e)
            trace.weights.append(tok_w)
            trace.norms.append(tok_n)
    return trace


def resident_pattern(point, layer, experts):
    """The residency the test passes at checkpoint `point` (any pattern exercises feature 14)."""
    return [1 if (e + point + layer) % 3 == 0 else 0 for e in range(experts)]


def checkpoints(trace, geometry, params):
    """Every 16 tokens of each sequence and at its end: the features and the forward."""
    L, E = geometry["num_layers"], geometry["experts_per_layer"]
    feats = ref.Features(L, E, geometry["top_k"])
    points = []
    for (begin, end) in trace.sequences():
        feats.new_sequence()
        for t in range(begin, end):
            feats.observe(trace.experts[t], trace.weights[t], trace.norms[t] if trace.norms else None)
            if (t + 1 - begin) % 16 == 0 or t + 1 == end:
                layers = []
                for l in range(L):
                    resident = resident_pattern(len(points), l, E)
                    f = feats.fill(l, resident)
                    out = ref.forward(params, geometry, l, f) if params else []
                    layers.append({"resident": resident, "features": f, "output": out})
                points.append({"after_token": t + 1, "layers": layers})
    return points


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/jf")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    trace = synthetic_trace()
    ref.write_trace(trace, os.path.join(args.out, "trace.nqrt"))
    params = ref.deterministic_params(GEOMETRY, seed=2026)
    ref.write_model(os.path.join(args.out, "model.safetensors"), GEOMETRY, params)
    # Round-trip through the files, as the C++ reads them.
    trace = ref.read_trace(os.path.join(args.out, "trace.nqrt"))
    geometry, params = ref.read_model(os.path.join(args.out, "model.safetensors"))
    expected = {"geometry": geometry, "points": checkpoints(trace, geometry, params)}
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}: {trace.num_tokens} tokens, {len(expected['points'])} checkpoints")


if __name__ == "__main__":
    main()
