"""Training-time additions to transformers' GlmMoeDsa modules (none of them changes inference).

* Router: aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each step every MoE layer's
  e_score_correction_bias moves by gamma * sign(mean load - load of the expert); plus the
  small sequence-wise balance loss of DeepSeek-V3 (alpha * sum_i f_i P_i per sequence).
* DSA indexer: transformers computes the indexer under torch.no_grad (top-k only), so its
  weights would never train. During training each indexer runs `indexer_forward` below: the
  same score, on inputs detached from the main graph (DeepSeek-V3.2), kept for a KL loss
  towards the main attention (summed over heads, L1-normalised; for a "full" layer averaged
  with the "shared" layers that reuse its top-k), over the tokens the indexer selected. The
  rope layout of the score is calibrated against the installed transformers at start-up
  (`calibrate_indexer`) and the loss is switched off if no layout reproduces its top-k.
* Routed experts: `grouped_experts_forward` computes the same expert MLPs with
  torch._grouped_mm (one kernel per projection instead of a loop over experts); used only
  after `check_grouped_experts` agrees with transformers' eager loop (outputs and grads).
"""

import inspect
import math
import types

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------
# Router


class RouterStats:
    """Per-MoE-layer expert load of the current step and the sequence-balance loss."""

    def __init__(self, routers, top_k, n_experts):
        self.routers = routers            # [(name, TopkRouter module)]
        self.top_k, self.E = top_k, n_experts
        self.load = {n: torch.zeros(n_experts, device=r.weight.device) for n, r in routers}
        self.total_load = {n: torch.zeros(n_experts, device=r.weight.device) for n, r in routers}
        self.bal_losses = []
        self.batch = 1
        self.enabled = True
        self.handles = [r.register_forward_hook(self._hook(n)) for n, r in routers]

    def _hook(self, name):
        def hook(mod, _inp, out):
            if not self.enabled:
                return
            logits = out[0] if isinstance(out, tuple) else out
            scores = logits.float().sigmoid()                           # [T, E]
            choice = scores.detach() + mod.e_score_correction_bias
            idx = choice.topk(self.top_k, dim=-1).indices               # HF's choice (n_group 1)
            cnt = torch.bincount(idx.flatten(), minlength=self.E).float()
            self.load[name] += cnt
            self.total_load[name] += cnt
            if torch.is_grad_enabled():
                B = self.batch
                T = scores.shape[0] // B
                p = (scores / scores.sum(-1, keepdim=True)).view(B, T, self.E).mean(1)   # P_i
                f = torch.zeros(B, self.E, device=scores.device)
                f.scatter_add_(1, idx.view(B, T * self.top_k), torch.ones_like(idx.view(B, -1), dtype=f.dtype))
                f = f * self.E / (self.top_k * T)                                          # f_i
                self.bal_losses.append((f * p).sum(-1).mean())
        return hook

    def take_balance_loss(self):
        loss = torch.stack(self.bal_losses).sum() if self.bal_losses else None
        self.bal_losses = []
        return loss

    @torch.no_grad()
    def update_bias(self, gamma):
        for n, r in self.routers:
            load = self.load[n]
            r.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
            load.zero_()

    def summary(self):
        out = {}
        for n, r in self.routers:
            t = self.total_load[n]
            frac = (t / t.sum().clamp(min=1)).tolist()
            out[n] = {"load_fraction": [round(x, 5) for x in frac],
                      "max_over_mean": float(t.max() / t.mean().clamp(min=1e-9)),
                      "min_over_mean": float(t.min() / t.mean().clamp(min=1e-9)),
                      "bias": [round(x, 5) for x in r.e_score_correction_bias.tolist()]}
        return out

    def reset_totals(self):
        for t in self.total_load.values():
            t.zero_()


# ----------------------------------------------------------------------------------------
# DSA indexer

def _rope(x, cos, sin, interleave):
    """x [..., d]; cos/sin broadcastable to x[..., :d/2]."""
    d = x.shape[-1]
    if interleave:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).reshape(x.shape)
    x0, x1 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)


def _half_tables(t, layout):
    """cos or sin [B, S, d] from HF's rotary embedding -> [B, S, d/2] frequency table."""
    if layout == "cat":            # cat((freqs, freqs), -1)
        return t[..., : t.shape[-1] // 2]
    return t[..., 0::2]            # repeat_interleave(freqs, 2, -1)


INDEXER_ARGS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")


def bind_indexer_args(mod, args, kwargs):
    """The indexer call's (hidden_states, q_resid, position_embeddings, attention_mask), by the
    names of transformers' forward signature, or by position where its names differ."""
    b = inspect.signature(type(mod).forward).bind(mod, *args, **kwargs)
    named = dict(b.arguments)
    if all(k in named for k in INDEXER_ARGS[:3]):
        return {k: named.get(k) for k in INDEXER_ARGS}
    vals = list(named.values())[1:]
    return {k: (vals[i] if i < len(vals) else None) for i, k in enumerate(INDEXER_ARGS)}


def _indexer_dims(mod):
    cfg = mod.config
    n_heads = getattr(mod, "n_heads", None) or cfg.index_n_heads
    head_dim = getattr(mod, "head_dim", None) or cfg.index_head_dim
    return n_heads, head_dim, cfg.qk_rope_head_dim


def indexer_scores(mod, hidden_states, q_resid, position_embeddings, layout, interleave):
    """The DSA index score [B, S, T] of transformers' GlmMoeDsaIndexer, differentiable in the
    indexer's own weights (inputs detached): sum_h w_h * relu(q_h . k * D^-1/2), w = weights_proj(x) / sqrt(H)."""
    B, S, _ = hidden_states.shape
    x, qr = hidden_states.detach(), q_resid.detach()
    cos, sin = position_embeddings
    c, s = _half_tables(cos, layout), _half_tables(sin, layout)
    nh, hd, dr = _indexer_dims(mod)
    q = mod.wq_b(qr).view(B, S, nh, hd)
    q = torch.cat((_rope(q[..., :dr], c[:, :, None], s[:, :, None], interleave), q[..., dr:]), -1)
    k = mod.k_norm(mod.wk(x))
    k = torch.cat((_rope(k[..., :dr], c, s, interleave), k[..., dr:]), -1)
    w = mod.weights_proj(x).float() * nh ** -0.5
    sc = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * hd ** -0.5)
    return torch.einsum("bsht,bsh->bst", sc, w)


class IndexerTrainer:
    """Swaps each indexer's forward for a differentiable one and builds the KL loss."""

    def __init__(self, attn_modules, groups, layout, interleave):
        # attn_modules: {name: attention module}; groups: {full name: [names sharing its top-k]}
        self.attn = attn_modules
        self.groups = groups
        self.layout, self.interleave = layout, interleave
        self.scores, self.sel, self.probs = {}, {}, {}
        self.handles = []
        self.active = False
        for name, a in attn_modules.items():
            self.handles.append(a.register_forward_hook(self._attn_hook(name)))

    def _attn_hook(self, name):
        def hook(_m, _inp, out):
            if not self.active or not torch.is_grad_enabled():
                return
            if isinstance(out, tuple) and len(out) > 1 and torch.is_tensor(out[1]) and out[1].dim() == 4:
                w = out[1].detach()
                self.probs[name] = w.float().mean(1)                      # [B, S, T]
        return hook

    def install(self):
        for name in self.groups:
            idx = self.attn[name].indexer
            idx.forward = types.MethodType(self._make_forward(name), idx)
        self.active = True

    def uninstall(self):
        for name in self.groups:
            idx = self.attn[name].indexer
            if "forward" in idx.__dict__:
                del idx.forward
        self.active = False

    def _make_forward(self, name):
        trainer = self

        def forward(mod, *args, **kwargs):
            a = bind_indexer_args(mod, args, kwargs)
            score = indexer_scores(mod, a["hidden_states"], a["q_resid"], a["position_embeddings"],
                                   trainer.layout, trainer.interleave)
            masked = score.detach()
            if a.get("attention_mask") is not None:
                masked = masked + a["attention_mask"]
            topk = min(mod.index_topk, masked.shape[-1])
            idx = masked.topk(topk, dim=-1).indices
            if torch.is_grad_enabled():
                trainer.scores[name] = score
                trainer.sel[name] = idx
            return idx
        return forward

    def take_loss(self):
        """Cross-entropy of the indexer distribution against the attention target (= KL up to
        the target's entropy), over selected causal tokens, mean over query rows and groups."""
        losses, kls = [], []
        for full, members in self.groups.items():
            if full not in self.scores:
                continue
            ps = [self.probs[m] for m in members if m in self.probs]
            if not ps:
                continue
            p = torch.stack(ps).mean(0)
            score = self.scores[full]
            B, S, T = score.shape
            sel = torch.zeros(B, S, T, dtype=torch.bool, device=score.device)
            sel.scatter_(-1, self.sel[full], True)
            causal = torch.ones(S, T, dtype=torch.bool, device=score.device).tril(T - S)
            mask = sel & causal
            logq = torch.log_softmax(score.masked_fill(~mask, float("-inf")), -1)
            p = torch.where(mask, p, 0.0)
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
            ce = -torch.where(mask, p * logq, 0.0).sum(-1).mean()
            with torch.no_grad():
                pos = mask & (p > 0)
                kl = torch.where(pos, p * (torch.log(p.clamp(min=1e-30)) - logq), 0.0).sum(-1).mean()
            losses.append(ce)
            kls.append(kl)
        self.scores, self.sel, self.probs = {}, {}, {}
        if not losses:
            return None, None
        return torch.stack(losses).mean(), torch.stack(kls).mean()

    def set_topk(self, k):
        for a in self.attn.values():
            if getattr(a, "indexer", None) is not None:     # "shared" layers have none
                a.indexer.index_topk = k


@torch.no_grad()
def calibrate_indexer(indexer, args, kwargs):
    """Which (cos/sin layout, interleave) makes `indexer_scores` select what HF selects, given
    the arguments of one call of transformers' indexer (captured by a pre-hook)."""
    ref = indexer(*args, **kwargs)
    a = bind_indexer_args(indexer, args, kwargs)
    hidden, q_resid, pos_emb, mask = (a["hidden_states"], a["q_resid"], a["position_embeddings"],
                                      a.get("attention_mask"))
    results = {}
    for layout in ("cat", "repeat"):
        for il in (True, False):
            sc = indexer_scores(indexer, hidden, q_resid, pos_emb, layout, il)
            if mask is not None:
                sc = sc + mask
            mine = sc.topk(ref.shape[-1], dim=-1).indices
            valid = (mask > -1e30) if mask is not None else torch.ones_like(sc, dtype=torch.bool)
            a = torch.zeros(sc.shape, dtype=torch.bool, device=sc.device).scatter_(-1, ref, True) & valid
            b = torch.zeros(sc.shape, dtype=torch.bool, device=sc.device).scatter_(-1, mine, True) & valid
            results[f"{layout}/{'interleave' if il else 'half'}"] = float((a == b).all(-1).float().mean())
    best = max(results, key=results.get)
    layout, style = best.split("/")
    return (layout, style == "interleave"), results


# ----------------------------------------------------------------------------------------
# Routed experts with grouped GEMMs

GROUP_ALIGN = 16   # rows per expert group padded to a multiple of this (grouped GEMM alignment)


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' GlmMoeDsaNaiveMoe.forward (gate_up_proj [E, 2I, H], down_proj [E, H, I],
    gate = first I rows), with torch._grouped_mm over expert-sorted, padded token rows."""
    T, H = hidden_states.shape
    E = self.num_experts
    K = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    sorted_e = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - start[sorted_e]
    pos = pstart[sorted_e] + rank                       # row of each (token, k) in the padded layout
    rows = flat.numel() + GROUP_ALIGN * E
    offs = torch.cumsum(padded, 0).to(torch.int32)
    tok = order // K
    x = torch.zeros(rows, H, device=hidden_states.device, dtype=torch.bfloat16)
    x = x.index_copy(0, pos, hidden_states[tok].to(torch.bfloat16))
    gu = torch._grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = self.act_fn(g) * u
    y = torch._grouped_mm(h, self.down_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    y = y.index_select(0, pos) * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, tok, y.to(out.dtype))


def install_grouped_experts(experts_modules):
    for m in experts_modules:
        m.forward = types.MethodType(grouped_experts_forward, m)


def uninstall_grouped_experts(experts_modules):
    for m in experts_modules:
        if "forward" in m.__dict__:
            del m.forward


def check_grouped_experts(mod, device, log):
    """Grouped vs transformers' eager experts on random routing: outputs and grads (bf16)."""
    torch.manual_seed(0)
    T, H = 777, mod.hidden_dim
    x = torch.randn(T, H, device=device, requires_grad=True)
    idx = torch.stack([torch.randperm(mod.num_experts, device=device)[:4] for _ in range(T)])
    idx[:50] = torch.arange(4, device=device)       # an uneven load
    w = torch.rand(T, 4, device=device)
    res = {}
    for tag, install in (("eager", False), ("grouped", True)):
        if install:
            install_grouped_experts([mod])
        x.grad = None
        mod.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(x, idx, w)
        (y.float() * torch.linspace(-1, 1, H, device=device)).sum().backward()
        res[tag] = (y.detach().float(), x.grad.clone(), mod.gate_up_proj.grad.clone(), mod.down_proj.grad.clone())
        if install:
            uninstall_grouped_experts([mod])
    mod.zero_grad(set_to_none=True)
    rel = [float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in zip(res["grouped"], res["eager"])]
    log(f"  grouped experts vs eager: rel err out {rel[0]:.2e}, dx {rel[1]:.2e}, "
        f"d gate_up {rel[2]:.2e}, d down {rel[3]:.2e}")
    return max(rel) < 2e-2 and all(math.isfinite(r) for r in rel), rel
