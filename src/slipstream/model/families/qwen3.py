"""Qwen3 (dense, up to 32B): the Llama block with an RMSNorm over each query and key head
before RoPE, no QKV biases, NEOX RoPE pairing, and a head size set apart from hidden / heads
(`qwen3.attention.key_length`: 128 for every size)."""

from __future__ import annotations

from ..layer_spec import LayerSpec, TensorSpec
from .base import BlockTraits, Family
from .llama import LLAMA_LINEARS, LLAMA_TENSORS

QK_NORMS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_q_norm.weight", "norm", lambda c: (c.head_dim,)),
    TensorSpec("attn_k_norm.weight", "norm", lambda c: (c.head_dim,)),
)

QWEN3 = Family(
    name="qwen3",
    architectures={"qwen3": "neox"},
    layer=LayerSpec(tensors=tuple(t for t in LLAMA_TENSORS if t.kind != "bias") + QK_NORMS,
                    norms=("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"),
                    linears=LLAMA_LINEARS),
    traits=BlockTraits(qk_norm=True),
    quirks="RMSNorm on each query and key head before RoPE",
)
