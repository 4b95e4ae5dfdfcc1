"""Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2), as llama.cpp's deepseek2 graph
computes it from the files its converter writes (attn_kv_b split into attn_k_b and attn_v_b):

    q      = q_b(rms_norm(q_a(h), q_a_norm))    (T, H, nope + rope); or attn_q(h) (V2-Lite)
    c, kr  = kv_a_mqa(h)                       (T, kv_lora), (T, rope): one key part for all
    c      = rms_norm(c, kv_a_norm)            the latent the cache keeps
    q_abs  = k_b[h] @ q_nope[h]                (T, H, kv_lora): the key projection absorbed
    Q = [q_abs | rope(q_rope)], K = [c | rope(kr)], one key "head" kv_lora + rope wide
    o[h]   = softmax(Q[h] K^T * scale) c        (T, H, kv_lora): the values are the latent
    out    = [v_b[h] @ o[h]]_h                  (T, H * v_head), then attn_output

which is transformers' DeepseekV3Attention (keys k_b c and values v_b c per head, expanded)
with the two products reassociated: the cache holds kv_lora + rope numbers per token
(576 in every DeepSeek-V3 and Kimi K2 file) instead of H * (nope + rope + v_head) (40960).
The values are read out of the keys' cache (the first kv_lora of each row), so the cache's
values tensor is the keys' (runtime.kv_cache). The scale is the file's key head's,
1 / sqrt(nope + rope), times YaRN's mscale squared (families.deepseek2).

Shapes, torch order: attn_k_b (H, kv_lora, nope), attn_v_b (H, v_head, kv_lora), float32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # type hints only: model.llama imports this module
    from ..modelfile.config import ModelConfig
    from .llama import LayerWeights
    from .rope import RopeTable
    from .step import Step


def mla_attention(cfg: ModelConfig, w: LayerWeights, h: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
                  cache: torch.Tensor, rope: RopeTable,
                  rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
                  ) -> torch.Tensor:
    """The attention of the normed hidden states h (T, hidden) before its output projection,
    (T, n_heads * mla_v_head); the tokens' latent keys written into `cache` (1, max_ctx,
    kv_lora + rope) at the step's slots. `rms_norm`: the block's (model.llama, which imports
    this module)."""
    T, H, lora = h.shape[0], cfg.n_heads, cfg.kv_lora_rank
    nope = cfg.mla_k_head - cfg.rope_dim
    if w.attn_q_a is not None:
        q = w.attn_q_b(rms_norm(w.attn_q_a(h), w.attn_q_a_norm, cfg.norm_eps))
    else:
        q = w.attn_q(h)
    q = q.float().view(T, H, cfg.mla_k_head)
    kv = w.attn_kv_a_mqa(h).float()  # (T, kv_lora + rope)
    latent = rms_norm(kv[:, :lora], w.attn_kv_a_norm, cfg.norm_eps)
    k_rope = rope.apply(kv[:, None, lora:], cos_sin)  # (T, 1, rope)
    q_rope = rope.apply(q[..., nope:], cos_sin)  # (T, H, rope)
    q_abs = torch.einsum("thn,hln->thl", q[..., :nope], w.attn_k_b)  # (T, H, kv_lora)
    query = torch.cat((q_abs, q_rope), dim=-1)  # (T, H, kv_lora + rope)
    key = torch.cat((latent, k_rope[:, 0]), dim=-1).to(cache.dtype)  # (T, kv_lora + rope)
    if step.start is not None:  # a contiguous run of slots: a slice write
        cache[0, step.start:step.start + T] = key
    else:
        cache[0].index_copy_(0, step.slots, key)
    keys = cache[:, :step.span]  # (1, span, kv_lora + rope)
    # the heads folded into rows (H * T, rows ordered (head, T)), as model.llama.attention
    # folds a GQA group over its one KV head
    qg = query.to(cache.dtype).permute(1, 0, 2).reshape(1, H * T, -1)
    mask = None
    if step.needs_mask:
        mask = step.mask if step.mask is not None else step.with_mask(H).mask
    out = F.scaled_dot_product_attention(qg, keys, keys[..., :lora], attn_mask=mask,
                                         scale=cfg.attention_scale)
    out = out.view(H, T, lora).float()
    return torch.einsum("htl,hvl->thv", out, w.attn_v_b).reshape(T, H * cfg.mla_v_head)
