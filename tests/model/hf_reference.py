"""transformers models of the families its GGUF reader does not load as slipstream reads them
(Phi-3's LongRoPE factors and partial rotary; Ministral 3, OLMo 2, GLM-4, Cohere 2, gpt-oss,
GLM-4.5, DeepSeek-V3 and Mixtral, a `llama` file with experts, which it does not read at all): the model class built
from a config written out of the file's ModelConfig, and the file's tensors dequantized to
float32 by gguf-py and loaded under transformers' names. Nothing of slipstream's block math is used.

Each builder imports its transformers classes itself: the test modules skip without
transformers (pytest.importorskip) before calling one."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile


def gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized by gguf-py (float32, torch order)."""
    out = {}
    for t in GGUFReader(path).tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = torch.from_numpy(a.reshape([int(d) for d in reversed(t.shape)]).copy())
    return out


LLAMA_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _layer_names(cfg: ModelConfig, per_layer: dict[str, str], top: dict[str, str]
                 ) -> dict[str, str]:
    names = dict(top)
    for i in range(cfg.n_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in per_layer.items()})
    return names


def _sizes(cfg: ModelConfig, **fields) -> dict:
    """The config fields every builder takes from the file alike (its sizes, untied head, no
    special tokens), with `fields` added or overriding."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
            "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": None,
            "eos_token_id": None, **fields}


def _stack_gate_up(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Each expert layer's gate and up as transformers holds them: one gate_up_proj,
    (n_experts, 2 * width, hidden), gate rows first."""
    for i in range(cfg.dense_lead, cfg.n_layers):
        tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat(
            (tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]),
            dim=1)


# the sigmoid-routed experts with their selection bias and shared expert (GLM-4.5, DeepSeek-V3)
SHARED_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def _phi3(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": cfg.rope_base,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim}
    if cfg.rope_ctx_orig:
        # (transformers derives the attention factor from the two contexts itself)
        rope.update(rope_type="longrope", original_max_position_embeddings=cfg.rope_ctx_orig,
                    short_factor=tensors["rope_factors_short.weight"].tolist(),
                    long_factor=tensors["rope_factors_long.weight"].tolist())
    config = Phi3Config(**_sizes(
        cfg, original_max_position_embeddings=cfg.rope_ctx_orig or cfg.context_length,
        rope_parameters=rope, sliding_window=cfg.sliding_window or None))
    names = _layer_names(cfg, {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }, TOP_NAMES)
    return Phi3ForCausalLM(config), names


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q or K rows back from llama.cpp's converter order (each head's rotation pairs adjacent,
    for NORMAL RoPE) to the checkpoint's (pairs half a head apart, for rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1)


def unpermute_qk(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    for i in range(cfg.n_layers):
        for name, heads in (("attn_q.weight", cfg.n_heads), ("attn_k.weight", cfg.n_kv_heads)):
            tensors[f"blk.{i}.{name}"] = unpermute(tensors[f"blk.{i}.{name}"], heads)


def _mistral3(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    unpermute_qk(cfg, tensors)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base,
            "llama_4_scaling_beta": cfg.attn_temp_scale,
            "original_max_position_embeddings": cfg.attn_temp_floor or cfg.context_length}
    if cfg.rope_scaling == "yarn":  # Ministral 3's: mscale and mscale_all_dim 1
        rope.update(rope_type="yarn", factor=cfg.rope_scale, beta_fast=cfg.yarn_beta_fast,
                    beta_slow=cfg.yarn_beta_slow, mscale=1.0, mscale_all_dim=1.0,
                    original_max_position_embeddings=cfg.rope_ctx_orig)
    config = Ministral3Config(**_sizes(cfg, head_dim=cfg.head_dim, rope_parameters=rope))
    return Ministral3ForCausalLM(config), _layer_names(cfg, LLAMA_NAMES, TOP_NAMES)


def _olmo2(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(**_sizes(cfg, rope_parameters={"rope_type": "default",
                                                        "rope_theta": cfg.rope_base}))
    names = {k: v for k, v in LLAMA_NAMES.items() if k not in ("attn_norm.weight",
                                                               "ffn_norm.weight")}
    names.update({"attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
    return Olmo2ForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


def _glm4(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Glm4Config, Glm4ForCausalLM

    config = Glm4Config(**_sizes(
        cfg, head_dim=cfg.head_dim, attention_bias=True, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim}))
    names = {k: v for k, v in LLAMA_NAMES.items() if k != "ffn_gate.weight"}
    names.update({"ffn_up.weight": "mlp.gate_up_proj.weight",
                  "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                  "attn_v.bias": "self_attn.v_proj.bias",
                  "post_attention_norm.weight": "post_self_attn_layernorm.weight",
                  "post_ffw_norm.weight": "post_mlp_layernorm.weight"})
    return Glm4ForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


def _cohere2(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Cohere2Config, Cohere2ForCausalLM

    sizes = _sizes(cfg, head_dim=cfg.head_dim, layer_norm_eps=cfg.norm_eps,
                   logit_scale=cfg.logit_scale, sliding_window=cfg.sliding_window,
                   sliding_window_pattern=cfg.swa_pattern, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base})
    del sizes["rms_norm_eps"]  # a LayerNorm model
    config = Cohere2Config(**sizes)
    names = {k: v for k, v in LLAMA_NAMES.items()
             if k not in ("ffn_norm.weight", "output.weight")}
    top = {k: v for k, v in TOP_NAMES.items() if k != "output.weight"}
    return Cohere2ForCausalLM(config), _layer_names(cfg, names, top)


def _mixtral(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """Mixtral: the experts' gate and up stacked as transformers holds them (gate_up_proj,
    (n_experts, 2 * ffn, hidden), gate rows first), the router as mlp.gate."""
    from transformers import MixtralConfig, MixtralForCausalLM

    unpermute_qk(cfg, tensors)
    _stack_gate_up(cfg, tensors)
    config = MixtralConfig(**_sizes(
        cfg, intermediate_size=cfg.expert_ffn, head_dim=cfg.head_dim,
        num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_used,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        sliding_window=None))
    names = {k: v for k, v in LLAMA_NAMES.items() if not k.startswith("ffn_")
             or k == "ffn_norm.weight"}
    names.update({"ffn_gate_inp.weight": "mlp.gate.weight",
                  "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
                  "ffn_down_exps.weight": "mlp.experts.down_proj"})
    return MixtralForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(..., ffn) gate and up -> (..., 2 * ffn) with gate at the even columns and up at the
    odd ones, as transformers' GptOssExperts holds gate_up_proj (llama.cpp's converter splits
    the two apart)."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _gptoss(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """gpt-oss, built here because transformers' GGUF reader fails on the file: it reads the
    first part of each `gpt-oss.rope.scaling.*` field (the key's length) as its value, and it
    looks for experts named `ffn_*_projs`, not llama.cpp's `ffn_*_exps`.

    The experts as transformers holds them, (n_experts, in, out), gate and up
    interleaved; the router with its bias; the sinks; eager attention (the implementation
    that takes the sinks). YaRN with truncate=True: llama.cpp floors and ceils the ramp's
    ends (ggml_rope_yarn_corr_dims), as transformers does unless told otherwise; the released
    gpt-oss config says truncate=False, where llama.cpp and transformers differ."""
    from transformers import GptOssConfig, GptOssForCausalLM

    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        gate, up = tensors[f"{p}.ffn_gate_exps.weight"], tensors[f"{p}.ffn_up_exps.weight"]
        tensors[f"{p}.gate_up_proj"] = _interleave(gate.transpose(1, 2), up.transpose(1, 2))
        tensors[f"{p}.gate_up_proj_bias"] = _interleave(tensors[f"{p}.ffn_gate_exps.bias"],
                                                        tensors[f"{p}.ffn_up_exps.bias"])
        tensors[f"{p}.down_proj"] = tensors[f"{p}.ffn_down_exps.weight"].transpose(1, 2)
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_base, "factor": cfg.rope_scale,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
            "truncate": True, "original_max_position_embeddings": cfg.rope_ctx_orig}
    config = GptOssConfig(**_sizes(
        cfg, intermediate_size=cfg.expert_ffn, head_dim=cfg.head_dim,
        # (the YaRN context, so that transformers finds the factor it is given)
        max_position_embeddings=int(cfg.rope_ctx_orig * cfg.rope_scale),
        num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_used,
        sliding_window=cfg.sliding_window, rope_parameters=rope))
    config._attn_implementation = "eager"
    names = {k: v for k, v in LLAMA_NAMES.items() if not k.startswith("ffn_")}
    names.update({f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"})
    names.update({"attn_output.bias": "self_attn.o_proj.bias",
                  "attn_sinks.weight": "self_attn.sinks",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "ffn_gate_inp.weight": "mlp.router.weight",
                  "ffn_gate_inp.bias": "mlp.router.bias",
                  "gate_up_proj": "mlp.experts.gate_up_proj",
                  "gate_up_proj_bias": "mlp.experts.gate_up_proj_bias",
                  "down_proj": "mlp.experts.down_proj",
                  "ffn_down_exps.bias": "mlp.experts.down_proj_bias"})
    return GptOssForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


BUILDERS: dict[str, Callable] = {"phi3": _phi3, "mistral3": _mistral3, "olmo2": _olmo2,
                                 "glm4": _glm4, "cohere2": _cohere2, "mixtral": _mixtral,
                                 "gpt-oss": _gptoss}


def reference_model(path: Path, cfg: ModelConfig) -> torch.nn.Module:
    """The transformers model of `path` (a family in BUILDERS, or a `llama` file with experts:
    Mixtral), float32, in eval mode."""
    tensors = gguf_tensors(path)
    key = "mixtral" if cfg.architecture == "llama" and cfg.n_experts else cfg.architecture
    model, names = BUILDERS[key](cfg, tensors)
    state = {names[n]: t for n, t in tensors.items() if n in names}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings and "lm_head.weight" in missing:
        model.lm_head.weight = model.model.embed_tokens.weight  # the head is the embedding
        missing.remove("lm_head.weight")
    # rotary buffers are the model's own; every weight must come from the file
    assert not [m for m in missing if "rotary" not in m], missing
    assert not unexpected, unexpected
    return model.float().eval()


def _gemma4(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    # the global layers' turning pairs: the rope_freqs divisors of 1 (llama.cpp's converter
    # writes 1e30 for the pairs "proportional" RoPE holds still)
    turning = int((tensors["rope_freqs.weight"] < 2).sum())
    kv_layers = cfg.kv_layers or cfg.n_layers
    config = Gemma4TextConfig(**_sizes(
        cfg, intermediate_size=cfg.ffn_per_layer[0] if cfg.ffn_per_layer else cfg.ffn,
        head_dim=cfg.head_dim_swa,
        global_head_dim=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
            "full_attention": {"rope_type": "proportional", "rope_theta": cfg.rope_base,
                               "partial_rotary_factor": 2 * turning / cfg.head_dim}},
        sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention" if s else "full_attention" for s in cfg.swa_layers],
        final_logit_softcapping=cfg.final_softcap or None,
        vocab_size_per_layer_input=cfg.vocab_size,
        hidden_size_per_layer_input=cfg.per_layer_dim,
        num_kv_shared_layers=cfg.n_layers - kv_layers,
        use_double_wide_mlp=bool(cfg.ffn_per_layer),
        # (transformers takes every global layer's values from its keys where this is on)
        attention_k_eq_v=bool(cfg.v_from_k_layers),
        tie_word_embeddings=True, **_gemma4_experts(cfg, tensors)))
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "inp_gate.weight": "per_layer_input_gate.weight",
        "proj.weight": "per_layer_projection.weight",
        "post_norm.weight": "post_per_layer_input_norm.weight",
        "layer_output_scale.weight": "layer_scalar",
    }
    if cfg.n_experts:  # the 26B-A4B's router, experts and their norms
        per_layer.update({
            "ffn_gate_inp.weight": "router.proj.weight",
            "ffn_gate_inp.scale": "router.scale",
            "ffn_down_exps.scale": "router.per_expert_scale",
            "ffn_gate_up_exps.weight": "experts.gate_up_proj",
            "ffn_down_exps.weight": "experts.down_proj",
            "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
            "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
            "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"})
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
           "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
           "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
    return Gemma4ForCausalLM(config), _layer_names(cfg, per_layer, top)


BUILDERS["gemma4"] = _gemma4


def _gemma4_experts(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict:
    """Gemma4TextConfig's mixture-of-experts fields of the file (none for a dense one), and
    the experts' gate and up joined into transformers' gate_up_proj where the file keeps them
    apart (each expert's gate rows, then its up rows, as its forward chunks them)."""
    if not cfg.n_experts:
        return {}
    for i in range(cfg.n_layers):
        gate = tensors.pop(f"blk.{i}.ffn_gate_exps.weight", None)
        if gate is not None:
            up = tensors.pop(f"blk.{i}.ffn_up_exps.weight")
            tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat([gate, up], dim=1)
    return dict(enable_moe_block=True, num_experts=cfg.n_experts,
                top_k_experts=cfg.n_experts_used, moe_intermediate_size=cfg.expert_ffn)


def _glm4moe(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """GLM-4.5 (Glm4MoeForCausalLM): the experts' gate and up stacked as transformers holds
    them (gate_up_proj, (n_experts, 2 * width, hidden), gate rows first), the router as
    mlp.gate with the selection bias as its e_score_correction_bias, the shared expert as
    mlp.shared_experts, the first layer's dense FFN as mlp; the file's multi-token-prediction
    layer left out (transformers' model does not run it either). The rows are the
    checkpoint's: llama.cpp's converter does not permute GLM-4.5's queries and keys."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    _stack_gate_up(cfg, tensors)
    config = Glm4MoeConfig(**_sizes(
        cfg, head_dim=cfg.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim},
        attention_bias=cfg.attn_bias, use_qk_norm=cfg.qk_norm,
        moe_intermediate_size=cfg.expert_ffn, num_experts_per_tok=cfg.n_experts_used,
        n_routed_experts=cfg.n_experts, n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.moe_scale, n_group=max(cfg.expert_groups, 1),
        topk_group=max(cfg.expert_groups_used, 1), first_k_dense_replace=cfg.dense_lead,
        norm_topk_prob=cfg.moe_norm))
    names = {k: v for k, v in LLAMA_NAMES.items() if k != "ffn_norm.weight"}
    names.update({f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"})
    names.update({"attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  **SHARED_EXPERT_NAMES})
    return Glm4MoeForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


BUILDERS["glm4moe"] = _glm4moe


def _deepseek2(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """DeepSeek-V3 (DeepseekV3ForCausalLM), from a file llama.cpp's converter wrote: the
    latent's key and value projections joined back into kv_b_proj (per head, the key rows
    (the transposed attn_k_b) then the value rows (attn_v_b)); the rotated rows as the
    checkpoint interleaves them (rope_interleave, llama.cpp's NORM pairing); YaRN with
    mscale = mscale_all_dim = 1 (DeepSeek-V3's, and what the file's yarn_log_multiplier 0.1
    says) and truncate, as llama.cpp floors and ceils the ramp's ends; the routing and the
    shared expert as GLM-4.5's (_glm4moe)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    nope = cfg.mla_k_head - cfg.rope_dim
    for i in range(cfg.n_layers):
        k_b, v_b = tensors[f"blk.{i}.attn_k_b.weight"], tensors[f"blk.{i}.attn_v_b.weight"]
        tensors[f"blk.{i}.kv_b"] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(
            -1, cfg.kv_lora_rank)
    _stack_gate_up(cfg, tensors)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_scale, beta_fast=cfg.yarn_beta_fast,
                    beta_slow=cfg.yarn_beta_slow, mscale=1.0, mscale_all_dim=1.0,
                    truncate=True, original_max_position_embeddings=cfg.rope_ctx_orig)
    config = DeepseekV3Config(**_sizes(
        cfg, moe_intermediate_size=cfg.expert_ffn, num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_experts,
        routed_scaling_factor=cfg.moe_scale, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.rope_dim,
        v_head_dim=cfg.mla_v_head, qk_nope_head_dim=nope,
        n_group=max(cfg.expert_groups, 1), topk_group=max(cfg.expert_groups_used, 1),
        num_experts_per_tok=cfg.n_experts_used, first_k_dense_replace=cfg.dense_lead,
        norm_topk_prob=cfg.moe_norm,
        max_position_embeddings=int((cfg.rope_ctx_orig or cfg.context_length)
                                    * cfg.rope_scale),
        rope_parameters=rope, rope_interleave=True))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "attn_q_a.weight": "self_attn.q_a_proj.weight",
             "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
             "attn_q_b.weight": "self_attn.q_b_proj.weight",
             "attn_q.weight": "self_attn.q_proj.weight",
             "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
             "kv_b": "self_attn.kv_b_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight", **SHARED_EXPERT_NAMES}
    return DeepseekV3ForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


BUILDERS["deepseek2"] = _deepseek2


def _v_heads_grouped(t: torch.Tensor, dim: int, groups: int, width: int) -> torch.Tensor:
    """Qwen3.5's value heads back from the tiled order llama.cpp's converter writes (value
    head h reads key head h mod groups: [r][group][width]) to the checkpoint's grouped one
    ([group][r][width]) along `dim`: the inverse of its _reorder_v_heads."""
    shape = list(t.shape)
    per = shape[dim] // (groups * width)
    t = t.reshape(*shape[:dim], per, groups, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen35(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """Qwen3.5 (Qwen3_5ForCausalLM) and Qwen3.5-MoE (Qwen3_5MoeForCausalLM) from the file's
    tensors, undoing what llama.cpp's converter did: 1 added to every RMSNorm weight but the
    linear attention's gated one (transformers' Qwen3_5RMSNorm multiplies by 1 + weight),
    ssm_a = -exp(A_log), the conv's taps squeezed, the value heads tiled (_v_heads_grouped).
    M-RoPE with the file's sections, which text positions make plain RoPE."""
    G, S = cfg.ssm_groups, cfg.ssm_state
    key = 2 * G * S
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"):
            if f"{p}{n}.weight" in tensors:
                tensors[f"{p}{n}.weight"] = tensors[f"{p}{n}.weight"] - 1.0
        if not cfg.layer(i).recurrent:
            continue
        qkv = tensors[f"{p}attn_qkv.weight"]
        tensors[f"{p}attn_qkv.weight"] = torch.cat(
            (qkv[:key], _v_heads_grouped(qkv[key:], 0, G, S)))
        conv = tensors[f"{p}ssm_conv1d.weight"]
        tensors[f"{p}ssm_conv1d.weight"] = torch.cat(
            (conv[:key], _v_heads_grouped(conv[key:], 0, G, S)))[:, None, :]
        for n, width in (("attn_gate.weight", S), ("ssm_beta.weight", 1),
                         ("ssm_alpha.weight", 1), ("ssm_dt.bias", 1), ("ssm_a", 1)):
            tensors[p + n] = _v_heads_grouped(tensors[p + n], 0, G, width)
        tensors[f"{p}ssm_a"] = torch.log(-tensors[f"{p}ssm_a"])
        tensors[f"{p}ssm_out.weight"] = _v_heads_grouped(tensors[f"{p}ssm_out.weight"], 1, G, S)
    if cfg.n_experts:
        _stack_gate_up(cfg, tensors)
        for i in range(cfg.n_layers):
            tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"] = \
                tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"][None]
    tensors["output_norm.weight"] = tensors["output_norm.weight"] - 1.0
    common = _sizes(
        cfg, head_dim=cfg.head_dim, linear_conv_kernel_dim=cfg.ssm_conv_kernel,
        linear_key_head_dim=S, linear_value_head_dim=S, linear_num_key_heads=G,
        linear_num_value_heads=cfg.ssm_heads,
        layer_types=["linear_attention" if r else "full_attention"
                     for r in cfg.recurrent_layers],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
                         "mrope_section": QWEN35_SECTIONS[:3], "mrope_interleaved": True})
    names = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_q.weight": "self_attn.q_proj.weight",
             "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight",
             "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
             "attn_gate.weight": "linear_attn.in_proj_z.weight",
             "ssm_beta.weight": "linear_attn.in_proj_b.weight",
             "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
             "ssm_conv1d.weight": "linear_attn.conv1d.weight",
             "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
             "ssm_norm.weight": "linear_attn.norm.weight",
             "ssm_out.weight": "linear_attn.out_proj.weight"}
    if cfg.n_experts:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        del common["intermediate_size"]  # the file may not say it; no layer is dense
        config = Qwen3_5MoeTextConfig(
            **common, moe_intermediate_size=cfg.expert_ffn,
            shared_expert_intermediate_size=cfg.shexp_ffn,
            num_experts_per_tok=cfg.n_experts_used, num_experts=cfg.n_experts)
        names.update({"ffn_gate_inp.weight": "mlp.gate.weight",
                      "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
                      "ffn_down_exps.weight": "mlp.experts.down_proj",
                      "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                      "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                      "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                      "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"})
        return Qwen3_5MoeForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**common)
    names.update({"ffn_gate.weight": "mlp.gate_proj.weight",
                  "ffn_up.weight": "mlp.up_proj.weight",
                  "ffn_down.weight": "mlp.down_proj.weight"})
    return Qwen3_5ForCausalLM(config), _layer_names(cfg, names, TOP_NAMES)


# the M-RoPE sections transformers is given (any that cover the rotated pairs: text
# positions make them plain RoPE, which the comparison checks)
QWEN35_SECTIONS = [3, 3, 2, 0]
BUILDERS["qwen35"] = BUILDERS["qwen35moe"] = _qwen35


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' all-position logits of `ids` through the file's model (reference_model,
    its config read from the file)."""
    gf = GGUFFile(path)
    model = reference_model(path, ModelConfig.from_metadata(gf.metadata, set(gf.tensors)))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]
