"""Phi-3 and Phi-4 (3.8B mini to 14B): the Llama block with
- Q, K and V stored as one tensor (`attn_qkv.weight`, rows q | k | v), as the checkpoints
  train them (qkv_proj); llama.cpp's converter keeps it fused. The loader builds it as the
  block's fused attn_qkv linear directly, with nothing to concatenate;
- the gate and up projections stored as one tensor (`ffn_up.weight`, 2 * ffn rows: gate then
  up, llama.cpp's LLM_FFN_SWIGLU split and transformers' gate_up_proj.chunk(2)), built as the
  block's ffn_gate_up;
- LongRoPE (the 128k-context models): two sets of per-frequency divisors, the global tensors
  `rope_factors_short.weight` and `rope_factors_long.weight` ((rope_dim / 2,) each). As in
  llama.cpp, a context of more than `rope.scaling.original_context_length` positions takes
  the long set, any other the short one; and cos and sin are multiplied by
  `rope.scaling.attn_factor` (sqrt(1 + ln(s) / ln(original)) for a context s times the
  original: 1.19 for Phi-3-mini-128k's 131072 over 4096), as transformers does too;
- partial rotary where `rope.dimension_count` is below the head size (Phi-4-mini: 96 of
  128); Phi-3 and Phi-4 (14B) rotate every dimension of their 96- and 128-wide heads;
- a sliding window on every layer where the file gives one (Phi-3-mini: 2047 positions);
  Phi-4 and Phi-3.5 give none or one longer than their context.
NEOX RoPE pairing (llama.cpp's LLM_ARCH_PHI3 rope type). Files with separate attn_q / attn_k /
attn_v tensors (which llama.cpp's loader also accepts) are not read: every Phi-3/Phi-4
conversion keeps them fused, and a file without the fused one fails naming
`blk.0.attn_qkv.weight`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...modelfile.hparams import md_float, md_int
from ..layer_spec import LayerSpec, LinearGroup, TensorSpec
from .base import Family
from .llama import q_dim

# the LongRoPE divisors: global tensors (llama.cpp reads them once for every layer)
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"

PHI3_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("attn_qkv.weight", "weight", lambda c: (q_dim(c) + 2 * c.kv_dim, c.hidden)),
    TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, q_dim(c))),
    TensorSpec("ffn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("ffn_up.weight", "weight", lambda c: (2 * c.ffn, c.hidden)),
    TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn)),
)

# each stored tensor is already the block's fused linear: a group of one part built into the
# group's field (attn_qkv, ffn_gate_up)
FUSED_LINEARS: tuple[LinearGroup, ...] = (
    LinearGroup("attn_qkv", ("attn_qkv",)),
    LinearGroup("ffn_gate_up", ("ffn_up",)),
    LinearGroup("attn_output", ("attn_output",)),
    LinearGroup("ffn_down", ("ffn_down",)),
)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    context = base["context_length"]
    window = md_int(md, f"{arch}.attention.sliding_window", source, 0, 1 << 24, default=0)
    # llama.cpp's n_ctx_orig_yarn: the trained context where the file does not say
    orig = md_int(md, f"{arch}.rope.scaling.original_context_length", source, 1, context,
                  default=context, hint=f" (at most the context length {context})")
    factor = md_float(md, f"{arch}.rope.scaling.attn_factor", source, 1.0, 0.0, 16.0,
                      lo_open=True, hint=" (LongRoPE's is about 1.2)")
    # a window as long as the context never narrows attention (Phi-3.5: 262144 > 131072)
    return dict(sliding_window=window if 0 < window < context else 0,
                rope_attn_factor=factor, rope_ctx_orig=orig)


PHI3 = Family(
    name="phi3",
    architectures={"phi3": "neox"},
    layer=LayerSpec(tensors=PHI3_TENSORS, norms=("attn_norm", "ffn_norm"),
                    linears=FUSED_LINEARS),
    configure=configure,
    quirks="fused QKV and gate/up tensors, LongRoPE short/long factors with an attention "
           "factor, partial rotary, a sliding window on every layer",
)
