#!/usr/bin/env python3
"""Trains glm5_nano: a ~19M-parameter GlmMoeDsaForCausalLM (+ MTP layer) on Python sources.

Runs on the GPU machine (torch + transformers 5.x + tokenizers), in one go:
  1. corpus (corpus.py): the Python standard library and a few permissively licensed
     site-packages, split by file into train / held-out; eval domains from the held-out files;
  2. a byte-level BPE tokenizer (bpe_tokenizer.py) trained on part of the train files;
  3. transformers' GlmMoeDsaForCausalLM (MLA, DSA indexer, noaux_tc router, 1 shared + 32
     routed experts) plus an MTP layer (mtp_head.py), trained jointly in bf16 autocast with
     AdamW: loss = CE + 0.3 * MTP CE + indexer KL (train_hooks.py) + 1e-4 * sequence balance;
     the router's correction bias follows DeepSeek-V3's aux-loss-free rule; the DSA indexer
     starts dense (top-k = sequence) and switches to index_topk after --dense-frac of the steps;
  4. an evaluation by transformers' own modules (no training patches) in float32 with the
     bf16-rounded weights, per domain;
  5. the hub checkpoint directory (export_model.py): config.json, model.safetensors (bf16),
     generation_config.json, tokenizer.json, tokenizer_config.json (GLM-5 chat template),
     eval/<domain>.txt + .tokens.json, reference/ (HF float64 logits), train_log.json.

Usage: python3 scripts/train/train_tiny_glm5.py --out DIR [--smoke]
scripts/train/README.md has the hyperparameters, the measured losses and the rerun command.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "scripts", "fixtures"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bpe_tokenizer  # noqa: E402
import corpus as corpus_mod  # noqa: E402
import train_hooks  # noqa: E402
from fixture_common import versions  # noqa: E402
from hf_model import effective_flags, source_flags  # noqa: E402
from mtp_head import MtpHead  # noqa: E402

ARCH = "GlmMoeDsaForCausalLM"
T_START = time.time()

# The model. Shapes are powers of two where NestQuant's Hadamard blocks and tensor
# parallelism (TP 1/2/4/8) want them; index_topk (64) < the training length (512) and < the
# reference prompt (96), so the DSA indexer really selects in both.
MODEL_SPEC = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,        # dense layer 0
    moe_intermediate_size=64,
    num_hidden_layers=5,          # layer 0 dense, layers 1-4 MoE; layer 5 = MTP (hub only)
    num_attention_heads=8,
    num_key_value_heads=8,
    n_shared_experts=1,
    n_routed_experts=32,
    routed_scaling_factor=2.5,
    kv_lora_rank=64,
    q_lora_rank=128,
    qk_rope_head_dim=16,
    v_head_dim=32,
    qk_nope_head_dim=32,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    first_k_dense_replace=1,
    index_topk=64,
    index_head_dim=32,
    index_n_heads=16,
    attention_bias=False,
    initializer_range=0.02,
)
INDEXER_TYPES = ["full", "full", "shared", "full", "shared"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0}

LOG = []


def log(*a):
    msg = f"[{time.time() - T_START:7.1f}s] " + " ".join(str(x) for x in a)
    print(msg, flush=True)
    LOG.append(msg)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="small corpus and a few steps (checks the pipeline)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128, help="sequences per step")
    ap.add_argument("--train-seconds", type=float, default=215.0, help="wall-clock budget of the training loop")
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dense-frac", type=float, default=0.15, help="fraction of steps with a dense indexer")
    ap.add_argument("--bias-gamma", type=float, default=1e-3)
    ap.add_argument("--balance-alpha", type=float, default=1e-4)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--indexer-weight", type=float, default=1.0)
    ap.add_argument("--eval-permille", type=int, default=30)
    ap.add_argument("--eval-chars", type=int, default=50000, help="characters of eval text per domain")
    ap.add_argument("--tok-train-chars", type=int, default=16_000_000)
    ap.add_argument("--per-package-bytes", type=int, default=12_000_000)
    ap.add_argument("--ref-len", type=int, default=96)
    ap.add_argument("--ref-candidates", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.smoke:
        a.batch, a.max_steps, a.train_seconds, a.warmup = 16, 12, 30.0, 4
        a.per_package_bytes, a.tok_train_chars, a.ref_candidates = 2_000_000, 3_000_000, 2
    return a


# ------------------------------------------------------------------------------------------
# Data


def build_data(args):
    forbidden = bpe_tokenizer.ALL_ADDED
    extra = corpus_mod.EXTRA_PACKAGES[:1] if args.smoke else corpus_mod.EXTRA_PACKAGES
    c = corpus_mod.collect(args.eval_permille, 1_000_000, extra, args.per_package_bytes, forbidden)
    if args.smoke:
        c.train = c.train[::8]
    chars = {}
    for d in c.train:
        chars[d.source] = chars.get(d.source, 0) + len(d.text)
    log(f"corpus: {len(c.train)} train files ({sum(chars.values()) / 1e6:.1f} M chars: "
        f"{ {k: round(v / 1e6, 2) for k, v in chars.items()} }), {len(c.held_out)} held out")
    log("licences:", json.dumps(c.licences))
    domains = corpus_mod.eval_domains(c, args.eval_chars)
    # BPE sample: train files in hash order until tok_train_chars.
    order = sorted(c.train, key=lambda d: hashlib.sha1(f"{d.source}:{d.relpath}".encode()).hexdigest())
    sample, n = [], 0
    for d in order:
        if n >= args.tok_train_chars:
            break
        sample.append(d.text)
        n += len(d.text)
    tok = bpe_tokenizer.train(sample, MODEL_SPEC["vocab_size"])
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained on {n / 1e6:.1f} M chars")
    eot = tok.token_to_id(bpe_tokenizer.EOT)
    enc = tok.encode_batch([d.text for d in c.train], add_special_tokens=False)
    lens = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
    stream = np.empty(int(lens.sum()) + len(enc), dtype=np.int32)
    pos = 0
    for e in enc:
        k = len(e.ids)
        stream[pos:pos + k] = e.ids
        stream[pos + k] = eot
        pos += k + 1
    log(f"train stream: {stream.size / 1e6:.2f} M tokens ({sum(chars.values()) / stream.size:.2f} chars/token)")
    evals = {}
    for name, docs in domains.items():
        text = bpe_tokenizer.EOT.join(docs)
        evals[name] = {"text": text, "ids": tok.encode(text, add_special_tokens=False).ids, "docs": len(docs)}
        log(f"eval domain {name}: {len(docs)} docs, {len(text)} chars, {len(evals[name]['ids'])} tokens")
    info = {"train_files": len(c.train), "held_out_files": len(c.held_out), "train_chars": chars,
            "train_tokens": int(stream.size), "licences": c.licences, "roots": c.roots,
            "tokenizer_train_chars": n}
    return tok, torch.from_numpy(stream), evals, info


# ------------------------------------------------------------------------------------------
# Model


def build_model(device):
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig
    kw = dict(MODEL_SPEC, rope_parameters=dict(ROPE), indexer_types=list(INDEXER_TYPES),
              num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=0,
              pad_token_id=None)   # a padding_idx would freeze <|endoftext|>'s embedding at zero
    cfg = GlmMoeDsaConfig(**kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    mtp = MtpHead(model)
    with torch.no_grad():          # the MTP layer is built outside from_config: initialise like HF
        for name, p in mtp.named_parameters():
            if p.dim() == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                p.normal_(0.0, MODEL_SPEC["initializer_range"])
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    return model.to(device), mtp.to(device)


def named_parts(model, mtp):
    attn = {f"L{i}": l.self_attn for i, l in enumerate(model.model.layers)}
    attn["mtp"] = mtp.layer.self_attn
    groups, cur = {}, None
    for i, kind in enumerate(INDEXER_TYPES):
        if kind == "full":
            cur = f"L{i}"
            groups[cur] = [cur]
        else:
            groups[cur].append(f"L{i}")
    groups["mtp"] = ["mtp"]
    routers, experts = [], []
    for i, l in enumerate(list(model.model.layers) + [mtp.layer]):
        if hasattr(l.mlp, "gate"):
            routers.append((f"L{i}" if i < len(model.model.layers) else "mtp", l.mlp.gate))
            experts.append(l.mlp.experts)
    return attn, groups, routers, experts


def forward_losses(model, mtp, x, y):
    out = model.model(input_ids=x, use_cache=False)
    h = out.last_hidden_state
    logits = model.lm_head(h)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))
    hm = mtp(model, x, h)
    ml = model.lm_head(hm)
    mtp_loss = F.cross_entropy(ml.float().view(-1, V), y[:, 1:].reshape(-1))
    return main, mtp_loss, logits, ml


# ------------------------------------------------------------------------------------------
# Evaluation


def windows(ids, S):
    return [ids[i:i + S + 1] for i in range(0, len(ids) - 1, S) if len(ids[i:i + S + 1]) >= 3]


@torch.no_grad()
def evaluate(model, mtp, evals, S, device, max_windows=None, autocast=True):
    """Per domain: mean CE over every next-token prediction of consecutive non-overlapping
    S-token windows (context restarts at each window), MTP CE (row i -> token i+2), top-1."""
    res = {}
    for name, e in evals.items():
        ws = windows(e["ids"], S)
        if max_windows:
            ws = ws[:max_windows]
        tot = {"ce": 0.0, "n": 0, "acc": 0, "mce": 0.0, "mn": 0, "macc": 0}
        full = [w for w in ws if len(w) == S + 1]
        part = [w for w in ws if len(w) != S + 1]
        batches = [full[i:i + 16] for i in range(0, len(full), 16)] + [[w] for w in part]
        for b in batches:
            t = torch.tensor(b, dtype=torch.long, device=device)
            x, y = t[:, :-1], t[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                _, _, lg, ml = forward_losses(model, mtp, x, y)
            lg, ml = lg.float(), ml.float()
            V = lg.shape[-1]
            tot["ce"] += float(F.cross_entropy(lg.view(-1, V), y.reshape(-1), reduction="sum"))
            tot["n"] += y.numel()
            tot["acc"] += int((lg.argmax(-1) == y).sum())
            if y.shape[1] > 1:
                y2 = y[:, 1:]
                tot["mce"] += float(F.cross_entropy(ml.reshape(-1, V), y2.reshape(-1), reduction="sum"))
                tot["mn"] += y2.numel()
                tot["macc"] += int((ml.argmax(-1) == y2).sum())
        res[name] = {"loss": tot["ce"] / max(tot["n"], 1), "top1": tot["acc"] / max(tot["n"], 1),
                     "mtp_loss": tot["mce"] / max(tot["mn"], 1), "mtp_top1": tot["macc"] / max(tot["mn"], 1),
                     "tokens": tot["n"], "windows": len(ws)}
    return res


# ------------------------------------------------------------------------------------------
# Start-up checks


def capture_indexer_call(model, x):
    """Arguments of layer 0's indexer in one no-grad forward (for calibrate_indexer)."""
    cap = {}

    def pre(_m, args, kwargs):
        cap.setdefault("call", (args, kwargs))

    idx = model.model.layers[0].self_attn.indexer
    h = idx.register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=x, use_cache=False)
    h.remove()
    return cap["call"]


@torch.no_grad()
def causality_check(model, x):
    """Logits of the first half must not move when the second half's tokens change. Runs
    without TF32: the experts see other batch shapes, and TF32 rounding would show up here."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = model(input_ids=x, use_cache=False).logits
        x2 = x.clone()
        x2[:, x.shape[1] // 2:] = (x2[:, x.shape[1] // 2:] + 7) % model.config.vocab_size
        b = model(input_ids=x2, use_cache=False).logits
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    half = x.shape[1] // 2
    return float((a[:, :half] - b[:, :half]).abs().max())


# ------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log("versions:", versions(), "device:", torch.cuda.get_device_name(0))
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)

    tok, stream, evals, data_info = build_data(args)
    t_data = time.time() - T_START
    stream = stream.to(device)
    S, B = args.seq, args.batch

    model, mtp = build_model(device)
    sflags = source_flags(ARCH)
    flags = effective_flags(ARCH, model.config, sflags)
    log("HF source flags:", sflags, "effective:", flags)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"parameters: main {n_main / 1e6:.3f} M, MTP layer {n_mtp / 1e6:.3f} M (+ hub copies of embed/head)")
    attn, groups, routers, experts = named_parts(model, mtp)

    checks = {}
    g = torch.Generator(device=device).manual_seed(args.seed)
    probe = stream[torch.randint(0, stream.numel() - S - 1, (4,), device=device, generator=g)[:, None]
                   + torch.arange(S, device=device)].long()
    model.eval()
    checks["causality_max_abs"] = causality_check(model, probe[:2, :256])
    try:
        call = capture_indexer_call(model, probe)
        (layout, interleave), cal = train_hooks.calibrate_indexer(model.model.layers[0].self_attn.indexer, *call)
        use_indexer_loss = cal[f"{layout}/{'interleave' if interleave else 'half'}"] >= 0.98
    except Exception as e:  # noqa: BLE001 (the indexer then keeps its initial weights)
        layout, interleave, cal, use_indexer_loss = "cat", True, {"error": repr(e)[:400]}, False
    checks["indexer_calibration"] = cal
    log(f"indexer calibration {cal} -> layout {layout}, interleave {interleave}, indexer loss {use_indexer_loss}")
    try:
        ok, rel = train_hooks.check_grouped_experts(experts[0], device, log)
    except Exception as e:  # noqa: BLE001 (no grouped GEMM here: the eager loop trains)
        ok, rel = False, repr(e)[:300]
        log("grouped experts unavailable:", rel)
    checks["grouped_experts"] = {"used": ok, "rel_err": rel}
    model.train()
    mtp.train()

    stats = train_hooks.RouterStats(routers, MODEL_SPEC["num_experts_per_tok"], MODEL_SPEC["n_routed_experts"])
    itrainer = train_hooks.IndexerTrainer(attn, groups, layout, interleave)
    if use_indexer_loss:
        itrainer.install()
    if ok:
        train_hooks.install_grouped_experts(experts)

    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    total_steps = args.max_steps
    dense_steps = max(1, int(args.dense_frac * total_steps))
    itrainer.set_topk(S)
    history, evals_hist = [], []
    t_train0 = time.time()
    step_times = []
    arange = torch.arange(S + 1, device=device)
    quick_eval = {k: v for k, v in evals.items()}
    step = 0
    while step < total_steps:
        if step == 12 and not args.smoke:
            per = float(np.median(step_times[3:]))
            left = args.train_seconds - (time.time() - t_train0)
            total_steps = min(args.max_steps, step + int(left / per))
            dense_steps = max(1, int(args.dense_frac * total_steps))
            log(f"step time {per * 1e3:.1f} ms -> {total_steps} steps ({dense_steps} with a dense indexer)")
        if step == dense_steps:
            itrainer.set_topk(MODEL_SPEC["index_topk"])
            log(f"step {step}: indexer top-k {MODEL_SPEC['index_topk']} (sparse attention from here)")
        ts = time.time()
        lr_now = lr_at(step, total_steps, args)
        for gr in opt.param_groups:
            gr["lr"] = lr_now
        starts = torch.randint(0, stream.numel() - S - 1, (B,), device=device, generator=g)
        batch = stream[starts[:, None] + arange].long()
        x, y = batch[:, :-1], batch[:, 1:]
        stats.batch = B
        with torch.autocast("cuda", dtype=torch.bfloat16):
            main_loss, mtp_loss, _, _ = forward_losses(model, mtp, x, y)
        bal = stats.take_balance_loss()
        idx_loss, idx_kl = itrainer.take_loss() if use_indexer_loss else (None, None)
        loss = main_loss + args.mtp_weight * mtp_loss
        if bal is not None:
            loss = loss + args.balance_alpha * bal
        if idx_loss is not None:
            loss = loss + args.indexer_weight * idx_loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats.update_bias(args.bias_gamma)
        step += 1
        if step <= 12 or step % 25 == 0 or step == total_steps:
            torch.cuda.synchronize()
        step_times.append(time.time() - ts)
        if step % 25 == 0 or step == total_steps or step <= 3:
            rec = {"step": step, "lr": lr_now, "loss": float(main_loss.detach()), "mtp_loss": float(mtp_loss.detach()),
                   "indexer_kl": float(idx_kl) if idx_kl is not None else None,
                   "balance": float(bal.detach()) if bal is not None else None, "grad_norm": float(gnorm),
                   "seconds": time.time() - t_train0}
            history.append(rec)
            log(f"step {step}/{total_steps} lr {lr_now:.2e} loss {rec['loss']:.4f} mtp {rec['mtp_loss']:.4f} "
                f"idx_kl {rec['indexer_kl']} bal {rec['balance']} gnorm {rec['grad_norm']:.2f} "
                f"{B * S / step_times[-1] / 1e3:.0f} ktok/s")
        if (step % 250 == 0 or step == total_steps) and step > 0:
            stats.enabled = False
            model.eval()
            mtp.eval()
            r = evaluate(model, mtp, quick_eval, S, device, max_windows=8)
            model.train()
            mtp.train()
            stats.enabled = True
            evals_hist.append({"step": step, "eval": r})
            log(f"eval @ {step}: " + ", ".join(f"{k} {v['loss']:.3f}/mtp {v['mtp_loss']:.3f}" for k, v in r.items()))
        if time.time() - t_train0 > args.train_seconds + 20:
            log("training time budget exceeded; stopping at step", step)
            break
    train_seconds = time.time() - t_train0
    routing = stats.summary()

    # ---- pure-HF evaluation of the bf16-rounded weights, float32 -----------------------------
    itrainer.uninstall()
    train_hooks.uninstall_grouped_experts(experts)
    for h in stats.handles + itrainer.handles:
        h.remove()
    itrainer.set_topk(MODEL_SPEC["index_topk"])
    model.eval()
    mtp.eval()
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            p.copy_(p.to(torch.bfloat16).float())
    t_ev = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False      # full fp32 from here (eval, checks)
    torch.backends.cudnn.allow_tf32 = False
    final = evaluate(model, mtp, evals, S, device, autocast=False)
    for k, v in final.items():
        log(f"final eval {k}: loss {v['loss']:.4f} (ppl {math.exp(v['loss']):.2f}) top1 {v['top1']:.3f} "
            f"mtp {v['mtp_loss']:.4f} mtp_top1 {v['mtp_top1']:.3f} ({v['tokens']} tokens)")
    train_probe = {"train_sample": {"ids": stream[:200_000].tolist(), "text": ""}}
    final_train = evaluate(model, mtp, train_probe, S, device, max_windows=64, autocast=False)["train_sample"]
    log(f"final train-sample loss {final_train['loss']:.4f} mtp {final_train['mtp_loss']:.4f}")
    eval_seconds = time.time() - t_ev

    # ---- write the checkpoint ------------------------------------------------------------------
    import export_model
    ids = bpe_tokenizer.ids_of(tok)
    eos = [ids[bpe_tokenizer.EOT], ids["<|user|>"], ids["<|observation|>"]]
    C, n_hub = export_model.write_checkpoint(
        model, mtp, out_dir, flags,
        {"eos_token_id": eos, "pad_token_id": ids[bpe_tokenizer.EOT], "bos_token_id": ids[bpe_tokenizer.EOT]})
    template = open(os.path.join(REPO, "scripts", "chat", "templates", "glm5.jinja")).read()
    bpe_tokenizer.save(tok, out_dir, template, MODEL_SPEC["max_position_embeddings"])
    log(f"checkpoint written: {n_hub / 1e6:.3f} M hub parameters")
    checks.update(post_checks(model, mtp, out_dir, evals, S, device, tok))

    ev_dir = os.path.join(out_dir, "eval")
    os.makedirs(ev_dir, exist_ok=True)
    for name, e in evals.items():
        with open(os.path.join(ev_dir, f"{name}.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(e["text"])
        with open(os.path.join(ev_dir, f"{name}.tokens.json"), "w") as f:
            json.dump(e["ids"], f, separators=(",", ":"))

    ref_src = evals.get("stdlib_code") or next(iter(evals.values()))
    L = args.ref_len
    stride = max(L, (len(ref_src["ids"]) - L) // max(args.ref_candidates, 1))
    cands = [torch.tensor(ref_src["ids"][i:i + L], dtype=torch.long)
             for i in range(0, len(ref_src["ids"]) - L, stride)][: args.ref_candidates]
    model.cpu()
    mtp.cpu()
    torch.cuda.empty_cache()
    meta = export_model.reference(out_dir, cands, flags, log)
    checks["reference"] = {k: v for k, v in meta["checks"].items()}

    train_log = {
        "model": "glm5_nano", "architecture": ARCH, "config": C,
        "parameters": {"hub_total": n_hub, "main_model": n_main, "mtp_layer_trained": n_mtp,
                       "note": "hub_total counts the MTP layer's copies of embed_tokens and the head"},
        "hyperparameters": {k: v for k, v in vars(args).items() if k != "out"},
        "steps": step, "dense_indexer_steps": dense_steps, "tokens_seen": step * B * S,
        "seconds": {"data_and_tokenizer": t_data, "training": train_seconds, "final_eval": eval_seconds,
                    "total_before_reference": time.time() - T_START},
        "history": history, "eval_history": evals_hist, "final_eval": final, "final_train_sample": final_train,
        "routing": routing, "checks": checks, "data": data_info, "versions": versions(),
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "added": ids},
        "eval_domains": {k: {"chars": len(v["text"]), "tokens": len(v["ids"]), "docs": v["docs"]}
                         for k, v in evals.items()},
        "log": LOG,
    }
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(train_log, f, indent=1, default=str)
    log("done; total", f"{time.time() - T_START:.1f}s")


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def post_checks(model, mtp, out_dir, evals, S, device, tok):
    """The written directory reloads in transformers with the trained logits; the tokenizer
    files load in transformers and encode like the trained tokenizer; the chat template renders."""
    import export_model
    res = {}
    name, e = next(iter(evals.items()))
    x = torch.tensor(e["ids"][:S], dtype=torch.long, device=device)[None]
    ref = model(input_ids=x, use_cache=False).logits.float()
    m, info = export_model.load_hf(out_dir, torch.float32)
    m.to(device)
    got = m(input_ids=x, use_cache=False).logits.float()
    res["reload_vs_trained_max_abs"] = float((got - ref).abs().max())
    res["reload_loading_info"] = info
    del m
    log(f"reload check: max|d| {res['reload_vs_trained_max_abs']:.3e}, loading info {info}")
    try:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer
        t2 = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
        at = AutoTokenizer.from_pretrained(out_dir)
        same = all(t2.encode(v["text"], add_special_tokens=False).ids == v["ids"]
                   and at(v["text"], add_special_tokens=False)["input_ids"] == v["ids"] for v in evals.values())
        res["tokenizer_files_reencode_equal"] = same
        msgs = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Sort a list of ints."}]
        text = at.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        cids = at(text, add_special_tokens=False)["input_ids"]
        res["chat_template_render"] = text
        res["chat_template_ids"] = cids
        log(f"tokenizer files re-encode equal: {same}; chat render {text!r} -> {cids}")
    except Exception as ex:  # noqa: BLE001 (recorded; the C++ side reads tokenizer.json itself)
        res["tokenizer_check_error"] = repr(ex)[:400]
        log("tokenizer check failed:", repr(ex)[:400])
    return res


if __name__ == "__main__":
    main()
