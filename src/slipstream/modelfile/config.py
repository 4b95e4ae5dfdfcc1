"""ModelConfig: the shape and hyper-parameters of a model, read from GGUF metadata."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Collection, Mapping

from ..errors import GGUFError, InvalidMetadata, MissingMetadata, UnsupportedArchitecture
from ..model.families import ARCHITECTURES, FAMILIES, family_for, spec_for
from ..model.layer_spec import EMBEDDING
from .validate import FIX, md_float, md_int, md_ints, md_str

# Ranges of the hyper-parameters: far beyond any real model, but small enough that nothing
# sized from them (RoPE tables, KV caches, plans) can run away before a tensor shape disagrees.
MAX_LAYERS = 4096
MAX_DIM = 1 << 20  # hidden and FFN sizes
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 1 << 12  # llama.cpp's LLAMA_MAX_EXPERTS is 512
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_style: str  # "normal" (adjacent pairs) or "neox" (halves)
    rope_scaling: str = "none"  # "none", "linear" or "yarn"
    rope_scale: float = 1.0  # the scaling factor (linear: positions divided by it)
    attn_bias: bool = False  # QKV bias (Qwen2)
    # The family's variations of the Llama block (model.families; each off for Llama)
    pre_norms: bool = True  # RMSNorm before attention and the FFN (all but OLMo 2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # ... over the whole q and k projections instead (OLMo 2)
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before each residual
    ffn_act: str = "silu"  # the gated FFN's activation: "silu" or "gelu_tanh" (GeGLU)
    norm: str = "rms"  # the block's and final norm: "rms" or "layer" (LayerNorm: Cohere 2)
    parallel: bool = False  # attention and FFN from one normed input, added together
    global_rope: bool = True  # whether the global layers rotate (Cohere 2's do not)
    logit_scale: float = 1.0  # the logits are multiplied by it (Cohere 2)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden))
    sliding_window: int = 0  # a sliding-window layer attends to this many last positions
    swa_pattern: int = 0  # every swa_pattern-th layer is global (0: all sliding if a window)
    rope_base_local: float = 0.0  # RoPE base of the sliding-window layers (0: rope_base)
    attn_scale: float = 0.0  # the query scale (0: 1 / sqrt(head_dim))
    # LongRoPE (Phi-3): RoPE's cos and sin are multiplied by this (llama.cpp's
    # rope.scaling.attn_factor), and contexts beyond rope_ctx_orig positions take the
    # rope_factors_long divisors instead of rope_factors_short (0: no such split)
    rope_attn_factor: float = 1.0
    rope_ctx_orig: int = 0
    # YaRN (rope_scaling "yarn", rope_scale its factor over rope_ctx_orig): the frequencies
    # of fewer than yarn_beta_slow turns over the original context are interpolated, those
    # of more than yarn_beta_fast kept, a linear ramp between
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Llama 4's attention temperature (Ministral 3): queries at position p are multiplied by
    # 1 + attn_temp_scale * ln(1 + floor(p / attn_temp_floor)) (0: none)
    attn_temp_scale: float = 0.0
    attn_temp_floor: int = 0
    # Layers of more than one shape (Gemma 4); empty or 0 in every other family. The fields
    # above then describe the global (full-attention) layers, and ModelConfig.layer(i) each
    # layer as its block math and tensors see it.
    v_norm: bool = False  # an RMSNorm without weight over each value head (Gemma 4)
    swa_layers: tuple[bool, ...] = ()  # which layers attend to a sliding window (per layer)
    head_dim_swa: int = 0  # the sliding-window layers' head size
    rope_dim_swa: int = 0  # ... and rotated dimensions
    kv_heads_per_layer: tuple[int, ...] = ()  # key/value heads, where they differ by layer
    ffn_per_layer: tuple[int, ...] = ()  # FFN sizes, where they differ (ffn is the largest)
    # layers [0, kv_layers) compute keys and values; each later one reads those of the last
    # layer before kv_layers of its own kind (sliding or global); 0: every layer computes
    kv_layers: int = 0
    kv_reuse: bool = False  # (a layer's view) this layer reads another's keys and values
    # the layers whose values are their key projection (no attn_v: Gemma 4's 31B and
    # 26B-A4B global layers), and (a layer's view) whether this layer's are
    v_from_k_layers: tuple[int, ...] = ()
    v_from_k: bool = False
    per_layer_dim: int = 0  # per-layer embeddings' width (Gemma 4 E2B / E4B: 256)
    layer_scale: bool = False  # each layer's output times its layer_output_scale (Gemma 4)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (0: none)
    # Mixture of experts (model.moe): each layer's FFN is n_experts SwiGLU FFNs expert_ffn
    # wide, of which a router picks n_experts_used per token (0: a dense FFN, cfg.ffn wide)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    attn_sinks: bool = False  # a learned per-head logit in each attention softmax (gpt-oss)
    # "softmax", "topk_softmax" (gpt-oss) or "sigmoid" (GLM-4.5, DeepSeek-V3; model.moe.route)
    moe_gating: str = "softmax"
    moe_norm: bool = True  # the top-k weights renormalised to sum to 1
    moe_scale: float = 1.0  # ... then multiplied by it (expert_weights_scale)
    # grouped choice (model.moe.select_groups): experts in expert_groups groups, the best
    # expert_groups_used kept (0: none)
    expert_groups: int = 0
    expert_groups_used: int = 0
    # the file has the routers' selection bias (exp_probs_b: DeepSeek-V3, not V2)
    selection_bias: bool = False
    # the experts' gate and up projections are stored as one tensor, ffn_gate_up_exps
    # (model.layer_spec.ExpertSpec.parts), not as ffn_gate_exps and ffn_up_exps
    fused_experts: bool = False
    # the file has each expert's output scale (ffn_down_exps.scale: Gemma 4's
    # per_expert_scale)
    expert_scale: bool = False
    # shared experts (model.moe.SharedExpert): n_shared_experts * expert_ffn wide, 0: none
    n_shared_experts: int = 0
    # the first dense_lead layers have a dense FFN, cfg.ffn wide, the rest experts (GLM-4.5,
    # DeepSeek); layer(i) of such a layer has n_experts 0
    dense_lead: int = 0
    # multi-token-prediction layers the file holds after the n_layers the model runs
    # (`nextn_predict_layers`: GLM-4.5's one), skipped as llama.cpp skips them
    nextn_layers: int = 0
    # multi-head latent attention (DeepSeek; model.mla): keys and values made from a latent
    # kv_lora_rank wide, queries through a q_lora_rank-wide one (0: a plain projection).
    # The cache then holds the latent and the rotated key part, one "head" head_dim
    # (kv_lora_rank + rope_dim) wide, and the heads' own widths are mla_k_head (their
    # unrotated part and rope_dim) and mla_v_head (values)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    mla_k_head: int = 0
    mla_v_head: int = 0
    # Gated DeltaNet linear attention (Qwen3.5; model.delta_net): the layers marked in
    # recurrent_layers keep a conv state and a recurrent state instead of keys and values;
    # ssm_groups key heads and ssm_heads value heads, each ssm_state wide, a causal conv
    # ssm_conv_kernel taps long over the queries, keys and values (empty / 0: none)
    recurrent_layers: tuple[bool, ...] = ()
    recurrent: bool = False  # (a layer's view) this layer is a linear-attention one
    ssm_conv_kernel: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    # the full-attention layers' query projection carries a gate per head (each head's
    # queries, then its gate), and their output is multiplied by its sigmoid (Qwen3.5)
    attn_gate: bool = False
    # the shared expert's width where the file sets it apart (expert_shared_feed_forward_
    # length; 0: n_shared_experts * expert_ffn), and whether a sigmoid of one learned row
    # (ffn_gate_inp_shexp) scales its output per token (Qwen3.5-MoE)
    shexp_ffn: int = 0
    shexp_gate: bool = False
    name: str = ""

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def window_of(self, layer: int) -> int:
        """How many last positions layer `layer` attends to: 0 for all of them."""
        return self.sliding_window if self.sliding(layer) else 0

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` is a sliding-window layer, which takes the sliding layers'
        RoPE table (and, in Gemma 4, head size) even where the window is set to 0."""
        if self.swa_layers:
            return self.swa_layers[layer]
        return bool(self.sliding_window) and not (
            self.swa_pattern and (layer + 1) % self.swa_pattern == 0)

    @property
    def uniform(self) -> bool:
        """Whether every layer has this config's shapes and computes its own keys and values
        (every family but Gemma 4)."""
        return not (self.swa_layers or self.kv_heads_per_layer or self.ffn_per_layer
                    or self.kv_layers or self.v_norm or self.per_layer_dim or self.dense_lead
                    or self.recurrent_layers or self.v_from_k_layers)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek)."""
        return bool(self.kv_lora_rank)

    @property
    def q_full(self) -> bool:
        """(MLA) Whether the queries come from one projection, without a latent (V2-Lite)."""
        return not self.q_lora_rank

    @property
    def full_attn(self) -> bool:
        """(a layer's view) Whether the layer attends over a KV cache (not linear attention)."""
        return not self.recurrent

    @property
    def ssm_conv_dim(self) -> int:
        """(linear attention) The conv's channels: queries and keys (ssm_groups heads each)
        and values (ssm_heads heads), ssm_state wide each."""
        return (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

    @property
    def dense_ffn(self) -> bool:
        """(a layer's view) Whether the layer's FFN is dense, not a mixture of experts."""
        return not self.n_experts

    @property
    def experts_split(self) -> bool:
        """(a layer's view) Whether the layer has experts stored with gate and up apart."""
        return bool(self.n_experts) and not self.fused_experts

    @property
    def experts_fused(self) -> bool:
        """(a layer's view) Whether the layer has experts stored with gate and up as one."""
        return bool(self.n_experts) and self.fused_experts

    def layer(self, i: int) -> "ModelConfig":
        """Layer i's config as its block math and its tensors see it: its head size, rotated
        dimensions, key/value heads and FFN size, and whether it reuses an earlier layer's
        keys and values (`kv_reuse`). This config itself where layers are uniform."""
        if self.uniform:
            return self
        return self._layers[i]

    @functools.cached_property
    def _layers(self) -> tuple["ModelConfig", ...]:
        out = []
        for i in range(self.n_layers):
            if i < self.dense_lead:  # a leading dense layer in a mixture of experts
                out.append(dataclasses.replace(self, n_experts=0, n_experts_used=0,
                                               n_shared_experts=0))
                continue
            swa = bool(self.swa_layers) and self.swa_layers[i]
            out.append(dataclasses.replace(
                self, head_dim=self.head_dim_swa if swa else self.head_dim,
                rope_dim=self.rope_dim_swa if swa else self.rope_dim,
                n_kv_heads=(self.kv_heads_per_layer[i] if self.kv_heads_per_layer
                            else self.n_kv_heads),
                ffn=self.ffn_per_layer[i] if self.ffn_per_layer else self.ffn,
                kv_reuse=bool(self.kv_layers) and i >= self.kv_layers,
                recurrent=bool(self.recurrent_layers) and self.recurrent_layers[i],
                v_from_k=i in self.v_from_k_layers))
        return tuple(out)

    @property
    def computes_kv(self) -> bool:
        """(a layer's view) Whether the layer projects keys and values of its own."""
        return not self.kv_reuse

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends to: itself, or for a layer past
        `kv_layers` the last layer before them of its own kind (transformers' rule, which is
        llama.cpp's kv_layers - 2 for a sliding and kv_layers - 1 for a global layer in
        every Gemma 4 file; ModelConfig.from_metadata checks the two agree)."""
        if not self.kv_layers or i < self.kv_layers:
            return i
        return max(j for j in range(self.kv_layers) if self.sliding(j) == self.sliding(i))

    def kv_sources(self) -> frozenset[int]:
        """The layers whose keys and values later layers read (kv_source): a layer skip must
        keep them, or their readers would attend to a cache nothing writes."""
        return frozenset(self.kv_source(i) for i in range(self.kv_layers, self.n_layers)) \
            if self.kv_layers else frozenset()

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tensor_names: set[str] | None = None,
                      source: str = "model") -> "ModelConfig":
        """The config a file's metadata describes, after checking every hyper-parameter's type
        and range and, given the file's tensor names, the layer count against the tensors."""
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise MissingMetadata(f"{source}: missing required metadata 'general.architecture'")
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{source}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}")
        family = family_for(arch)

        def key(k: str) -> str:
            return f"{arch}.{k}"

        n_layers = md_int(md, key("block_count"), source, 1, MAX_LAYERS)
        hidden = md_int(md, key("embedding_length"), source, 1, MAX_DIM)
        n_heads = md_int(md, key("attention.head_count"), source, 1, MAX_HEADS, per_layer=True)
        if family.varied_layers:  # per-layer arrays: the family's configure reads them
            ffn = max(md_ints(md, key("feed_forward_length"), source, 1, MAX_DIM, n_layers))
            n_kv_heads = max(md_ints(md, key("attention.head_count_kv"), source, 1, MAX_HEADS,
                                     n_layers, default=n_heads))
        else:
            # (a family without dense FFNs may leave it out: its experts' width stands in)
            dense = ({"default": md.get(key("expert_feed_forward_length"), 1)}
                     if family.ffn_optional else {})
            ffn = md_int(md, key("feed_forward_length"), source, 1, MAX_DIM, per_layer=True,
                         **dense)
            n_kv_heads = md_int(md, key("attention.head_count_kv"), source, 1, MAX_HEADS,
                                default=n_heads, per_layer=True)
        if n_heads % n_kv_heads:
            raise GGUFError(f"{source}: head counts {n_heads} (query) and {n_kv_heads} (key/value) "
                            f"are invalid; the query count must be a positive multiple "
                            f"({key('attention.head_count')} / "
                            f"{key('attention.head_count_kv')}); {FIX}")
        if key("attention.key_length") in md:
            head_dim = md_int(md, key("attention.key_length"), source, 1, MAX_HEAD_DIM)
        else:
            if hidden % n_heads:
                raise InvalidMetadata(
                    f"{source}: {key('embedding_length')} {hidden} is not a multiple of "
                    f"{key('attention.head_count')} {n_heads}, and there is no "
                    f"{key('attention.key_length')} to give the head size; {FIX}")
            head_dim = hidden // n_heads
            if head_dim > MAX_HEAD_DIM:
                raise InvalidMetadata(f"{source}: the head size {hidden} / {n_heads} = "
                                      f"{head_dim} is larger than {MAX_HEAD_DIM}; {FIX}")
        value_dim = md_int(md, key("attention.value_length"), source, 1, MAX_HEAD_DIM,
                           default=head_dim)
        if value_dim != head_dim and not family.latent_kv:  # (MLA: the family checks)
            raise UnsupportedArchitecture(
                f"{source}: {key('attention.value_length')} {value_dim} differs from the key "
                f"head size {head_dim}; slipstream supports equal key and value head sizes")
        rope_dim = md_int(md, key("rope.dimension_count"), source, 1, head_dim, default=head_dim,
                          hint=f" (at most the head size {head_dim})")
        if rope_dim % 2:
            raise InvalidMetadata(f"{source}: metadata {key('rope.dimension_count')!r} is "
                                  f"{rope_dim}; RoPE rotates pairs of dimensions, so it must be "
                                  f"even; {FIX}")
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is not None and not isinstance(tokens, list):
            raise InvalidMetadata(f"{source}: metadata 'tokenizer.ggml.tokens' is not an array; "
                                  f"{FIX}")
        if key("vocab_size") in md:
            vocab = md_int(md, key("vocab_size"), source, 1, MAX_VOCAB)
            if tokens is not None and len(tokens) != vocab:
                raise InvalidMetadata(
                    f"{source}: metadata {key('vocab_size')!r} is {vocab} but "
                    f"'tokenizer.ggml.tokens' has {len(tokens)} tokens; the two must agree; "
                    f"{FIX}")
        else:
            if tokens is None:
                raise MissingMetadata(f"{source}: missing required metadata '{arch}.vocab_size' "
                                      f"(and no tokenizer.ggml.tokens to infer it from)")
            vocab = len(tokens)
            if not 1 <= vocab <= MAX_VOCAB:
                raise InvalidMetadata(f"{source}: 'tokenizer.ggml.tokens' has {vocab} tokens; a "
                                      f"vocabulary has 1..{MAX_VOCAB}; {FIX}")
        context = md_int(md, key("context_length"), source, 1, MAX_CONTEXT, default=2048)
        eps = md_float(md, key("attention.layer_norm_rms_epsilon"), source, 1e-5, 0.0, 1.0,
                       lo_open=True, hint=" (models use 1e-6 to 1e-5)")
        rope_base = md_float(md, key("rope.freq_base"), source, 10000.0, 1.0, 1e30,
                             hint=" (models use 1e4 to 1e7)")
        scaling = md_str(md, key("rope.scaling.type"), source, "none")
        scale = md_float(md, key("rope.scaling.factor"), source, 1.0, 0.0, 1e6) or 1.0
        if scale < 1e-3:
            raise InvalidMetadata(f"{source}: metadata {key('rope.scaling.factor')!r} is "
                                  f"{scale!r}; a RoPE scaling factor is at least 0.001 (0 means "
                                  f"none); {FIX}")
        # "longrope" (Phi-3's 128k files) is carried by its divisor tensors, which the loader
        # reads (weights.loader), and its attention factor (the family's configure)
        if scaling not in ("none", "linear", "yarn", "longrope"):
            raise UnsupportedArchitecture(f"{source}: RoPE scaling type {scaling!r} is not "
                                          f"supported; supported: none, linear, yarn, "
                                          f"longrope, llama3 (rope_freqs)")
        yarn = yarn_fields(md, arch, source, context) if scaling == "yarn" and scale != 1.0 else {}
        experts = expert_fields(md, arch, source, ffn)
        names = tensor_names or set()
        fields = dict(
            architecture=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=ffn,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            vocab_size=vocab,
            context_length=context,
            norm_eps=eps,
            rope_base=rope_base,
            rope_style=ARCHITECTURES[arch],
            rope_scaling=scaling if scaling == "linear" or yarn else "none",
            rope_scale=scale if scaling == "linear" or yarn else 1.0,
            attn_bias="blk.0.attn_q.bias" in names,
            selection_bias=any(n.endswith(".exp_probs_b.bias") for n in names),
            fused_experts=any(n.endswith(".ffn_gate_up_exps.weight") for n in names),
            expert_scale=any(n.endswith(".ffn_down_exps.scale") for n in names),
            layer_scale="blk.0.layer_output_scale.weight" in names,
            name=str(md.get("general.name", "")),
            **dataclasses.asdict(family.traits),
            **yarn,
            **experts,
        )
        if family.optional_qk_norm:  # query/key norms where the file has them (GLM-4.5)
            fields["qk_norm"] = "blk.0.attn_q_norm.weight" in names
        if family.values_from_keys:  # a layer with keys but no attn_v: values are its keys
            fields["v_from_k_layers"] = tuple(
                i for i in range(n_layers)
                if f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names)
        if family.configure is not None:
            fields.update(family.configure(md, arch, source, fields))
        cfg = cls(**fields)
        if tensor_names is not None:
            cfg.check_tensor_names(tensor_names, source)
        return cfg

    def check_tensor_names(self, names: Collection[str], source: str = "model") -> None:
        """The layer count against the tensors present: every `blk.N.` tensor has N below
        block_count, and every tensor a layer needs (and the embedding and final norm) is
        there. Shapes are checked by weights.check_layer_shapes, before any byte is read."""
        layers: dict[int, str] = {}
        for name in names:
            m = _LAYER_TENSOR.match(name)
            if m:
                layers.setdefault(int(m.group(1)), name)
        beyond = sorted(i for i in layers if i >= self.n_layers + self.nextn_layers)
        if beyond:
            raise InvalidMetadata(
                f"{source}: metadata '{self.architecture}.block_count' is "
                f"{self.n_layers + self.nextn_layers} but "
                f"the file has tensors of layer {beyond[-1]} (e.g. {layers[beyond[-1]]!r}), "
                f"{len(beyond)} layer(s) beyond it; the layer count or the tensor names are "
                f"wrong; {FIX}")
        if self.n_experts:
            check_expert_layout(self, names, source)
        spec = spec_for(self.architecture, self.n_experts)
        family = family_for(self.architecture)
        if family.check_names is not None:
            family.check_names(self, names, source)
        for name in (EMBEDDING, "output_norm.weight", *family.top_tensors(self)):
            if name not in names:
                raise GGUFError(f"{source}: missing tensor {name!r}")
        for i in range(self.n_layers):
            required = [t.suffix for t in spec.at(self.layer(i)).tensors if not t.optional]
            for suffix in required:
                name = f"blk.{i}.{suffix}"
                if name not in names:
                    have = "" if i in layers else (
                        f" (the file has no tensors of layer {i}, but "
                        f"'{self.architecture}.block_count' is {self.n_layers})")
                    raise GGUFError(f"{source}: missing tensor {name!r}{have}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def expert_fields(md: Mapping[str, Any], arch: str, source: str, ffn: int) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts: `{arch}.expert_count` (absent or 0: a
    dense model), `{arch}.expert_used_count` of them per token, each expert `ffn` wide (the
    family's configure may read its own width: Qwen3-MoE's expert_feed_forward_length). A
    family without expert layers refuses a file that has experts."""
    n = md_int(md, f"{arch}.expert_count", source, 0, MAX_EXPERTS, default=0)
    if not n:
        return {}
    if family_for(arch).moe_layer is None:
        raise UnsupportedArchitecture(
            f"{source}: {arch!r} with experts ('{arch}.expert_count' {n}) is not supported; "
            f"slipstream runs mixtures of experts in "
            f"{', '.join(sorted(a for f in FAMILIES if f.moe_layer for a in f.architectures))}")
    used = md_int(md, f"{arch}.expert_used_count", source, 1, n,
                  hint=f" (at least one of the {n} experts)")
    return dict(n_experts=n, n_experts_used=used, expert_ffn=ffn)


def check_expert_layout(cfg: ModelConfig, names: Collection[str], source: str) -> None:
    """Expert weights stored one 2-D tensor per expert (`blk.N.ffn_gate.E.weight`, early
    Mixtral conversions; llama.cpp's converter has merged them into 3-D `ffn_*_exps` tensors
    since 2024) are refused by name rather than reported as missing tensors."""
    for part in ("ffn_gate", "ffn_up", "ffn_down"):
        old = f"blk.0.{part}.0.weight"
        if old in names:
            raise UnsupportedArchitecture(
                f"{source}: the experts are stored one tensor per expert ({old!r}, an early "
                f"conversion); slipstream reads the experts of a layer as one 3-D tensor "
                f"('blk.0.{part}_exps.weight'), as current llama.cpp conversions write them: "
                f"convert the model again")


def yarn_fields(md: Mapping[str, Any], arch: str, source: str, context: int) -> dict[str, Any]:
    """The ModelConfig fields of YaRN RoPE scaling (rope.scaling.type "yarn" with a factor),
    as llama.cpp reads them: the original context (the trained one where absent), the ramp's
    rotation bounds (32 and 1), and the factor on cos and sin, 1 + 0.1 ln(factor) divided by
    the same with yarn_log_multiplier (transformers' mscale / mscale_all_dim) in its place:
    1 for Ministral 3, whose multiplier is 1."""
    factor = md_float(md, f"{arch}.rope.scaling.factor", source, 1.0, 1.0, 1e6)
    orig = md_int(md, f"{arch}.rope.scaling.original_context_length", source, 1, MAX_CONTEXT,
                  default=context)
    fast = md_float(md, f"{arch}.rope.scaling.yarn_beta_fast", source, 32.0, 0.0, 1e4,
                    lo_open=True)
    slow = md_float(md, f"{arch}.rope.scaling.yarn_beta_slow", source, 1.0, 0.0, 1e4,
                    lo_open=True)
    log_mul = md_float(md, f"{arch}.rope.scaling.yarn_log_multiplier", source, 0.0, 0.0, 100.0)
    mscale = 1.0 + 0.1 * math.log(factor)
    if log_mul:
        mscale /= 1.0 + 0.1 * log_mul * math.log(factor)
    return dict(rope_ctx_orig=orig, yarn_beta_fast=fast, yarn_beta_slow=slow,
                rope_attn_factor=mscale)
