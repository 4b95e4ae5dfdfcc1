"""Qwen3.5 (llama.cpp's `qwen35`: 0.8B to 27B dense) and Qwen3.5-MoE (`qwen35moe`:
35B-A3B, 122B-A10B, 397B-A17B), as llama.cpp's qwen35 / qwen35moe graphs compute them and
transformers' Qwen3_5 / Qwen3_5Moe text models do:
- three of every four layers (`full_attention_interval`, or the per-layer
  `attention.recurrent_layers`) are Gated DeltaNet linear attention (model.delta_net): one
  projection to queries, keys and values (attn_qkv) and one to the output gate z (attn_gate),
  a causal depthwise conv over the first (ssm_conv1d, `ssm.conv_kernel` taps), per value
  head a decay exp(softplus(alpha + dt_bias) * ssm_a) (ssm_a = -exp(A_log), as the converter
  stores it) and a write strength sigmoid(beta), the gated delta rule over a recurrent state
  per head, an RMSNorm gated by silu(z) (ssm_norm) and the out projection (ssm_out);
  `ssm.group_count` key heads, `ssm.time_step_rank` value heads, each `ssm.state_size` wide,
  the value heads tiled over the key heads (the converter reorders them so: value head h
  reads key head h mod groups);
- the others full attention (model.gated_attention): the query projection carries a gate per
  head (each head's queries, then its gate: attn_q is twice n_heads * head_dim), RMSNorm on
  each query and key head, RoPE on the first `rope.dimension_count` of each head (a quarter)
  with NEOX pairing, and the output multiplied by sigmoid(gate) before attn_output.
  llama.cpp rotates with interleaved M-RoPE over `rope.dimension_sections`; for text every
  section's position is the token's, which is plain RoPE wherever the sections cover every
  rotated pair (configure refuses a file where they do not);
- the FFN normed by `post_attention_norm`, after the attention's residual add: SwiGLU
  (qwen35), or (qwen35moe) a softmax router's top `expert_used_count` experts, renormalised,
  plus a shared expert `expert_shared_feed_forward_length` wide whose output is scaled per
  token by sigmoid(ffn_gate_inp_shexp . h);
- `nextn_predict_layers` multi-token-prediction layers after the model's own, skipped.
Shapes, torch order: attn_qkv (conv_dim, hidden), conv_dim = (2 * groups + heads) * state;
attn_gate (heads * state, hidden); ssm_conv1d (conv_dim, kernel); ssm_a, ssm_dt.bias (heads,);
ssm_beta, ssm_alpha (heads, hidden); ssm_norm (state,); ssm_out (hidden, heads * state)."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import InvalidMetadata, MissingMetadata, UnsupportedArchitecture
from ...modelfile.hparams import FIX, md_float, md_int
from ..layer_spec import LayerSpec, LinearGroup, TensorSpec
from .base import BlockTraits, Family
from .experts import EXPERT_TENSORS, EXPERTS

MAX_SSM = 1 << 16
MAX_EXPERT_FFN = 1 << 20


def _heads_dim(c: Any) -> int:
    return c.n_heads * c.head_dim


def _value_dim(c: Any) -> int:
    return c.ssm_heads * c.ssm_state


def _shexp(c: Any) -> int:
    return c.shexp_ffn


_F, _R = "full_attn", "recurrent"  # which layers hold a tensor (TensorSpec.when)

QWEN35_ATTENTION: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("attn_q.weight", "weight", lambda c: (2 * _heads_dim(c), c.hidden), when=_F),
    TensorSpec("attn_k.weight", "weight", lambda c: (c.kv_dim, c.hidden), when=_F),
    TensorSpec("attn_v.weight", "weight", lambda c: (c.kv_dim, c.hidden), when=_F),
    TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, _heads_dim(c)), when=_F),
    TensorSpec("attn_q_norm.weight", "norm", lambda c: (c.head_dim,), when=_F),
    TensorSpec("attn_k_norm.weight", "norm", lambda c: (c.head_dim,), when=_F),
    TensorSpec("attn_qkv.weight", "weight", lambda c: (c.ssm_conv_dim, c.hidden), when=_R),
    TensorSpec("attn_gate.weight", "weight", lambda c: (_value_dim(c), c.hidden), when=_R),
    TensorSpec("ssm_beta.weight", "weight", lambda c: (c.ssm_heads, c.hidden), when=_R),
    TensorSpec("ssm_alpha.weight", "weight", lambda c: (c.ssm_heads, c.hidden), when=_R),
    TensorSpec("ssm_conv1d.weight", "norm", lambda c: (c.ssm_conv_dim, c.ssm_conv_kernel),
               when=_R),
    TensorSpec("ssm_a", "norm", lambda c: (c.ssm_heads,), when=_R),
    TensorSpec("ssm_dt.bias", "bias", lambda c: (c.ssm_heads,), when=_R),
    TensorSpec("ssm_norm.weight", "norm", lambda c: (c.ssm_state,), when=_R),
    TensorSpec("ssm_out.weight", "weight", lambda c: (c.hidden, _value_dim(c)), when=_R),
    TensorSpec("post_attention_norm.weight", "norm", lambda c: (c.hidden,)),
)
QWEN35_DENSE_FFN: tuple[TensorSpec, ...] = (
    TensorSpec("ffn_gate.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_up.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn)),
)
QWEN35_MOE_FFN: tuple[TensorSpec, ...] = (
    *EXPERT_TENSORS,
    TensorSpec("ffn_gate_inp_shexp.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("ffn_gate_shexp.weight", "weight", lambda c: (_shexp(c), c.hidden)),
    TensorSpec("ffn_up_shexp.weight", "weight", lambda c: (_shexp(c), c.hidden)),
    TensorSpec("ffn_down_shexp.weight", "weight", lambda c: (c.hidden, _shexp(c))),
)

_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "ssm_conv1d",
          "ssm_norm")
# (separate linears: the query projection is twice the others' heads wide, and the linear
# layers' four projections differ in format in llama.cpp's quantized mixes)
_ATTN_LINEARS: tuple[LinearGroup, ...] = tuple(
    LinearGroup(n, (n,)) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv",
                                   "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"))
_VECTORS = ("ssm_a", "ssm_dt.bias")

QWEN35_LAYER = LayerSpec(
    tensors=QWEN35_ATTENTION + QWEN35_DENSE_FFN, norms=_NORMS,
    linears=_ATTN_LINEARS + (LinearGroup("ffn_gate_up", ("ffn_gate", "ffn_up")),
                             LinearGroup("ffn_down", ("ffn_down",))),
    vectors=_VECTORS)
QWEN35MOE_LAYER = LayerSpec(
    tensors=QWEN35_ATTENTION + QWEN35_MOE_FFN, norms=_NORMS + ("ffn_gate_inp_shexp",),
    linears=_ATTN_LINEARS + (LinearGroup(EXPERTS.shared_gate_up,
                                         ("ffn_gate_shexp", "ffn_up_shexp")),
                             LinearGroup(EXPERTS.shared_down, ("ffn_down_shexp",))),
    experts=EXPERTS, vectors=_VECTORS)


def rope_sections_cover(sections: list[int], pairs: int) -> bool:
    """Whether llama.cpp's interleaved M-RoPE (ggml_mrope_cache_init, is_imrope) gives every
    one of `pairs` rotated pairs a time, height or width position: pair i falls in sector
    i mod sum(sections), a sector s goes to section s mod 3 while s < 3 * that section's
    size, else to the fourth section, whose position is 0 for text (the pair stays
    unrotated, which plain RoPE does not do)."""
    total = sum(sections)
    if total <= 0:
        return False
    for i in range(pairs):
        s = i % total
        if not s < 3 * sections[s % 3]:
            return False
    return True


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    """The linear attention's widths, which layers are linear, the RoPE sections checked,
    the multi-token-prediction layers left out, and (qwen35moe) the experts' widths."""
    def ssm(key: str) -> int:
        return md_int(md, f"{arch}.ssm.{key}", source, 1, MAX_SSM)

    kernel, state, groups, heads = (ssm("conv_kernel"), ssm("state_size"), ssm("group_count"),
                                    ssm("time_step_rank"))
    inner = ssm("inner_size")
    if inner != heads * state:
        raise InvalidMetadata(
            f"{source}: '{arch}.ssm.inner_size' {inner} is not '{arch}.ssm.time_step_rank' "
            f"{heads} x '{arch}.ssm.state_size' {state} (value heads as wide as key heads, "
            f"as llama.cpp requires); {FIX}")
    if heads % groups:
        raise InvalidMetadata(f"{source}: '{arch}.ssm.time_step_rank' {heads} (value heads) is "
                              f"not a multiple of '{arch}.ssm.group_count' {groups}; {FIX}")
    n_all = base["n_layers"]
    nextn = md_int(md, f"{arch}.nextn_predict_layers", source, 0, n_all - 1, default=0)
    n_layers = n_all - nextn
    recurrent = _recurrent_layers(md, arch, source, n_all, n_layers)
    key = f"{arch}.rope.dimension_sections"
    sections = md.get(key)
    if sections is None:
        raise MissingMetadata(f"{source}: missing required metadata {key!r}")
    if (not isinstance(sections, list) or len(sections) != 4
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 1 << 12
                       for s in sections)):
        raise InvalidMetadata(f"{source}: metadata {key!r} is {sections!r}; expected 4 "
                              f"non-negative integers; {FIX}")
    if not rope_sections_cover(sections, base["rope_dim"] // 2):
        raise UnsupportedArchitecture(
            f"{source}: {key!r} {sections} leaves some of the {base['rope_dim'] // 2} rotated "
            f"pairs to M-RoPE's fourth section, which text does not rotate; slipstream runs "
            f"Qwen3.5 files whose sections cover every pair")
    fields: dict[str, Any] = dict(
        n_layers=n_layers, nextn_layers=nextn, recurrent_layers=recurrent, attn_gate=True,
        ssm_conv_kernel=kernel, ssm_state=state, ssm_groups=groups, ssm_heads=heads)
    if arch == "qwen35moe":
        fields.update(_experts(md, arch, source, base))
    return fields


def _recurrent_layers(md: Mapping[str, Any], arch: str, source: str, n_all: int,
                      n_layers: int) -> tuple[bool, ...]:
    """Which of the model's layers are linear attention, as llama.cpp reads them: the per-layer
    `attention.recurrent_layers` where the file has it, else every layer but each
    `full_attention_interval`-th (default 4)."""
    key = f"{arch}.attention.recurrent_layers"
    if key in md:
        flags = md[key]
        if (not isinstance(flags, list) or len(flags) not in (n_layers, n_all)
                or not all(isinstance(f, (bool, int)) for f in flags)):
            raise InvalidMetadata(f"{source}: metadata {key!r} is not an array of {n_all} "
                                  f"booleans; {FIX}")
        return tuple(bool(f) for f in flags[:n_layers])
    every = md_int(md, f"{arch}.full_attention_interval", source, 1, n_all, default=4,
                   hint=f" (at most the {n_all} layers)")
    return tuple((i + 1) % every != 0 for i in range(n_layers))


def _experts(md: Mapping[str, Any], arch: str, source: str,
             base: Mapping[str, Any]) -> dict[str, Any]:
    """qwen35moe's experts: required, each `expert_feed_forward_length` wide (default the dense
    width shared among the used ones), one shared expert `expert_shared_feed_forward_length`
    wide (default the dense width, as llama.cpp defaults both), the routed weights
    renormalised and times `expert_weights_scale` where the file sets one."""
    if not base.get("n_experts"):
        raise MissingMetadata(f"{source}: missing required metadata '{arch}.expert_count' (a "
                              f"{arch} model's every layer is a mixture of experts)")
    width = md_int(md, f"{arch}.expert_feed_forward_length", source, 1, MAX_EXPERT_FFN,
                   default=max(1, base["ffn"] // base["n_experts_used"]))
    shared = md_int(md, f"{arch}.expert_shared_feed_forward_length", source, 1,
                    MAX_EXPERT_FFN, default=base["ffn"])
    scale = md_float(md, f"{arch}.expert_weights_scale", source, 0.0, 0.0, 1e6)
    return dict(expert_ffn=width, shexp_ffn=shared, n_shared_experts=1, shexp_gate=True,
                moe_norm=True, moe_scale=scale or 1.0)


_TRAITS = BlockTraits(qk_norm=True)
_CUDA = ("its linear-attention layers keep a recurrent state that only the CPU engine "
         "computes yet")

QWEN35 = Family(
    name="qwen35",
    architectures={"qwen35": "neox"},
    layer=QWEN35_LAYER,
    traits=_TRAITS,
    configure=configure,
    quirks="3 of 4 layers Gated DeltaNet linear attention (conv and recurrent state); the "
           "others gated full attention with q/k norms and RoPE on a quarter of each head",
    cuda_refused=_CUDA,
)

QWEN35MOE = Family(
    name="qwen35moe",
    architectures={"qwen35moe": "neox"},
    layer=QWEN35MOE_LAYER,
    moe_layer=QWEN35MOE_LAYER,
    traits=_TRAITS,
    configure=configure,
    ffn_optional=True,
    quirks="Qwen3.5's linear and gated attention; a mixture of experts with a "
           "sigmoid-gated shared expert in every layer",
    cuda_refused=_CUDA,
)
