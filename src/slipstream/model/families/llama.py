"""Llama 1/2/3, Mistral (and Mistral Small's `llama` conversions), SmolLM, Qwen2: the Llama
block. RMSNorm, attention with grouped KV heads, RMSNorm, SwiGLU; Qwen2's QKV biases are
optional tensors of the same layer.

Mixtral (8x7B, 8x22B) is a `llama` file with `llama.expert_count` > 0: the same block with a
mixture-of-experts FFN (families.experts), softmax over the experts, the top
`llama.expert_used_count`, their weights renormalised, each expert `llama.feed_forward_length`
wide (llama.cpp's llama graph; transformers' MixtralSparseMoeBlock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..layer_spec import LayerSpec, LinearGroup, TensorSpec
from .base import Family
from .experts import with_experts

if TYPE_CHECKING:  # type hints only: modelfile.config imports the families
    from ...modelfile.config import ModelConfig


def q_dim(cfg: ModelConfig) -> int:
    return cfg.n_heads * cfg.head_dim


# The tensors are listed norm, attention, norm, FFN, then the optional biases: the order
# check_layer_shapes reports problems in.
# the pre-norm and the attention's projections, which most families share as they are
LLAMA_ATTENTION: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("attn_q.weight", "weight", lambda c: (q_dim(c), c.hidden)),
    TensorSpec("attn_k.weight", "weight", lambda c: (c.kv_dim, c.hidden)),
    TensorSpec("attn_v.weight", "weight", lambda c: (c.kv_dim, c.hidden)),
    TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, q_dim(c))),
)
LLAMA_TENSORS: tuple[TensorSpec, ...] = (
    *LLAMA_ATTENTION,
    TensorSpec("ffn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("ffn_gate.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_up.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn)),
    TensorSpec("attn_q.bias", "bias", lambda c: (q_dim(c),), flag="attn_bias"),
    TensorSpec("attn_k.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
    TensorSpec("attn_v.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
)

LLAMA_LINEARS: tuple[LinearGroup, ...] = (
    LinearGroup("attn_qkv", ("attn_q", "attn_k", "attn_v")),
    LinearGroup("ffn_gate_up", ("ffn_gate", "ffn_up")),
    LinearGroup("attn_output", ("attn_output",)),
    LinearGroup("ffn_down", ("ffn_down",)),
)

LLAMA_LAYER = LayerSpec(tensors=LLAMA_TENSORS, norms=("attn_norm", "ffn_norm"),
                        linears=LLAMA_LINEARS)

LLAMA = Family(
    name="llama",
    architectures={"llama": "normal", "mistral": "normal", "qwen2": "neox"},
    layer=LLAMA_LAYER,
    moe_layer=with_experts(LLAMA_LAYER),
    quirks="the reference block; Qwen2's QKV biases; Mixtral's experts (llama.expert_count)",
)
