"""Qwen3.5's full-attention layers, as llama.cpp's qwen35 graph (build_layer_attn) and
transformers' Qwen3_5Attention compute them: the query projection gives each head its
queries and then a gate of the same width; queries and keys are RMS-normed per head, then
rotated (RoPE on the first rope_dim of each head); attention as the Llama block's; its
output times sigmoid(gate), before attn_output.

Shapes, torch order: attn_q (n_heads * 2 * head_dim, hidden), rows [q_0 | gate_0 | q_1 | ...];
attn_k, attn_v (n_kv_heads * head_dim, hidden)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # type hints only: model.llama imports this module
    from ..modelfile.config import ModelConfig
    from .llama import LayerWeights
    from .rope import RopeTable
    from .step import Step

Attend = Callable[..., torch.Tensor]  # model.llama.attention


def gated_attention(cfg: ModelConfig, w: LayerWeights, h: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable,
                    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                    attend: Attend) -> torch.Tensor:
    """The gated attention (T, n_heads * head_dim) of the normed hidden states h (T, hidden),
    before attn_output; the tokens' keys and values written into the caches (n_kv_heads,
    max_ctx, head_dim) at the step's slots. `rms_norm` and `attend`: the block's
    (model.llama, which imports this module)."""
    T, H, d, n_kv = h.shape[0], cfg.n_heads, cfg.head_dim, cfg.n_kv_heads
    qg = w.attn_q(h).view(T, H, 2 * d)
    gate = qg[..., d:].reshape(T, H * d)
    q = rms_norm(qg[..., :d].reshape(T * H, d), w.attn_q_norm, cfg.norm_eps)
    k = rms_norm(w.attn_k(h).reshape(T * n_kv, d), w.attn_k_norm, cfg.norm_eps)
    qk = rope.apply(torch.cat((q.view(T, H, d), k.view(T, n_kv, d)), dim=1), cos_sin)
    q, k = qk[:, :H], qk[:, H:]
    v = w.attn_v(h).view(T, n_kv, d)
    k_new, v_new = k.transpose(0, 1), v.transpose(0, 1)  # (n_kv, T, d)
    if step.start is not None:  # a contiguous run of slots: a slice write
        k_cache[:, step.start:step.start + T] = k_new
        v_cache[:, step.start:step.start + T] = v_new
    else:
        k_cache.index_copy_(1, step.slots, k_new.to(k_cache.dtype))
        v_cache.index_copy_(1, step.slots, v_new.to(v_cache.dtype))
    attn = attend(q.to(k_cache.dtype), k_cache[:, :step.span], v_cache[:, :step.span], step,
                  cfg.gqa_group, cfg.attention_scale)
    return attn * torch.sigmoid(gate.float()).to(attn.dtype)
