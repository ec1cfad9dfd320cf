#!/usr/bin/env python3
"""Mean KL(teacher || student) per predicted token, teacher-forced, over glm5_nano's eval
domains, with the C++ engine (`nq logits`) computing both sides. Students are plain
checkpoints, e.g. `nq nvfp4 dequantize` outputs (NVFP4 values expanded to F32).

  kl_vs_teacher.py NQ TEACHER_DIR STUDENT_DIR [STUDENT_DIR ...] [--window 512] [--windows 1]

Standard library only. Windows are the first W tokens of each domain's eval/<domain>.tokens.json
(then the next W, ... for --windows > 1).
"""
import array
import json
import math
import os
import subprocess
import sys
import tempfile


def logits(nq, model, tokens, out):
    subprocess.run([nq, "logits", "--model", model, "--tokens", ",".join(map(str, tokens)), "--out", out],
                   check=True, capture_output=True)
    data = array.array("f")
    with open(out, "rb") as f:
        data.frombytes(f.read())
    return data


def log_softmax(row):
    m = max(row)
    z = math.log(sum(math.exp(x - m) for x in row)) + m
    return [x - z for x in row]


def kl_rows(teacher, student, vocab):
    total = 0.0
    rows = len(teacher) // vocab
    for r in range(rows):
        lp = log_softmax(teacher[r * vocab:(r + 1) * vocab])
        lq = log_softmax(student[r * vocab:(r + 1) * vocab])
        total += sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))
    return total, rows


def main():
    args = sys.argv[1:]
    window, windows = 512, 1
    for flag in ("--window", "--windows"):
        if flag in args:
            i = args.index(flag)
            value = int(args[i + 1])
            del args[i:i + 2]
            window, windows = (value, windows) if flag == "--window" else (window, value)
    nq, teacher, students = args[0], args[1], args[2:]
    vocab = json.load(open(os.path.join(teacher, "config.json")))["vocab_size"]
    eval_dir = os.path.join(teacher, "eval")
    tmp = tempfile.mkdtemp()
    sums = {s: [0.0, 0] for s in students}
    for file in sorted(os.listdir(eval_dir)):
        if not file.endswith(".tokens.json"):
            continue
        ids = json.load(open(os.path.join(eval_dir, file)))
        for w in range(windows):
            tokens = ids[w * window:(w + 1) * window]
            if len(tokens) < 2:
                break
            t = logits(nq, teacher, tokens, os.path.join(tmp, "t.bin"))
            for s in students:
                kl, rows = kl_rows(t, logits(nq, s, tokens, os.path.join(tmp, "s.bin")), vocab)
                sums[s][0] += kl
                sums[s][1] += rows
                print(f"{file} window {w} {s}: mean KL {kl / rows:.6f} over {rows} tokens", file=sys.stderr)
    for s, (kl, rows) in sums.items():
        print(f"{s}\tmean KL {kl / rows:.6f} nats/token over {rows} tokens")


if __name__ == "__main__":
    main()
