"""gpt-oss (gpt-oss-20b, gpt-oss-120b; general.architecture "gpt-oss"), as llama.cpp's
openai-moe graph computes it and transformers' GptOss model does:
- attention with biases on the query, key, value and output projections, and a learned
  "sink" logit per query head (`attn_sinks`, (n_heads,)) that joins each softmax's
  denominator and takes no value: a head may attend to nothing;
- sliding-window layers (the last `attention.sliding_window` positions: 128 in both models)
  alternating with full-attention ones, the even layers sliding (llama.cpp's swa pattern 2,
  transformers' layer_types);
- YaRN RoPE (factor 32 over 4096 original positions in both models), NEOX pairing;
- a mixture-of-experts FFN in every layer, its input normed by `post_attention_norm` (the
  tensor llama.cpp calls attn_post_norm and applies before the FFN, so it stands where other
  families' ffn_norm does): a router with a bias, the top `expert_used_count` logits chosen
  first and the softmax taken over those k only (llama.cpp's SOFTMAX_WEIGHT gating), each
  expert a clamped SwiGLU with biases, `expert_feed_forward_length` wide:
      gate = min(gate, 7), up = clamp(up, -7, 7), out = (up + 1) * gate * sigmoid(1.702 gate)
- the usual final RMSNorm and an untied head.
The released files store the experts in MXFP4 and the rest in 8 bits or more."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import MissingMetadata
from ...modelfile.hparams import md_int
from ..layer_spec import LayerSpec, TensorSpec
from .base import BlockTraits, Family
from .experts import EXPERT_TENSORS, EXPERTS
from .llama import LLAMA_ATTENTION, LLAMA_LINEARS, q_dim

# llama.cpp's set_swa_pattern(2) and transformers' layer_types: layer i slides when i is even
SWA_PATTERN = 2
MAX_EXPERT_FFN = 1 << 20

GPTOSS_TENSORS: tuple[TensorSpec, ...] = (
    *LLAMA_ATTENTION,
    TensorSpec("attn_sinks.weight", "norm", lambda c: (c.n_heads,)),
    TensorSpec("post_attention_norm.weight", "norm", lambda c: (c.hidden,)),
    *EXPERT_TENSORS,
    TensorSpec("attn_q.bias", "bias", lambda c: (q_dim(c),)),
    TensorSpec("attn_k.bias", "bias", lambda c: (c.kv_dim,)),
    TensorSpec("attn_v.bias", "bias", lambda c: (c.kv_dim,)),
    TensorSpec("attn_output.bias", "bias", lambda c: (c.hidden,)),
    TensorSpec(f"{EXPERTS.router}.bias", "bias", lambda c: (c.n_experts,)),
    TensorSpec(f"{EXPERTS.gate}.bias", "bias", lambda c: (c.n_experts, c.expert_ffn)),
    TensorSpec(f"{EXPERTS.up}.bias", "bias", lambda c: (c.n_experts, c.expert_ffn)),
    TensorSpec(f"{EXPERTS.down}.bias", "bias", lambda c: (c.n_experts, c.hidden)),
)

GPTOSS_LAYER = LayerSpec(
    tensors=GPTOSS_TENSORS,
    norms=("attn_norm", "attn_sinks", "post_attention_norm"),
    linears=tuple(g for g in LLAMA_LINEARS if g.field in ("attn_qkv", "attn_output")),
    experts=EXPERTS)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    """The window and the experts' width. A gpt-oss file without experts is refused, as
    llama.cpp refuses it (every layer's FFN is a mixture)."""
    if not base.get("n_experts"):
        raise MissingMetadata(f"{source}: missing required metadata '{arch}.expert_count' (a "
                              f"{arch} model's every layer is a mixture of experts)")
    window = md_int(md, f"{arch}.attention.sliding_window", source, 1, base["context_length"])
    width = md_int(md, f"{arch}.expert_feed_forward_length", source, 1, MAX_EXPERT_FFN)
    return dict(sliding_window=window, swa_pattern=SWA_PATTERN, expert_ffn=width)


GPTOSS = Family(
    name="gpt-oss",
    architectures={"gpt-oss": "neox"},
    layer=GPTOSS_LAYER,
    moe_layer=GPTOSS_LAYER,
    traits=BlockTraits(attn_sinks=True, moe_gating="topk_softmax", ffn_act="swiglu_oai"),
    configure=configure,
    quirks="attention biases and per-head sinks, 1:1 sliding-window (128) and full layers, "
           "YaRN, experts with biases and a clamped SwiGLU, top-k then softmax routing",
)
