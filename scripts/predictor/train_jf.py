#!/usr/bin/env python3
"""Trains the learned predictor jF (issue #21) from `nq trace` routing traces and exports the
safetensors file `nq-streamer --predictor` and `nq replay --predictor` load.

  python3 scripts/predictor/train_jf.py --train a.nqrt[.gz] [b.nqrt ...] --eval held.nqrt[.gz] \
      --out DIR [--hidden 16] [--queries 2] [--seconds 150] [--slots 8] [--horizon 16]

Data: at every refresh point (each 16 tokens of a sequence, and its end) and every MoE layer,
the 16 features of every expert (jf_reference.Features: the same code path the C++ test checks
against the streamer's), and the target: the expert's hits in the next `horizon` tokens of the
same sequence (16 by default: one refresh block, what the replay scores, see
hindsight_ceiling.py; the seed used 64). Near a sequence's end fewer tokens remain; the loss sees
that as exposure (Poisson with mean rate x remaining / horizon). Feature 14 (residency) is the
previous block's top-`slots` by hits, the closest stand-in for what a predictor holds resident.

Loss: Poisson negative log-likelihood of the hits. Writes to DIR:
  model.safetensors   the model (metadata carries the geometry the streamer checks)
  trace.nqrt, expected.json   a held-out slice with features and the torch forward's outputs:
                      NQ_JF_REFERENCE_DIR=DIR streamer_test --gtest_filter=*TrainedModelEqualsTorch
                      checks the C++ forward against them
  train_log.json      losses, the held-out top-F capture of jF against the last block's counts
"""
import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jf_reference as ref  # noqa: E402

import torch  # noqa: E402

BLOCK = 16  # tokens between the streamer's refreshes (one replay block)


def examples(trace, slots, horizon):
    """(features [L][E][D], hits in the next horizon [L][E], exposure, point, hits in the next
    block [L][E]) at each refresh point."""
    L, E, k = trace.num_layers, trace.experts_per_layer, trace.top_k
    feats = ref.Features(L, E, k)
    out = []
    for (begin, end) in trace.sequences():
        feats.new_sequence()
        for t in range(begin, end):
            feats.observe(trace.experts[t], trace.weights[t], trace.norms[t] if trace.norms else None)
            if (t + 1 - begin) % 16 != 0 and t + 1 != end:
                continue
            remaining = min(horizon, end - (t + 1))
            if remaining == 0:
                continue
            layers_f, layers_y, layers_block = [], [], []
            for l in range(L):
                f = feats.fill(l, [0] * E)
                # Residency stand-in: the previous block's top-`slots` by window hits (feature 10).
                order = sorted(range(E), key=lambda e: (-f[e][10], e))
                for e in order[:slots]:
                    f[e][14] = 1.0
                hits, block = [0.0] * E, [0.0] * E
                for u in range(t + 1, min(end, t + 1 + max(remaining, BLOCK))):
                    for e in trace.experts[u][l]:
                        if u < t + 1 + remaining:
                            hits[e] += 1.0
                        if u < t + 1 + BLOCK:
                            block[e] += 1.0
                layers_f.append(f)
                layers_y.append(hits)
                layers_block.append(block)
            out.append((layers_f, layers_y, remaining / horizon, t + 1, layers_block))
    return out


def to_tensors(exs, num_layers):
    x = torch.tensor([f for ex in exs for f in ex[0]], dtype=torch.float32)
    y = torch.tensor([h for ex in exs for h in ex[1]], dtype=torch.float32)
    layer = torch.tensor([l for _ in exs for l in range(num_layers)], dtype=torch.long)
    exposure = torch.tensor([ex[2] for ex in exs for _ in range(num_layers)], dtype=torch.float32)
    return x, y, layer, exposure


def block_hits(exs):
    return torch.tensor([h for ex in exs for h in ex[4]], dtype=torch.float32)


class Jf(torch.nn.Module):
    """jf_model.h's forward, batched over (refresh point, layer)."""

    def __init__(self, layers, experts, features, hidden, queries):
        super().__init__()
        self.hidden = hidden
        self.emb = torch.nn.Parameter(torch.zeros(layers, experts, hidden))
        self.w_in = torch.nn.Linear(features, hidden)
        self.query = torch.nn.Parameter(torch.randn(queries, hidden) * 0.1)
        self.w_ctx = torch.nn.Linear(queries * hidden, hidden, bias=False)
        self.w_h = torch.nn.Linear(hidden, hidden)
        self.w_out = torch.nn.Linear(hidden, 1)

    def forward(self, x, layer):  # x [B, E, D], layer [B] -> expected hits [B, E]
        h0 = torch.relu(self.w_in(x) + self.emb[layer])
        logits = torch.einsum("qh,beh->bqe", self.query, h0) / math.sqrt(self.hidden)
        ctx = torch.einsum("bqe,beh->bqh", torch.softmax(logits, dim=-1), h0).reshape(x.shape[0], -1)
        g = self.w_ctx(ctx)
        h1 = torch.relu(self.w_h(h0) + g[:, None, :])
        return torch.nn.functional.softplus(self.w_out(h1).squeeze(-1))

    def export(self, geometry):
        def flat(t):
            return [float(v) for v in t.detach().cpu().reshape(-1).tolist()]
        return {"emb": flat(self.emb), "w_in": flat(self.w_in.weight), "b_in": flat(self.w_in.bias),
                "query": flat(self.query), "w_ctx": flat(self.w_ctx.weight), "w_h": flat(self.w_h.weight),
                "b_h": flat(self.w_h.bias), "w_out": flat(self.w_out.weight.reshape(-1)),
                "b_out": flat(self.w_out.bias)}


def poisson_loss(pred, y, exposure):
    mu = pred * exposure[:, None] + 1e-6
    return (mu - y * torch.log(mu)).mean()


def capture(pred, y, slots):
    """Share of next-horizon hits on each (point, layer)'s top-`slots` by `pred`."""
    top = torch.topk(pred, slots, dim=-1).indices
    return float(torch.gather(y, 1, top).sum() / y.sum().clamp(min=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--horizon", type=int, default=BLOCK,
                    help="tokens ahead whose hits the model predicts (the file records it); 16, one "
                         "refresh block, replays best on glm5_nano, the seed used 64")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.time()

    train_traces = [ref.read_trace(p) for p in args.train]
    eval_trace = ref.read_trace(args.eval)
    first = train_traces[0]
    L, E, k = first.num_layers, first.experts_per_layer, first.top_k
    for t in train_traces + [eval_trace]:
        if (t.num_layers, t.experts_per_layer, t.top_k) != (L, E, k):
            sys.exit("traces disagree on geometry")
    if not 1 <= args.horizon <= 4096:
        sys.exit("--horizon must lie in [1, 4096] (the streamer's limit)")
    train_ex = [ex for t in train_traces for ex in examples(t, args.slots, args.horizon)]
    eval_ex = examples(eval_trace, args.slots, args.horizon)
    data_seconds = time.time() - started
    print(f"data: {len(train_ex)} train / {len(eval_ex)} held-out refresh points x {L} layers x {E} experts "
          f"({data_seconds:.1f} s)", flush=True)
    x, y, layer, exposure = (t.to(device) for t in to_tensors(train_ex, L))
    ex_, ey, elayer, eexp = (t.to(device) for t in to_tensors(eval_ex, L))
    eblock = block_hits(eval_ex).to(device)

    model = Jf(L, E, ref.NUM_FEATURES, args.hidden, args.queries).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    n = x.shape[0]
    step, epoch, history = 0, 0, []
    deadline = time.time() + args.seconds
    while time.time() < deadline:
        perm = torch.randperm(n, device=device)
        for i in range(0, n, args.batch):
            idx = perm[i:i + args.batch]
            loss = poisson_loss(model(x[idx], layer[idx]), y[idx], exposure[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        epoch += 1
        with torch.no_grad():
            held = float(poisson_loss(model(ex_, elayer), ey, eexp))
        history.append({"epoch": epoch, "step": step, "train_loss": float(loss), "heldout_loss": held})
        if epoch % 10 == 1:
            print(f"epoch {epoch} step {step} train {float(loss):.4f} held-out {held:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        pred = model(ex_, elayer)
        # Baselines on the same held-out points: the last block's hits (feature 10) and the
        # 8-token hit EMA (feature 0).
        result = {
            "heldout_poisson": float(poisson_loss(pred, ey, eexp)),
            "capture_jf": capture(pred, ey, args.slots),
            "capture_last_block": capture(ex_[:, :, 10] + 1e-3 * ex_[:, :, 0], ey, args.slots),
            "capture_ema8": capture(ex_[:, :, 0], ey, args.slots),
            # The same over the next block only: what the replay's share counts.
            "block_capture_jf": capture(pred, eblock, args.slots),
            "block_capture_last_block": capture(ex_[:, :, 10] + 1e-3 * ex_[:, :, 0], eblock, args.slots),
            "block_capture_hindsight": capture(eblock + 1e-3 * ex_[:, :, 0], eblock, args.slots),
        }
    print(json.dumps(result), flush=True)

    geometry = {"num_layers": L, "experts_per_layer": E, "top_k": k, "features": ref.NUM_FEATURES,
                "hidden": args.hidden, "queries": args.queries, "horizon": args.horizon}
    params = model.cpu().export(geometry)
    ref.write_model(os.path.join(args.out, "model.safetensors"), geometry, params)

    # Reference for the C++ test: the first two held-out sequences (cut to 100 tokens) with the
    # residency pattern of make_jf_fixture, features from jf_reference and torch's outputs.
    sl = ref.Trace(eval_trace.layer_ids, E, k)
    sl.norms = [] if eval_trace.norms is not None else None
    for (b, e) in eval_trace.sequences()[:2]:
        sl.sequence_starts.append(sl.num_tokens)
        for t in range(b, min(e, b + 100)):
            sl.experts.append(eval_trace.experts[t])
            sl.weights.append(eval_trace.weights[t])
            if sl.norms is not None:
                sl.norms.append(eval_trace.norms[t])
    ref.write_trace(sl, os.path.join(args.out, "trace.nqrt"))
    sl = ref.read_trace(os.path.join(args.out, "trace.nqrt"))
    feats = ref.Features(L, E, k)
    points, worst = [], 0.0
    for (b, e) in sl.sequences():
        feats.new_sequence()
        for t in range(b, e):
            feats.observe(sl.experts[t], sl.weights[t], sl.norms[t] if sl.norms else None)
            if (t + 1 - b) % 16 != 0 and t + 1 != e:
                continue
            layers = []
            for l in range(L):
                resident = [1 if (x_ + len(points) + l) % 3 == 0 else 0 for x_ in range(E)]
                f = feats.fill(l, resident)
                with torch.no_grad():
                    out = model(torch.tensor([f], dtype=torch.float32), torch.tensor([l]))[0].tolist()
                pure = ref.forward(params, geometry, l, f)
                worst = max(worst, max(abs(a - b_) / (1e-3 + abs(b_)) for a, b_ in zip(out, pure)))
                layers.append({"resident": resident, "features": f, "output": out})
            points.append({"after_token": t + 1, "layers": layers})
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump({"geometry": geometry, "points": points}, f, separators=(",", ":"))
    print(f"torch vs pure-Python forward: worst relative difference {worst:.2e}", flush=True)
    if worst > 1e-4:
        sys.exit("the torch model and jf_reference.forward disagree: the export would be wrong")

    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"args": vars(args), "device": device, "torch": torch.__version__,
                   "train_points": len(train_ex), "heldout_points": len(eval_ex), "epochs": epoch, "steps": step,
                   "data_seconds": data_seconds, "total_seconds": time.time() - started, "result": result,
                   "history": history}, f, indent=1)
    print(f"wrote {args.out} in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
