#!/usr/bin/env python3
"""Compares two float32 little-endian logits files [rows, vocab] (no numpy needed).

  python3 scripts/train/compare_logits.py REF.bin GOT.bin VOCAB [--tol 1e-4]

Prints max |ref - got|, max |ref|, their ratio, the worst row and top-1 agreement; exits 1
when the ratio exceeds --tol (the fixtures' fp32 tolerance: 1e-4 of the largest logit).
"""

import argparse
import array
import sys


def read(path):
    a = array.array("f")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("got")
    ap.add_argument("vocab", type=int)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    ref, got = read(a.ref), read(a.got)
    if len(ref) != len(got) or len(ref) % a.vocab:
        print(f"shape mismatch: {len(ref)} vs {len(got)} floats, vocab {a.vocab}")
        return 1
    rows = len(ref) // a.vocab
    worst, worst_row, max_ref, agree = 0.0, -1, 0.0, 0
    for r in range(rows):
        lo = r * a.vocab
        rr, gg = ref[lo:lo + a.vocab], got[lo:lo + a.vocab]
        d = max(abs(x - y) for x, y in zip(rr, gg))
        if d > worst:
            worst, worst_row = d, r
        max_ref = max(max_ref, max(abs(x) for x in rr))
        agree += max(range(a.vocab), key=rr.__getitem__) == max(range(a.vocab), key=gg.__getitem__)
    ratio = worst / max_ref if max_ref else float("inf")
    print(f"rows {rows}  max|d| {worst:.3e} (row {worst_row})  max|ref| {max_ref:.4f}  "
          f"ratio {ratio:.3e}  top1 agree {agree}/{rows}")
    return 0 if ratio <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
