"""What a family module states: its architecture names, its layer, and the block's variations
it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..layer_spec import LayerSpec


@dataclass(frozen=True)
class BlockTraits:
    """The named ways a family's block differs from the Llama block (model.llama). Each
    default is the Llama block's; a family sets the ones its graph has, and ModelConfig
    carries them to the block math."""

    # RMSNorm before attention and before the FFN (attn_norm, ffn_norm); OLMo 2 has neither
    pre_norms: bool = True
    # RMSNorm over each query and key head (weights attn_q_norm / attn_k_norm, (head_dim,)),
    # after the projection and before RoPE: Qwen3, Gemma 3
    qk_norm: bool = False
    # ... over the whole query and key projections instead (weights (n_heads * head_dim,)
    # and (n_kv_heads * head_dim,)): OLMo 2
    qk_norm_whole: bool = False
    # RMSNorm on the attention output and on the FFN output before each residual add
    # (post_attention_norm / post_ffw_norm): Gemma 2 and 3
    post_norms: bool = False
    # the gated FFN's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU, Gemma) or
    # "swiglu_oai" (gpt-oss's clamped SwiGLU, its experts only: model.moe)
    ffn_act: str = "silu"
    # the block's and the final norm: "rms" (RMSNorm) or "layer" (LayerNorm without bias,
    # Cohere 2)
    norm: str = "rms"
    # attention and the FFN both read the one normed input and add to the residual together
    # (x + attn(h) + ffn(h)): Cohere 2
    parallel: bool = False
    # whether the global (not sliding-window) layers rotate queries and keys; Cohere 2's
    # take no RoPE
    global_rope: bool = True
    # an RMSNorm without weight over each value head before the cache write: Gemma 4
    v_norm: bool = False
    # a learned logit per query head (attn_sinks, (n_heads,)) in each attention softmax's
    # denominator, with no value: gpt-oss
    attn_sinks: bool = False
    # a mixture of experts' routing (model.moe.route): "softmax" (over all experts, then the
    # top k, renormalised: Qwen3-MoE, Mixtral), "topk_softmax" (the top k logits, then a
    # softmax over those: gpt-oss) or "sigmoid" (each expert's sigmoid: GLM-4.5)
    moe_gating: str = "softmax"


# A family's reading of the metadata its block needs beyond the Llama keys: given the file's
# metadata, the architecture, a name for errors and the ModelConfig fields read so far, the
# fields to add (a sliding window, an embedding scale, ...)
Configure = Callable[[Mapping[str, Any], str, str, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    name: str
    # general.architecture -> how it pairs RoPE dimensions: "normal" where llama.cpp's
    # converter permuted Q/K rows so adjacent dimensions pair, "neox" where they are stored as
    # trained and dimension i pairs with i + rope_dim / 2
    architectures: Mapping[str, str]
    layer: LayerSpec
    traits: BlockTraits = field(default_factory=BlockTraits)
    configure: Configure | None = None
    # the layer of the family's files with experts (`{arch}.expert_count` > 0): its FFN a
    # mixture of experts (families.experts); None where the family has no such files
    moe_layer: LayerSpec | None = None
    # what sets the family apart, in a few words (the README's model table, `slipstream info`)
    quirks: str = ""
    # why the family's CUDA path is refused, where it is (it runs on the CPU meanwhile)
    cuda_refused: str = ""
    # whether its layers may differ in shape (per-layer arrays of feed_forward_length and
    # head_count_kv; ModelConfig.layer): Gemma 4
    varied_layers: bool = False
    # the tensors outside the layers its model reads beyond the embedding, the head and the
    # final norm, given its config (Gemma 4's per-layer embedding tables)
    extra_tensors: Callable[[Any], tuple[str, ...]] | None = None

    # whether the file's key_length and value_length describe a latent cache (multi-head
    # latent attention: DeepSeek's 576 and 512), read by the family's configure, not the
    # equal head sizes every other family has
    latent_kv: bool = False
    # whether the per-head query/key norms are optional tensors, read where the file has them
    # (ModelConfig.qk_norm then says whether it does: GLM-4.5's 355B has them, Air not)
    optional_qk_norm: bool = False

    # whether a file may leave `feed_forward_length` out: no layer of it has a dense FFN
    # (Qwen3.5-MoE's converter writes only the experts' widths); the experts' width stands in
    ffn_optional: bool = False

    # whether a layer of its files may lack attn_v, its values being its key projection
    # (ModelConfig.v_from_k_layers: Gemma 4's 31B and 26B-A4B, transformers'
    # attention_k_eq_v), as its layer spec's `reads_as` says
    values_from_keys: bool = False

    # a check of a file's tensor names beyond the layer spec's (given the config, the names
    # and a name for errors), raising on a layout the family cannot run yet
    check_names: Callable[[Any, Any, str], None] | None = None

    def top_tensors(self, cfg: Any) -> tuple[str, ...]:
        """The non-layer tensors beyond the embedding, head and final norm a model of `cfg`
        requires."""
        return self.extra_tensors(cfg) if self.extra_tensors is not None else ()
