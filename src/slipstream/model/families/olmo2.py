"""OLMo 2 (1B to 32B): the Llama block with its norms moved after the sublayers:
- no norm before attention or the FFN (no attn_norm / ffn_norm tensors): each sublayer reads
  the residual stream as it is;
- RMSNorm on the attention output and on the FFN output before each residual add
  (post_attention_norm, post_ffw_norm), as Gemma's post norms;
- RMSNorm on the queries and keys after their projections, each over the whole projection
  (weights of n_heads * head_dim and n_kv_heads * head_dim), not per head as Qwen3's and
  Gemma 3's: one mean square over every head of a token;
- NEOX RoPE pairing; its own output head (no tied embeddings).
OLMo 2 files with a sliding window (llama.cpp's reading for OLMo 3) are turned away by name:
their global layers stretch RoPE with YaRN, which slipstream does not run.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import UnsupportedArchitecture
from ...modelfile.hparams import md_int
from ..layer_spec import LayerSpec, TensorSpec
from .base import BlockTraits, Family
from .gemma3 import POST_NORMS
from .llama import LLAMA_LINEARS, LLAMA_TENSORS, q_dim

WHOLE_QK_NORMS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_q_norm.weight", "norm", lambda c: (q_dim(c),)),
    TensorSpec("attn_k_norm.weight", "norm", lambda c: (c.kv_dim,)),
)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    window = md_int(md, f"{arch}.attention.sliding_window", source, 0, 1 << 24, default=0)
    if window:
        raise UnsupportedArchitecture(
            f"{source}: {arch}.attention.sliding_window is {window}: sliding-window OLMo "
            f"files (OLMo 3) are not supported, only OLMo 2's global attention")
    return {}


OLMO2 = Family(
    name="olmo2",
    architectures={"olmo2": "neox"},
    layer=LayerSpec(
        tensors=tuple(t for t in LLAMA_TENSORS if t.kind == "weight") + WHOLE_QK_NORMS
        + POST_NORMS,
        norms=("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
        linears=LLAMA_LINEARS),
    traits=BlockTraits(pre_norms=False, qk_norm=True, qk_norm_whole=True, post_norms=True),
    configure=configure,
    quirks="norms after attention and the FFN instead of before, query/key RMSNorm over the "
           "whole projection",
)
