"""The multi-token-prediction (MTP) layer, trained jointly with the main model.

transformers has no MTP module for GlmMoeDsa, so it is written here the way DeepSeek-V3 and
vLLM define it (and as scripts/fixtures/hf_model.py's hf_mtp runs it):

    z_i    = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      h_i: main model's final-normed state
    x      = DecoderLayer(z)                                      transformers' own MoE layer class, layer N
    logits = head(shared_head.norm(x))                            predicts t_{i+2}

The embedding and output head are the main model's (shared, as in DeepSeek-V3); the hub file
carries copies under model.layers.{N}.embed_tokens / shared_head.head (hf_model.hub_weights).
"""

import torch
from torch import nn

from hf_model import ext_config


class MtpHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        cfg = model.config
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm_cls = type(model.model.norm)
        layer_cls = type(model.model.layers[-1])
        self.n_layers = cfg.num_hidden_layers
        self.enorm = norm_cls(D, eps)
        self.hnorm = norm_cls(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.layer = layer_cls(ext_config(cfg), self.n_layers)
        self.head_norm = norm_cls(D, eps)       # shared_head.norm

    def extra_hub_tensors(self):
        """MTP tensors outside the decoder layer, by their hub names under model.layers.{N}."""
        return {"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight,
                "eh_proj.weight": self.eh_proj.weight, "shared_head.norm.weight": self.head_norm.weight}

    def forward(self, model, input_ids, hidden_normed):
        """input_ids [B, S]; hidden_normed [B, S, D] (main model after model.norm).
        Returns the MTP hidden state [B, S-1, D] after shared_head.norm; row i predicts input_ids[i+2]."""
        emb = model.model.embed_tokens(input_ids[:, 1:])
        z = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden_normed[:, :-1])), -1)).float()
        B, S1, _ = z.shape
        pos = torch.arange(S1, device=z.device)[None].expand(B, S1)
        pe = model.model.rotary_emb(z, pos)
        neg = torch.finfo(torch.float32).min
        mask = torch.full((S1, S1), neg, device=z.device, dtype=torch.float32).triu(1)[None, None]
        out = self.layer(z, attention_mask=mask, position_ids=pos, position_embeddings=pe,
                         past_key_values=None, use_cache=False)
        x = out[0] if isinstance(out, tuple) else out
        return self.head_norm(x)
