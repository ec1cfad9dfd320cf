"""Writing the trained model as a hub checkpoint directory, and its HF reference logits.

Weights: hub names (per-expert gate/up/down, MTP layer under model.layers.{N}) via the fixture
generator's hf_model.hub_weights; bf16, except mlp.gate.e_score_correction_bias, kept in
float32 as in the GLM-5 / DeepSeek-V3 hub checkpoints (a bf16 bias would round the learned
balance offsets to ~4e-3).

Reference (reference/, same files and meta.json layout as tests/fixtures/models/glm5_tiny):
transformers' from_pretrained of the written directory in float64 (eager attention, eager
experts) on the CPU; MTP with transformers' decoder-layer class (hf_model.hf_mtp); the prompt
is the held-out window, among a few candidates, whose routing / indexer decisions have the
widest margins (ref_model.decision_margins on the float64 independent re-implementation).
"""

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from fixture_common import F64, maxabs, versions
from fixture_io import config_json, write_bin
from hf_model import ext_config, from_hub_names, hf_mtp, hf_prefill, hub_weights
from ref_model import RefModel, decision_margins, margins_ok

ARCH = "GlmMoeDsaForCausalLM"


def hub_tensors(model, mtp):
    N = model.config.num_hidden_layers
    extra = {k: v.detach().cpu().to(F64) for k, v in mtp.extra_hub_tensors().items()}
    W = hub_weights(model, mtp.layer, extra, N)
    out = {}
    for k in sorted(W):
        dt = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        out[k] = W[k].detach().cpu().to(dt).contiguous()
    return out


def write_checkpoint(model, mtp, out_dir, flags, extra_config):
    os.makedirs(out_dir, exist_ok=True)
    st = hub_tensors(model, mtp)
    save_file(st, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tmp = tempfile.mkdtemp()
    try:
        model.config.save_pretrained(tmp)
        extra = {"num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "moe_layer_freq": 1, "rope_interleave": flags["rope_interleave"],
                 "indexer_rope_interleave": flags["indexer_rope_interleave"]}
        extra.update(extra_config)
        C = config_json(model, tmp, ARCH, "bfloat16", False, extra)
    finally:
        shutil.rmtree(tmp)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(C, f, indent=2, sort_keys=True)
        f.write("\n")
    from transformers import GenerationConfig
    gc = GenerationConfig.from_model_config(model.config)
    gc.eos_token_id = extra_config["eos_token_id"]
    gc.pad_token_id = extra_config["pad_token_id"]
    gc.bos_token_id = extra_config.get("bos_token_id")
    gc.save_pretrained(out_dir)
    n_params = sum(v.numel() for v in st.values())
    return C, n_params


def load_hf(out_dir, dtype):
    from transformers import AutoModelForCausalLM
    m, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype, attn_implementation="eager",
                                                   experts_implementation="eager", output_loading_info=True)
    info = {k: sorted(v)[:8] if isinstance(v, (set, list)) else str(v) for k, v in info.items()}
    return m.eval(), info


def mtp_layer_from_hub(model, W, dtype):
    N = model.config.num_hidden_layers
    layer = type(model.model.layers[-1])(ext_config(model.config), N).to(dtype).eval()
    with torch.no_grad():
        layer.load_state_dict(from_hub_names(W, layer.state_dict(), f"model.layers.{N}."), strict=True)
    return layer


def reference(out_dir, candidates, flags, log):
    """Writes out_dir/reference/{tokens.json, logits.bin, mtp_logits.bin, mtp_logits_vllm.bin, meta.json}."""
    C = json.load(open(os.path.join(out_dir, "config.json")))
    W = {k: v.to(F64) for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()}
    N, eps = C["num_hidden_layers"], C["rms_norm_eps"]
    best = None
    for ci, ids in enumerate(candidates):
        r = RefModel(W, C, ARCH, flags).forward(ids)
        m = decision_margins(r, True)
        score = min(m["router_expert_min_gap"] / 1e-3, m["indexer_min_rel_gap"] / 2e-3)
        log(f"  reference candidate {ci}: margins {m} score {score:.3f}")
        if best is None or score > best[0]:
            best = (score, ci, ids, r, m)
    score, ci, ids, ref, margins = best
    log(f"  chosen candidate {ci} (margins ok: {margins_ok(margins)})")

    model, info = load_hf(out_dir, F64)
    logits, caps = hf_prefill(model, ids)
    hn = caps["final_norm"]
    mtp_layer = mtp_layer_from_hub(model, W, F64)
    mtp = hf_mtp(model, mtp_layer, W, N, ids, hn, eps, False)
    mtp_v = hf_mtp(model, mtp_layer, W, N, ids, hn, eps, True)
    checks = {"loading_info": info,
              "independent_vs_hf_logits_max_abs": maxabs(ref["logits"], logits),
              "independent_vs_hf_mtp_max_abs": maxabs(ref["mtp"]["logits"], mtp),
              "independent_vs_hf_mtp_vllm_max_abs": maxabs(ref["mtp_vllm"]["logits"], mtp_v)}
    m32, _ = load_hf(out_dir, torch.float32)
    with torch.no_grad():
        l32 = m32(input_ids=ids[None], use_cache=False).logits[0].to(F64)
    checks["hf_float32_vs_float64_logits_max_abs"] = maxabs(l32, logits)
    checks["hf_float32_vs_float64_top1_agreement"] = float((l32.argmax(-1) == logits.argmax(-1)).double().mean())
    for k, v in checks.items():
        log(f"  reference check {k}: {v}")

    d = os.path.join(out_dir, "reference")
    os.makedirs(d, exist_ok=True)
    S, V = logits.shape
    json.dump({"input_ids": ids.tolist()}, open(os.path.join(d, "tokens.json"), "w"))
    write_bin(os.path.join(d, "logits.bin"), logits)
    write_bin(os.path.join(d, "mtp_logits.bin"), mtp)
    write_bin(os.path.join(d, "mtp_logits_vllm.bin"), mtp_v)
    layers = {}
    for L in list(range(N)) + ["mtp"]:
        c = ref["caps"][L] if L != "mtp" else ref["mtp"]["cap"]
        e = {}
        if "router_ids" in c:
            h = torch.bincount(c["router_ids"].flatten(), minlength=C["n_routed_experts"])
            e["expert_hist"] = h.tolist()
            e["experts_used"] = int((h > 0).sum())
        if "indexer_score" in c and "indexer_sel" in c:
            # Exact ties at the k-th place (ReLU scores of exactly 0) would make the selection
            # implementation-defined; the candidate search avoids them where it can.
            sc, k = c["indexer_score"], C["index_topk"]
            causal = torch.ones_like(sc, dtype=torch.bool).tril()
            e["indexer_zero_score_fraction"] = float((sc[causal] == 0).double().mean())
            ties = 0
            for i in range(k, sc.shape[0]):
                v = torch.sort(sc[i, : i + 1], descending=True).values
                ties += int(v[k - 1] == v[k])
            e["indexer_boundary_tie_rows"] = ties
        if "indexer_sel" in c:
            sel = c["indexer_sel"]
            e["indexer_rows_selecting"] = int(sum(1 for i in range(sel.shape[0]) if int(sel[i, : i + 1].sum()) < i + 1))
        if c.get("indexer_shared"):
            e["indexer"] = "shared (reuses previous layer's top-k)"
        layers[str(L)] = e
    meta = {
        "model": "glm5_nano",
        "architecture": ARCH,
        "variant": "trained-bf16",
        "seq_len": S,
        "vocab_size": V,
        "files": {
            "logits.bin": {"shape": [S, V], "dtype": "float32", "byte_order": "little",
                           "what": "logits of a causal prefill of tokens.json input_ids, row i = position i"},
            "mtp_logits.bin": {"shape": [S - 1, V], "dtype": "float32", "byte_order": "little",
                               "what": "MTP layer logits; row i uses embed(input_ids[i+1]) and the main model's "
                                       "final-normed hidden state at position i, RoPE position i; predicts "
                                       "input_ids[i+2]"},
            "mtp_logits_vllm.bin": {"shape": [S - 1, V], "dtype": "float32", "byte_order": "little",
                                    "what": "same as mtp_logits.bin but with the embedding at position 0 zeroed "
                                            "before enorm, as vLLM's DeepSeekMultiTokenPredictorLayer does"},
        },
        "logit_std": float(logits.std()),
        "max_abs_logit": float(logits.abs().max()),
        "mtp_max_abs_logit": float(mtp.abs().max()),
        "candidate": ci,
        "generator": dict(versions(), script="scripts/train/train_tiny_glm5.py",
                          reference="HF transformers float64 from_pretrained(models/glm5_nano), "
                                    "attn_implementation=eager, experts_implementation=eager (CPU)"),
        "checks": checks,
        "diagnostics": {"margins": margins, "layers": layers},
        "suggested_tolerance": {"fp32_max_abs_over_max_abs_logit": 1e-4},
    }
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"), indent=2, sort_keys=True, default=str)
    return meta
