"""Gemma 3 (270M to 27B): the Llama block with
- RMSNorm on each query and key head before RoPE;
- RMSNorm on the attention and FFN outputs before each residual add (post_attention_norm,
  post_ffw_norm);
- GeGLU (GELU, tanh approximation) in the FFN;
- token embeddings multiplied by sqrt(hidden);
- five sliding-window layers to one global: layer i attends globally when (i + 1) % 6 == 0,
  otherwise to the last `gemma3.attention.sliding_window` positions, with RoPE base 10000
  and no scaling (the global layers take `rope.freq_base` and any linear scaling);
- the 27B scales queries by 1 / sqrt(hidden / heads) (its query_pre_attn_scalar, 168), the
  other sizes by 1 / sqrt(head_dim), as llama.cpp does.
Gemma's (1 + w) norm weights are stored with the 1 added by llama.cpp's converter, so the
norms are plain RMSNorms here. NEOX RoPE pairing; the embedding is tied to the head.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ...modelfile.hparams import md_int
from ..layer_spec import LayerSpec, TensorSpec
from .base import BlockTraits, Family
from .llama import LLAMA_LINEARS, LLAMA_TENSORS
from .qwen3 import QK_NORMS

SWA_PATTERN = 6  # llama.cpp's and transformers' sliding_window_pattern for every Gemma 3
LOCAL_ROPE_BASE = 10000.0
LAYERS_27B = 62  # how llama.cpp tells the 27B, whose query scale differs

POST_NORMS: tuple[TensorSpec, ...] = (
    TensorSpec("post_attention_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("post_ffw_norm.weight", "norm", lambda c: (c.hidden,)),
)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    hidden, n_heads = base["hidden"], base["n_heads"]
    window = md_int(md, f"{arch}.attention.sliding_window", source, 0, base["context_length"],
                    default=0)
    scale = 1.0 / math.sqrt(hidden / n_heads) if base["n_layers"] == LAYERS_27B else 0.0
    return dict(embed_scale=math.sqrt(hidden), sliding_window=window,
                swa_pattern=SWA_PATTERN, rope_base_local=LOCAL_ROPE_BASE, attn_scale=scale)


GEMMA3 = Family(
    name="gemma3",
    architectures={"gemma3": "neox"},
    layer=LayerSpec(
        tensors=tuple(t for t in LLAMA_TENSORS if t.kind != "bias") + QK_NORMS + POST_NORMS,
        norms=("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm",
               "post_ffw_norm"),
        linears=LLAMA_LINEARS),
    traits=BlockTraits(qk_norm=True, post_norms=True, ffn_act="gelu_tanh"),
    configure=configure,
    quirks="query/key and post-attention/FFN norms, GeGLU, scaled embeddings, 5:1 "
           "sliding-window layers with their own RoPE base",
)
