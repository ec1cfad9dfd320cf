#!/usr/bin/env python3
"""Calibration text for glm5_nano's NestQuant release: Python standard-library files that the
training split kept (never a held-out file, so `nq kld` evaluates on text calibration did not
see), read from this machine's stdlib (Debian 12: /usr/lib/python3.11; the model trained on
3.12's, so most files are close versions of training files).

Usage: python3 scripts/train/calibration_text.py [--root /usr/lib/python3.11] [--chars 160000] > calib.txt
then:  nq tokenize --tokenizer models/glm5_nano/tokenizer.json < calib.txt > calib.tokens
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402  (the training split rule: corpus.is_held_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/usr/lib/python3.11")
    ap.add_argument("--chars", type=int, default=160_000)
    ap.add_argument("--eval-permille", type=int, default=30, help="as train_tiny_glm5.py used")
    args = ap.parse_args()
    taken = 0
    out = []
    for path in sorted(corpus.walk_py(args.root)):
        rel = os.path.relpath(path, args.root)
        if rel.startswith("test") or corpus.is_held_out("stdlib", rel, args.eval_permille):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        out.append(text)
        taken += len(text)
        if taken >= args.chars:
            break
    sys.stdout.write("".join(out)[: args.chars])


if __name__ == "__main__":
    main()
