"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (an RMSNorm over each query
and key head before RoPE, NEOX pairing, heads of `qwen3moe.attention.key_length`) and a
mixture-of-experts FFN in every layer: a softmax router over `expert_count` experts, the top
`expert_used_count` of them, their weights renormalised to sum to 1 (llama.cpp's qwen3moe
graph always does; transformers' Qwen3MoeConfig.norm_topk_prob, true in both models'
configs), each expert a SwiGLU FFN `expert_feed_forward_length` wide (768 and 1536; the
file's `feed_forward_length` is the unused dense width). No shared expert."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import MissingMetadata
from ...modelfile.hparams import md_int
from .base import BlockTraits, Family
from .experts import with_experts
from .qwen3 import QWEN3

MAX_EXPERT_FFN = 1 << 20


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    """The experts' width: `expert_feed_forward_length`, else the dense width shared among the
    used experts, as llama.cpp defaults it. A qwen3moe file without experts is refused, as
    llama.cpp refuses it."""
    if not base.get("n_experts"):
        raise MissingMetadata(f"{source}: missing required metadata '{arch}.expert_count' (a "
                              f"{arch} model's every layer is a mixture of experts)")
    default = max(1, base["ffn"] // base["n_experts_used"])
    width = md_int(md, f"{arch}.expert_feed_forward_length", source, 1, MAX_EXPERT_FFN,
                   default=default)
    return dict(expert_ffn=width)


QWEN3MOE = Family(
    name="qwen3moe",
    architectures={"qwen3moe": "neox"},
    layer=with_experts(QWEN3.layer),
    moe_layer=with_experts(QWEN3.layer),
    traits=BlockTraits(qk_norm=True),
    configure=configure,
    quirks="Qwen3's query/key norms; a mixture-of-experts FFN (softmax router, top-k "
           "renormalised)",
)
