"""DeepSeek-V2, V2.5, V3, R1 and Kimi K2 (llama.cpp's `deepseek2`), as its deepseek2 graph
computes them and transformers' DeepseekV3 (V2: DeepseekV2) model does:
- multi-head latent attention (model.mla): queries through a latent `attention.q_lora_rank`
  wide (V2-Lite: one projection, attn_q), keys and values from a latent
  `attention.kv_lora_rank` wide plus one shared rotated key part `rope.dimension_count`
  wide; the heads' key width `attention.key_length_mla` (its unrotated part and the rotated
  one: 192) and value width `attention.value_length_mla` (128); the file's key_length and
  value_length are the cache's (kv_lora + rope and kv_lora: 576 and 512), head_count_kv 1.
  Files whose attn_kv_b is not split into attn_k_b and attn_v_b (converted before llama.cpp
  did so) are refused: convert again;
- NORMAL RoPE pairing (adjacent dimensions: the checkpoints' interleaved rope), YaRN with the
  attention scale llama.cpp applies: RoPE's own factor 1, and 1 / sqrt(key_length_mla) times
  mscale^2, mscale = 1 + 0.1 * mscale_all_dim * ln(factor) (the file's yarn_log_multiplier is
  0.1 * mscale_all_dim, as llama.cpp's converter writes it);
- the first `leading_dense_block_count` layers dense (V3: 3), the others a mixture of experts
  with shared experts (families.routed): softmax routing (V2, llama.cpp's default where the
  file names none; sigmoid for GLM-4.7-Flash's early files, as llama.cpp guesses) or sigmoid
  with the selection bias (V3, R1, K2), groups, renormalised
  weights scaled by `expert_weights_scale`. Groups are scored as llama.cpp scores them (the
  sum of the two best), which V3's noaux_tc does and V2's group_limited_greedy (the best
  one) does not."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ...errors import InvalidMetadata, UnsupportedArchitecture
from ...modelfile.hparams import FIX, md_float, md_int
from ..layer_spec import LayerSpec, LinearGroup, TensorSpec
from .base import Family
from .experts import EXPERTS
from .routed import (DENSE_FFN, FFN_LINEARS, OPTIONAL_SELECTION_BIAS, ROUTED,
                     routed_fields)

MAX_RANK = 1 << 16


def _nope(c: Any) -> int:
    return c.mla_k_head - c.rope_dim


DEEPSEEK2_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
    TensorSpec("attn_q_a.weight", "weight", lambda c: (c.q_lora_rank, c.hidden),
               when="q_lora_rank"),
    TensorSpec("attn_q_a_norm.weight", "norm", lambda c: (c.q_lora_rank,), when="q_lora_rank"),
    TensorSpec("attn_q_b.weight", "weight",
               lambda c: (c.n_heads * c.mla_k_head, c.q_lora_rank), when="q_lora_rank"),
    TensorSpec("attn_q.weight", "weight", lambda c: (c.n_heads * c.mla_k_head, c.hidden),
               when="q_full"),
    TensorSpec("attn_kv_a_mqa.weight", "weight",
               lambda c: (c.kv_lora_rank + c.rope_dim, c.hidden)),
    TensorSpec("attn_kv_a_norm.weight", "norm", lambda c: (c.kv_lora_rank,)),
    TensorSpec("attn_k_b.weight", "weight", lambda c: (c.n_heads, c.kv_lora_rank, _nope(c))),
    TensorSpec("attn_v_b.weight", "weight",
               lambda c: (c.n_heads, c.mla_v_head, c.kv_lora_rank)),
    TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, c.n_heads * c.mla_v_head)),
    TensorSpec("ffn_norm.weight", "norm", lambda c: (c.hidden,)),
    *DENSE_FFN,
    *ROUTED,
    OPTIONAL_SELECTION_BIAS,
)

DEEPSEEK2_LAYER = LayerSpec(
    tensors=DEEPSEEK2_TENSORS,
    # (attn_k_b and attn_v_b are read whole as float32, as the norms are: model.mla
    # multiplies them per head, not as linears)
    norms=("attn_norm", "attn_q_a_norm", "attn_kv_a_norm", "attn_k_b", "attn_v_b",
           "ffn_norm"),
    linears=(LinearGroup("attn_q_a", ("attn_q_a",)), LinearGroup("attn_q_b", ("attn_q_b",)),
             LinearGroup("attn_q", ("attn_q",)),
             LinearGroup("attn_kv_a_mqa", ("attn_kv_a_mqa",)),
             LinearGroup("attn_output", ("attn_output",))) + FFN_LINEARS,
    experts=EXPERTS)


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    """The latent attention's widths (checked against the cache's key_length and
    value_length), the attention scale, and the experts' pieces (families.routed)."""
    lora = md_int(md, f"{arch}.attention.kv_lora_rank", source, 1, MAX_RANK)
    q_lora = md_int(md, f"{arch}.attention.q_lora_rank", source, 0, MAX_RANK, default=0)
    rope = base["rope_dim"]
    k_head = md_int(md, f"{arch}.attention.key_length_mla", source, rope + 1, 1 << 12)
    v_head = md_int(md, f"{arch}.attention.value_length_mla", source, 1, 1 << 12)
    value = md_int(md, f"{arch}.attention.value_length", source, 1, 1 << 16)
    if base["head_dim"] != lora + rope or value != lora:
        raise InvalidMetadata(
            f"{source}: '{arch}.attention.key_length' {base['head_dim']} and "
            f"'{arch}.attention.value_length' {value} are not the latent cache's "
            f"kv_lora_rank + rope dimensions {lora + rope} and kv_lora_rank {lora}; {FIX}")
    temp = md.get(f"{arch}.attention.temperature_scale")
    if temp:  # (llama.cpp multiplies the latent queries by Llama 4's temperature)
        raise UnsupportedArchitecture(
            f"{source}: '{arch}.attention.temperature_scale' is {temp} (Mistral Large 3's "
            f"query temperature over latent attention), which slipstream does not run yet")
    if base["n_kv_heads"] != 1:
        raise InvalidMetadata(f"{source}: '{arch}.attention.head_count_kv' is "
                              f"{base['n_kv_heads']}; a latent cache is one head; {FIX}")
    fields = dict(q_lora_rank=q_lora, kv_lora_rank=lora, mla_k_head=k_head, mla_v_head=v_head,
                  attn_scale=1.0 / math.sqrt(k_head),
                  **routed_fields(md, arch, source, base, gating=_default_gating(md, arch, base)))
    if base["rope_scaling"] == "yarn":
        # llama.cpp's deepseek2 graph: RoPE unscaled where the file gives mscale_all_dim
        # (yarn_log_multiplier / 0.1), and the scores scaled by mscale^2
        factor = base["rope_scale"]
        log_mul = md_float(md, f"{arch}.rope.scaling.yarn_log_multiplier", source, 0.0, 0.0,
                           100.0)
        mscale = 1.0 + 0.1 * (log_mul / 0.1 if log_mul else 1.0) * math.log(factor)
        fields.update(rope_attn_factor=1.0 if log_mul else mscale,
                      attn_scale=mscale * mscale / math.sqrt(k_head))
    return fields


def _default_gating(md: Mapping[str, Any], arch: str, base: Mapping[str, Any]) -> str:
    """The routing of a file that names none (`expert_gating_func`), as llama.cpp guesses
    it: sigmoid for GLM-4.7-Flash's early files (47 or 48 layers run, a 154880-token
    vocabulary), softmax for DeepSeek-V2 and V2.5's."""
    nextn = md.get(f"{arch}.nextn_predict_layers", 0)
    layers = base["n_layers"] - (nextn if isinstance(nextn, int) else 0)
    return "sigmoid" if layers in (47, 48) and base["vocab_size"] == 154880 else "softmax"


def check_names(cfg: Any, names: Any, source: str) -> None:
    """Files with the older unsplit attn_kv_b are refused by name."""
    if "blk.0.attn_kv_b.weight" in names:
        raise UnsupportedArchitecture(
            f"{source}: 'blk.0.attn_kv_b.weight' is the older layout of the latent's key and "
            f"value projections; slipstream reads them split into attn_k_b and attn_v_b, as "
            f"current llama.cpp conversions write them: convert the model again")


DEEPSEEK2 = Family(
    name="deepseek2",
    architectures={"deepseek2": "normal"},
    layer=DEEPSEEK2_LAYER,
    moe_layer=DEEPSEEK2_LAYER,
    configure=configure,
    check_names=check_names,
    latent_kv=True,
    quirks="multi-head latent attention (the latent cached), YaRN's mscale on the scores, "
           "dense first layers, softmax (V2) or sigmoid-with-bias (V3) routing, groups, a "
           "scale, shared experts",
    cuda_refused="built and tested on the CPU; its CUDA path has not run",
)
