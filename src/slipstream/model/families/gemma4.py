"""Gemma 4, the dense models (E2B, E4B, 31B) and the 26B-A4B mixture of experts:
Gemma 3's block (query/key norms per head,
post-attention and post-FFN norms, GeGLU, embeddings times sqrt(hidden)) with
- sliding-window and global layers in a per-layer pattern (`attention.sliding_window_pattern`,
  an array of bools, the last layer global) whose heads differ: the sliding layers' head size
  is `attention.key_length_swa` (256), the global layers' `attention.key_length` (512), and
  the key/value head count may be a per-layer array too (the 31B's global layers: 4);
- RoPE base `rope.freq_base_swa` (10000) on the sliding layers over `rope.dimension_count_swa`
  dimensions; on the global layers base `rope.freq_base` (1e6) over the whole head with
  llama.cpp's `rope_freqs.weight` divisors, 1e30 past the first quarter of the frequencies
  (transformers' "proportional" RoPE with partial_rotary_factor 0.25: those pairs turn by 0);
- an RMSNorm without weight over each value head, and a query scale of 1 (the norms keep
  q.k in range instead);
- the 31B's (and the 26B-A4B's) global layers have no attn_v: their values are the key
  projection (before its norm, then the value norm), as transformers' attention_k_eq_v and
  llama.cpp's gemma4 graph (Vcur = Kcur where wv is absent) compute them: such a layer's
  fused q/k/v linear reads attn_k's weight again for its value rows (LayerSpec.reads_as);
- E2B and E4B: the last `attention.shared_kv_layers` layers compute no keys or values of
  their own and attend to those of the last earlier layer of their kind (ModelConfig.kv_source);
  FFN sizes per layer (`feed_forward_length` array: the shared layers' doubled);
- E2B and E4B: per-layer embeddings (`embedding_length_per_layer_input`, 256): a second token
  table of n_layers x 256 per token, mixed with a projection of the embedding, gives each
  layer an input that gates a small residual branch after its FFN (model.per_layer);
- each layer's output times its `layer_output_scale` (one number per layer);
- the logits soft-capped: c * tanh(logits / c), c = `final_logit_softcapping` (30).
The norms are plain RMSNorms (Gemma 4's weights are stored as they multiply, not as w - 1).
NEOX RoPE pairing; the head is the token embedding (tied).

The 26B-A4B (`expert_count` > 0) adds a mixture of experts to every layer beside the dense
GeGLU MLP, as llama.cpp's gemma4 graph and transformers' Gemma4TextDecoderLayer compute it
(model.moe's module doc has the formulas): the MLP on ffn_norm(x), normed by
post_ffw_norm_1; the router on x's unit RMSNorm over sqrt(hidden) times ffn_gate_inp.scale,
softmax, the top `expert_used_count` renormalised and times each expert's
ffn_down_exps.scale (transformers' per_expert_scale); the experts (GeGLU,
`expert_feed_forward_length` wide) on pre_ffw_norm_2(x), their sum normed by
post_ffw_norm_2; the two added, then post_ffw_norm and the residual as the dense layer's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ...errors import InvalidMetadata, UnsupportedArchitecture
from ...modelfile.hparams import FIX, md_float, md_int, md_ints
from ..layer_spec import ExpertSpec, LayerSpec, LinearGroup, TensorSpec
from .base import BlockTraits, Family
from .experts import EXPERT_TENSORS
from .gemma3 import POST_NORMS
from .llama import LLAMA_LINEARS, q_dim

PER_LAYER_TOKEN_EMBD = "per_layer_token_embd.weight"  # (vocab, n_layers * per_layer_dim)
PER_LAYER_MODEL_PROJ = "per_layer_model_proj.weight"  # (n_layers * per_layer_dim, hidden)
PER_LAYER_PROJ_NORM = "per_layer_proj_norm.weight"  # (per_layer_dim,)
ROPE_FREQS = "rope_freqs.weight"  # the global layers' divisors ("proportional" RoPE)
# the mixture of experts' pieces (model.moe): the dense MLP is its shared expert
GEMMA4_EXPERTS = ExpertSpec(shared_gate_up="ffn_gate_up", shared_down="ffn_down")

GEMMA4_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("attn_q.weight", "weight", lambda c: (q_dim(c), c.hidden)),
    TensorSpec("attn_k.weight", "weight", lambda c: (c.kv_dim, c.hidden), when="computes_kv"),
    TensorSpec("attn_v.weight", "weight", lambda c: (c.kv_dim, c.hidden), when="computes_kv"),
    TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, q_dim(c))),
    TensorSpec("attn_q_norm.weight", "norm", lambda c: (c.head_dim,)),
    TensorSpec("attn_k_norm.weight", "norm", lambda c: (c.head_dim,), when="computes_kv"),
    *POST_NORMS[:1],
    TensorSpec("ffn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("ffn_gate.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_up.weight", "weight", lambda c: (c.ffn, c.hidden)),
    TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn)),
    *POST_NORMS[1:],
    # the per-layer embedding's branch (model.per_layer)
    TensorSpec("inp_gate.weight", "weight", lambda c: (c.per_layer_dim, c.hidden),
               when="per_layer_dim"),
    TensorSpec("proj.weight", "weight", lambda c: (c.hidden, c.per_layer_dim),
               when="per_layer_dim"),
    TensorSpec("post_norm.weight", "norm", lambda c: (c.hidden,), when="per_layer_dim"),
    TensorSpec("layer_output_scale.weight", "norm", lambda c: (1,), flag="layer_scale"),
)


def _moe_tensors() -> tuple[TensorSpec, ...]:
    """The 26B-A4B's tensors beside the dense layer's, after ffn_down: the router and its
    input scale, the experts' norms and the MLP's output norm, the experts (gate and up apart
    or as one tensor), and each expert's scale (llama.cpp reads it where present)."""
    e = GEMMA4_EXPERTS
    return (
        EXPERT_TENSORS[0],  # the router, (n_experts, hidden)
        TensorSpec(e.router_scale, "norm", lambda c: (c.hidden,)),
        TensorSpec(f"{e.expert_norm}.weight", "norm", lambda c: (c.hidden,)),
        TensorSpec(f"{e.shared_post_norm}.weight", "norm", lambda c: (c.hidden,)),
        TensorSpec(f"{e.expert_post_norm}.weight", "norm", lambda c: (c.hidden,)),
        *EXPERT_TENSORS[1:],
        TensorSpec(e.expert_scale, "norm", lambda c: (c.n_experts,), flag="expert_scale"),
    )


def _with_moe(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    cut = [t.suffix for t in tensors].index("ffn_down.weight") + 1
    return tensors[:cut] + _moe_tensors() + tensors[cut:]


def extra_tensors(cfg: Any) -> tuple[str, ...]:
    ple = (PER_LAYER_TOKEN_EMBD, PER_LAYER_MODEL_PROJ, PER_LAYER_PROJ_NORM)
    return (ROPE_FREQS, *ple) if cfg.per_layer_dim else (ROPE_FREQS,)


def _swa_layers(md: Mapping[str, Any], arch: str, source: str, n_layers: int
                ) -> tuple[bool, ...]:
    key = f"{arch}.attention.sliding_window_pattern"
    v = md.get(key)
    if not isinstance(v, list) or len(v) != n_layers or not all(
            isinstance(b, (bool, int)) for b in v):
        shown = v if not isinstance(v, list) or len(v) <= 8 else [*v[:8], "..."]
        raise InvalidMetadata(f"{source}: metadata {key!r} is {shown!r}; Gemma 4 files hold "
                              f"one bool per layer ({n_layers}), true for a sliding-window "
                              f"layer; {FIX}")
    return tuple(bool(b) for b in v)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    def key(k: str) -> str:
        return f"{arch}.{k}"

    n, hidden, ctx = base["n_layers"], base["hidden"], base["context_length"]
    swa = _swa_layers(md, arch, source, n)
    if swa[-1]:
        raise InvalidMetadata(f"{source}: the last layer of a Gemma 4 model is global, but "
                              f"{key('attention.sliding_window_pattern')} marks it sliding; "
                              f"{FIX}")
    window = md_int(md, key("attention.sliding_window"), source, 1, ctx)
    head_swa = md_int(md, key("attention.key_length_swa"), source, 1, 1 << 12)
    value_swa = md_int(md, key("attention.value_length_swa"), source, 1, 1 << 12,
                       default=head_swa)
    if value_swa != head_swa:
        raise UnsupportedArchitecture(
            f"{source}: {key('attention.value_length_swa')} {value_swa} differs from "
            f"{key('attention.key_length_swa')} {head_swa}; Gemma 4's sliding layers have "
            f"equal key and value head sizes")
    rope_swa = md_int(md, key("rope.dimension_count_swa"), source, 2, head_swa,
                      default=head_swa, hint=f" (at most the head size {head_swa})")
    if rope_swa % 2:
        raise InvalidMetadata(f"{source}: metadata {key('rope.dimension_count_swa')!r} is "
                              f"{rope_swa}; RoPE rotates pairs of dimensions; {FIX}")
    kv_heads = md_ints(md, key("attention.head_count_kv"), source, 1, 1 << 12, n,
                       default=base["n_kv_heads"])
    ffns = md_ints(md, key("feed_forward_length"), source, 1, 1 << 20, n)
    bad = [h for h in kv_heads if base["n_heads"] % h]
    if bad:
        raise InvalidMetadata(f"{source}: {key('attention.head_count_kv')} holds {bad[0]}, "
                              f"which does not divide the {base['n_heads']} query heads; {FIX}")
    global_kv = kv_heads[swa.index(False)]
    shared = md_int(md, key("attention.shared_kv_layers"), source, 0, n - 1, default=0)
    kv_layers = n - shared if shared else 0
    if shared:
        _check_kv_sources(swa, kv_layers, source)
    return dict(
        embed_scale=math.sqrt(hidden), sliding_window=window, swa_pattern=0,
        swa_layers=swa, head_dim_swa=head_swa, rope_dim_swa=rope_swa,
        rope_base_local=md_float(md, key("rope.freq_base_swa"), source, base["rope_base"],
                                 1.0, 1e30),
        n_kv_heads=global_kv,
        kv_heads_per_layer=kv_heads if len(set(kv_heads)) > 1 else (),
        ffn_per_layer=ffns if len(set(ffns)) > 1 else (),
        kv_layers=kv_layers,
        per_layer_dim=md_int(md, key("embedding_length_per_layer_input"), source, 0, 1 << 16,
                             default=0),
        final_softcap=md_float(md, key("final_logit_softcapping"), source, 0.0, 0.0, 1e6),
        attn_scale=1.0, **_moe_fields(md, arch, source, base))


def _moe_fields(md: Mapping[str, Any], arch: str, source: str,
                base: Mapping[str, Any]) -> dict[str, Any]:
    """The 26B-A4B's expert width (`expert_feed_forward_length`, one number or one per layer,
    equal: slipstream's experts are one width per model), softmax routing renormalised, as
    llama.cpp's gemma4 graph routes; nothing for a dense file."""
    if not base.get("n_experts"):
        return {}
    widths = set(md_ints(md, f"{arch}.expert_feed_forward_length", source, 1, 1 << 20,
                         base["n_layers"]))
    if len(widths) != 1:
        raise UnsupportedArchitecture(
            f"{source}: '{arch}.expert_feed_forward_length' holds {sorted(widths)}; "
            f"slipstream runs experts of one width in every layer")
    return dict(expert_ffn=widths.pop(), moe_gating="softmax", moe_norm=True)


def _check_kv_sources(swa: tuple[bool, ...], kv_layers: int, source: str) -> None:
    """The layers that reuse keys and values read, in llama.cpp, layer kv_layers - 2 (sliding)
    or kv_layers - 1 (global), and in transformers the last earlier layer of their kind: the
    same layers in every Gemma 4 file, which this checks."""
    if kv_layers < 2 or swa[kv_layers - 1] or not swa[kv_layers - 2]:
        raise UnsupportedArchitecture(
            f"{source}: the layers from {kv_layers} on reuse the keys and values of layers "
            f"{kv_layers - 2} (sliding) and {kv_layers - 1} (global), but those are not a "
            f"sliding and a global layer; slipstream runs Gemma 4's layouts where they are")


GEMMA4_LAYER = LayerSpec(
    tensors=GEMMA4_TENSORS,
    norms=("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm",
           "post_ffw_norm", "post_norm", "layer_output_scale"),
    linears=LLAMA_LINEARS + (LinearGroup("inp_gate", ("inp_gate",)),
                             LinearGroup("proj", ("proj",))),
    reads_as=(("v_from_k", "attn_v", "attn_k"),))

GEMMA4 = Family(
    name="gemma4",
    architectures={"gemma4": "neox"},
    layer=GEMMA4_LAYER,
    moe_layer=dataclasses.replace(GEMMA4_LAYER, tensors=_with_moe(GEMMA4_TENSORS),
                                  experts=GEMMA4_EXPERTS),
    traits=BlockTraits(qk_norm=True, post_norms=True, ffn_act="gelu_tanh", v_norm=True),
    configure=configure,
    # its CUDA tests (tests/gpu/test_families_gpu.py) failed on an H100: refused until they pass
    # its CUDA logits differed from the CPU's by up to 7e-2 at "exact" on an H100, about what
    # a float16 KV cache alone does on the CPU (5.8e-2; Precision.of now keeps it float32
    # there); the streamed and "fast" tests' failures are not yet read
    cuda_refused="its CUDA path has not yet matched the CPU engine's logits on a GPU",
    quirks="Gemma 3's block with wider global heads, proportional RoPE, value norms, "
           "per-layer embeddings, layers sharing keys and values, soft-capped logits; "
           "26B-A4B: experts beside the dense MLP, each branch normed on its own",
    varied_layers=True,
    extra_tensors=extra_tensors,
    values_from_keys=True,
)
