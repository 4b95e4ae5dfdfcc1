"""Attention with sinks (gpt-oss): each query head h has a learned logit s_h that joins its
softmax's denominator and contributes no value,
    p_j = exp(a_j) / (exp(s_h) + sum_i exp(a_i)),   out = sum_j p_j v_j,
so a head may put weight on nothing (its outputs then shrink towards 0), as llama.cpp's
ggml_soft_max_add_sinks and transformers' GptOss eager attention compute it: the sink
concatenated as one more column of logits, the softmax taken in float32, the column
dropped."""

from __future__ import annotations

import math

import torch

from .step import Step


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, group: int,
                   scale: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """model.llama.attention with each head's sink logit (sinks (n_heads,), float32).

    q: (T, n_heads, d); k, v: (n_kv_heads, span, d); masked as the step says. Returns
    (T, n_heads * d) in q's dtype. The query heads sharing a KV head are folded into the rows,
    ordered (group, T), as model.llama.attention folds them (and as the step's mask is)."""
    T, n_heads, d = q.shape
    n_kv = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.permute(1, 0, 2).reshape(n_kv, group * T, d).float()
    scores = torch.bmm(qg, k.float().transpose(1, 2)) * scale  # (n_kv, group * T, span)
    if step.needs_mask:
        mask = step.mask if step.mask is not None else step.with_mask(group).mask
        scores = scores.masked_fill(~mask, float("-inf"))
    # head kv * group + g owns rows g * T .. g * T + T - 1 of block kv
    sink = sinks.float().view(n_kv, group, 1, 1).expand(n_kv, group, T, 1)
    logits = torch.cat((scores, sink.reshape(n_kv, group * T, 1)), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.bmm(probs, v.float())  # (n_kv, group * T, d)
    return out.reshape(n_heads, T, d).permute(1, 0, 2).reshape(T, n_heads * d).to(q.dtype)
