"""GLM-4 (the 0414 releases, 9B and 32B; llama.cpp's `glm4`): the Llama block with
- biases on the query, key and value projections (GLM-4's attention_bias), read as Qwen2's;
- the gate and up projections stored as one tensor (`ffn_up.weight`, 2 * ffn rows, gate
  first), built as the block's ffn_gate_up as Phi-3's is;
- RMSNorm on the attention output and on the FFN output before each residual add
  (post_attention_norm, post_ffw_norm: transformers' post_self_attn_layernorm and
  post_mlp_layernorm), beside the usual pre-norms;
- partial rotary: RoPE turns the first half of each 128-wide head (`rope.dimension_count`
  64), the rest passes;
- NORMAL RoPE pairing (adjacent dimensions, as the checkpoint trains them: llama.cpp's
  converter does not permute GLM-4's rows).
The older ChatGLM files (`chatglm`: a fused query_key_value tensor) are another
architecture, and multimodal GLM-4 files (rope.dimension_sections, M-RoPE) are turned away.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import UnsupportedArchitecture
from ..layer_spec import LayerSpec, LinearGroup, TensorSpec
from .base import BlockTraits, Family
from .gemma3 import POST_NORMS
from .llama import LLAMA_TENSORS

GLM4_TENSORS: tuple[TensorSpec, ...] = tuple(
    TensorSpec("ffn_up.weight", "weight", lambda c: (2 * c.ffn, c.hidden))
    if t.suffix == "ffn_up.weight" else t
    for t in LLAMA_TENSORS if t.suffix != "ffn_gate.weight") + POST_NORMS

GLM4_LINEARS: tuple[LinearGroup, ...] = (
    LinearGroup("attn_qkv", ("attn_q", "attn_k", "attn_v")),
    LinearGroup("ffn_gate_up", ("ffn_up",)),
    LinearGroup("attn_output", ("attn_output",)),
    LinearGroup("ffn_down", ("ffn_down",)),
)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    key = f"{arch}.rope.dimension_sections"
    if any(md.get(key) or ()):
        raise UnsupportedArchitecture(
            f"{source}: {key} is {md[key]}: multimodal GLM-4 files (M-RoPE) are not "
            f"supported, only text GLM-4")
    return {}


GLM4 = Family(
    name="glm4",
    architectures={"glm4": "normal"},
    layer=LayerSpec(tensors=GLM4_TENSORS,
                    norms=("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"),
                    linears=GLM4_LINEARS),
    traits=BlockTraits(post_norms=True),
    configure=configure,
    quirks="QKV biases, a fused gate/up tensor, post-attention/FFN norms, RoPE on half of "
           "each head",
)
