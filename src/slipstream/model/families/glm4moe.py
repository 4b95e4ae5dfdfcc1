"""GLM-4.5, GLM-4.5-Air, GLM-4.6 (llama.cpp's `glm4moe`), as its glm4-moe graph computes them
and transformers' Glm4Moe model does:
- attention with biases on the query, key and value projections (attention_bias), an
  RMSNorm over each query and key head before RoPE where the file has the norms (GLM-4.5's
  355B: use_qk_norm; Air has none), RoPE on the first half of each 128-wide head
  (`rope.dimension_count` 64, partial_rotary_factor 0.5), NEOX pairing (the converter
  keeps the checkpoint's rows: llama.cpp's rope type for glm4moe is NEOX, unlike GLM-4's);
- one RMSNorm before the FFN, the tensor llama.cpp names post_attention_norm (attn_post_norm,
  applied after the attention's residual add) where other families have ffn_norm;
- the first `leading_dense_block_count` layers (1) a dense SwiGLU FFN, the others a
  mixture of experts (families.routed): sigmoid gating, the selection bias, groups where the
  file sets them (1 in the released models), the top `expert_used_count` (8) weights
  renormalised and scaled by `expert_weights_scale` (2.5), and one shared expert;
- `nextn_predict_layers` (1) multi-token-prediction layers after the model's own in the
  file, skipped.
Multimodal GLM-4.5V files (rope.dimension_sections, M-RoPE) are turned away, as GLM-4's."""

from __future__ import annotations

from typing import Any, Mapping

from ..layer_spec import LayerSpec, TensorSpec
from .base import BlockTraits, Family
from .experts import EXPERTS
from .glm4 import configure as glm4_configure
from .llama import LLAMA_ATTENTION, LLAMA_LINEARS, q_dim
from .routed import DENSE_FFN, FFN_LINEARS, ROUTED, SELECTION_BIAS, routed_fields

GLM4MOE_TENSORS: tuple[TensorSpec, ...] = (
    *LLAMA_ATTENTION,
    TensorSpec("attn_q_norm.weight", "norm", lambda c: (c.head_dim,), flag="qk_norm"),
    TensorSpec("attn_k_norm.weight", "norm", lambda c: (c.head_dim,), flag="qk_norm"),
    TensorSpec("post_attention_norm.weight", "norm", lambda c: (c.hidden,)),
    *DENSE_FFN,
    *ROUTED,
    SELECTION_BIAS,
    TensorSpec("attn_q.bias", "bias", lambda c: (q_dim(c),), flag="attn_bias"),
    TensorSpec("attn_k.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
    TensorSpec("attn_v.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
)

GLM4MOE_LAYER = LayerSpec(
    tensors=GLM4MOE_TENSORS,
    norms=("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"),
    linears=tuple(g for g in LLAMA_LINEARS if g.field in ("attn_qkv", "attn_output"))
    + FFN_LINEARS,
    experts=EXPERTS)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    """The experts' pieces (families.routed; sigmoid gating where the file names none, as
    llama.cpp defaults it for glm4moe). Multimodal files are refused, as GLM-4's are."""
    glm4_configure(md, arch, source, base)
    return routed_fields(md, arch, source, base, gating="sigmoid")


GLM4MOE = Family(
    name="glm4moe",
    architectures={"glm4moe": "neox"},
    layer=GLM4MOE_LAYER,
    moe_layer=GLM4MOE_LAYER,
    traits=BlockTraits(moe_gating="sigmoid"),
    configure=configure,
    optional_qk_norm=True,
    quirks="QKV biases, optional q/k norms, RoPE on half of each head, a dense first layer, "
           "sigmoid routing with a selection bias, groups and a scale, a shared expert; "
           "its MTP layer skipped",
    cuda_refused="built and tested on the CPU; its CUDA path has not run",
)
