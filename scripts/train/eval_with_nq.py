#!/usr/bin/env python3
"""Recomputes a model directory's per-domain eval loss with the C++ engine (`nq logits`).

  python3 scripts/train/eval_with_nq.py --model models/glm5_nano [--nq build/cpu/services/tools/nq]
         [--domains stdlib_code,docstrings] [--mtp] [--max-windows N]

Same protocol as train_tiny_glm5.py's final eval (train_log.json "final_eval"): the domain's
eval/<domain>.tokens.json cut into consecutive non-overlapping windows of seq+1 tokens
(seq = 512; the last, partial window included), each run as a fresh causal prefill; loss =
mean cross-entropy over every next-token prediction; MTP loss: row i of `nq logits --mtp`
predicts token i+2 of the window. No numpy needed.
"""

import argparse
import array
import json
import math
import os
import subprocess
import sys
import tempfile


def windows(ids, seq):
    return [ids[i:i + seq + 1] for i in range(0, len(ids) - 1, seq) if len(ids[i:i + seq + 1]) >= 3]


def run_nq(nq, model, tokens, mtp, out):
    cmd = [nq, "logits", "--model", model, "--tokens", ",".join(map(str, tokens)), "--out", out]
    if mtp:
        cmd.append("--mtp")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a = array.array("f")
    with open(out, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


def ce_rows(logits, vocab, targets):
    total, correct = 0.0, 0
    for r, t in enumerate(targets):
        row = logits[r * vocab:(r + 1) * vocab]
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
        total += lse - row[t]
        correct += row[t] == m
    return total, correct


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--nq", default="build/cpu/services/tools/nq")
    ap.add_argument("--domains", default="")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--max-windows", type=int, default=0)
    a = ap.parse_args()
    vocab = json.load(open(os.path.join(a.model, "config.json")))["vocab_size"]
    ev = os.path.join(a.model, "eval")
    names = a.domains.split(",") if a.domains else sorted(
        f[: -len(".tokens.json")] for f in os.listdir(ev) if f.endswith(".tokens.json"))
    tmp = os.path.join(tempfile.mkdtemp(), "logits.bin")
    res = {}
    for name in names:
        ids = json.load(open(os.path.join(ev, name + ".tokens.json")))
        ws = windows(ids, a.seq)
        if a.max_windows:
            ws = ws[: a.max_windows]
        s = {"ce": 0.0, "n": 0, "acc": 0, "mce": 0.0, "mn": 0, "macc": 0}
        for w in ws:
            x, y = w[:-1], w[1:]
            ce, acc = ce_rows(run_nq(a.nq, a.model, x, False, tmp), vocab, y)
            s["ce"] += ce
            s["n"] += len(y)
            s["acc"] += acc
            if a.mtp and len(x) >= 2:
                ce, acc = ce_rows(run_nq(a.nq, a.model, x, True, tmp), vocab, y[1:])
                s["mce"] += ce
                s["mn"] += len(y) - 1
                s["macc"] += acc
        res[name] = {"loss": s["ce"] / s["n"], "top1": s["acc"] / s["n"], "tokens": s["n"], "windows": len(ws)}
        if a.mtp:
            res[name].update(mtp_loss=s["mce"] / s["mn"], mtp_top1=s["macc"] / s["mn"])
        print(name, json.dumps(res[name]), flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
