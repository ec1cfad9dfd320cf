#!/usr/bin/env python3
"""Distinct routed experts per MoE layer among k consecutive decode tokens, from a routing trace.

An MTP verification step runs 1 + N consecutive positions through each MoE layer at once, and
the NestQuant MoE kernel reads each distinct expert's weights once however many of the step's
tokens route to it (issue #12). So the weight bytes of a k-token step over a 1-token step are
(distinct experts among k consecutive tokens + 1 shared) / (top_k + 1 shared): the floor under
the issue's "4 tokens at most 1.3x the 1-token time". Random tokens (k positions drawn from
anywhere in the trace) are printed beside consecutive ones, as nq_moe_bench's random routing
stands for them.

    python3 bench/predictor/window_experts.py bench/predictor/glm5_nano/heldout.nqrt.gz [--k 1,2,4]

Reads the trace format of services/streamer/routing_trace.h (versions 1 and 2).
"""
import argparse
import gzip
import random
import struct


def read_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:4] != b"NQRT":
        raise SystemExit(f"{path}: not a routing trace (bad magic)")
    version, layers, experts, top_k = struct.unpack_from("<4I", data, 4)
    at = 20
    (tokens,) = struct.unpack_from("<Q", data, at)
    at += 8
    flags, starts = 0, [0]
    if version >= 2:
        (flags,) = struct.unpack_from("<I", data, at)
        at += 4
        (n_seq,) = struct.unpack_from("<Q", data, at)
        at += 8
        starts = list(struct.unpack_from(f"<{n_seq}Q", data, at)) or [0]
        at += 8 * n_seq
    elif version != 1:
        raise SystemExit(f"{path}: unsupported trace version {version}")
    at += 4 * layers  # layer ids
    record = 2 * top_k + 4 * top_k + (4 if flags & 1 else 0)
    if len(data) != at + tokens * layers * record:
        raise SystemExit(f"{path}: {len(data)} bytes, expected {at + tokens * layers * record}")
    ids = []  # ids[t][l] = frozenset of the token's experts at trace layer l
    for t in range(tokens):
        row = []
        for l in range(layers):
            off = at + (t * layers + l) * record
            row.append(frozenset(struct.unpack_from(f"<{top_k}H", data, off)))
        ids.append(row)
    ends = starts[1:] + [tokens]
    return ids, layers, experts, top_k, list(zip(starts, ends))


def mean_distinct(ids, layers, windows):
    total, count = 0, 0
    for window in windows:
        for l in range(layers):
            total += len(frozenset().union(*(ids[t][l] for t in window)))
            count += 1
    return total / count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--k", default="1,2,4", help="window sizes, comma-separated")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    ids, layers, experts, top_k, sequences = read_trace(args.trace)
    tokens = len(ids)
    rng = random.Random(args.seed)
    print(f"{args.trace}: {tokens} tokens, {len(sequences)} sequences, {layers} MoE layers, "
          f"top {top_k} of {experts}")
    print("| tokens k | distinct experts, consecutive | bytes over 1 token (+1 shared) | "
          "distinct, random | bytes over 1 token, random |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k in (int(x) for x in args.k.split(",")):
        consecutive = [range(t, t + k) for begin, end in sequences for t in range(begin, end - k + 1)]
        scattered = [rng.sample(range(tokens), k) for _ in range(len(consecutive))]
        c = mean_distinct(ids, layers, consecutive)
        r = mean_distinct(ids, layers, scattered)
        print(f"| {k} | {c:.2f} | {(c + 1) / (top_k + 1):.2f} | {r:.2f} | {(r + 1) / (top_k + 1):.2f} |")


if __name__ == "__main__":
    main()
