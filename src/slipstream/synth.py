"""Synthesize Llama-shaped GGUF files with random but numerically sane weights.

Big test models (8B, 70B) exist only as files this module writes. Quantized tensors are made as
random blocks directly (random quant codes, scale fields set so the weights have a chosen
standard deviation) instead of quantizing float data, so writing runs at memory speed. Small
test models can instead quantize real float weights (`from_floats=True`), which is what tests
comparing against Hugging Face use.

The tokenizer is a valid byte-level BPE (GPT-2 byte alphabet, letter-pair merges, Llama-3 style
special tokens), so the files load in slipstream, in llama.cpp and in transformers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType

from . import quant
from .errors import BadArgument
from .model.families import ARCHITECTURES, VARIANTS, family_for, spec_for
from .model.layer_spec import EMBEDDING, HEAD, TensorSpec
from .modelfile.config import ModelConfig, expert_fields, yarn_fields
from .model.families.experts import EXPERTS
from .synth_experts import experts_metadata, nextn_tensors, skewed_router
from .synth_gemma4 import GEMMA4_ROPE_BASE, GEMMA4_ROPE_FRACTION, gemma4_metadata
from .synth_mla import F16_TENSORS, mla_metadata, mla_shape
from .synth_ssm import ssm_data, ssm_metadata
from .synth_vocab import LLAMA3_TEMPLATE, build_vocab
from .quant.encode import quantize
from .quant.fallback import fitting_type

Q = GGMLQuantizationType


@dataclass(frozen=True)
class SynthShape:
    hidden: int
    ffn: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context: int = 8192
    rope_base: float = 500000.0
    head_dim: int = 0  # 0: hidden / n_heads (Gemma 3 27B and Qwen3 32B set theirs apart)
    # a mixture of experts' shape (0: the arch's defaults, synth_experts)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0

    @property
    def head(self) -> int:
        return self.head_dim or self.hidden // self.n_heads


SHAPES: dict[str, SynthShape] = {
    "tiny": SynthShape(hidden=256, ffn=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab=1024,
                       context=2048, rope_base=10000.0),
    "1b": SynthShape(hidden=2048, ffn=8192, n_layers=16, n_heads=32, n_kv_heads=8,
                     vocab=128256),
    "8b": SynthShape(hidden=4096, ffn=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                     vocab=128256),
    "70b": SynthShape(hidden=8192, ffn=28672, n_layers=80, n_heads=64, n_kv_heads=8,
                      vocab=128256),
    # Gemma-3-27B's shape (write it with --arch gemma3: 62 layers is how its query scale is
    # told) and Qwen3-32B's (--arch qwen3): heads of 128 beside hidden / heads of 168 and 80
    "27b": SynthShape(hidden=5376, ffn=21504, n_layers=62, n_heads=32, n_kv_heads=16,
                      vocab=262144, context=131072, rope_base=1000000.0, head_dim=128),
    "32b": SynthShape(hidden=5120, ffn=25600, n_layers=64, n_heads=64, n_kv_heads=8,
                      vocab=151936, context=40960, rope_base=1000000.0, head_dim=128),
    # mixtures of experts: Qwen3-30B-A3B's and Qwen3-235B-A22B's (--arch qwen3moe; ffn is
    # their files' unused dense width), Mixtral-8x7B's (--arch mixtral)
    "30b-a3b": SynthShape(hidden=2048, ffn=6144, n_layers=48, n_heads=32, n_kv_heads=4,
                          vocab=151936, context=40960, rope_base=1000000.0, head_dim=128,
                          n_experts=128, n_experts_used=8, expert_ffn=768),
    "235b-a22b": SynthShape(hidden=4096, ffn=12288, n_layers=94, n_heads=64, n_kv_heads=4,
                            vocab=151936, context=40960, rope_base=1000000.0, head_dim=128,
                            n_experts=128, n_experts_used=8, expert_ffn=1536),
    # Qwen3.5-35B-A3B's (--arch qwen35moe): 30 linear-attention layers of 16 key and 32
    # value heads of 128 (synth_ssm), 10 full-attention ones of 16 query heads of 256
    "35b-a3b": SynthShape(hidden=2048, ffn=512, n_layers=40, n_heads=16, n_kv_heads=2,
                          vocab=248320, context=262144, rope_base=10000000.0, head_dim=256,
                          n_experts=256, n_experts_used=8, expert_ffn=512),
    "8x7b": SynthShape(hidden=4096, ffn=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                       vocab=32000, context=32768, rope_base=1000000.0, n_experts=8,
                       n_experts_used=2),
    # gpt-oss-20b's (--arch gpt-oss; ship --quant MXFP4): 32 experts as wide as the hidden
    # state, 4 used, heads of 64
    "20b-a4b": SynthShape(hidden=2880, ffn=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                          vocab=201088, context=131072, rope_base=150000.0, head_dim=64,
                          n_experts=32, n_experts_used=4, expert_ffn=2880),
    # GLM-4.5-Air's (--arch glm4moe): 96 query heads of 128 beside hidden 4096, the first
    # layer's dense FFN 10944 wide, then 128 experts of 1408, 8 used, and a shared one
    "106b-a12b": SynthShape(hidden=4096, ffn=10944, n_layers=46, n_heads=96, n_kv_heads=8,
                            vocab=151552, context=131072, rope_base=1000000.0, head_dim=128,
                            n_experts=128, n_experts_used=8, expert_ffn=1408),
}
# gpt-oss-120b's: gpt-oss-20b's layer with 128 experts, 36 layers
SHAPES["120b-a5b"] = replace(SHAPES["20b-a4b"], n_layers=36, n_experts=128)

def file_arch(arch: str) -> str:
    """The general.architecture a synthesized file of --arch `arch` carries."""
    return VARIANTS.get(arch, arch)


# --quant names: the type of the 2-D layer weights and of output.weight. Q4_K_M mirrors
# llama.cpp's mix: attn_v and ffn_down in Q6_K, the rest Q4_K, output Q6_K.
QUANT_MIXES: dict[str, tuple[Q, Q]] = {
    "Q4_K": (Q.Q4_K, Q.Q6_K),
    "Q4_K_M": (Q.Q4_K, Q.Q6_K),
    "Q6_K": (Q.Q6_K, Q.Q6_K),
    "Q8_0": (Q.Q8_0, Q.Q8_0),
    "F16": (Q.F16, Q.F16),
    "Q4_0": (Q.Q4_0, Q.Q6_K),
    "Q5_K": (Q.Q5_K, Q.Q6_K),
    "IQ4_NL": (Q.IQ4_NL, Q.Q6_K),
    "IQ4_XS": (Q.IQ4_XS, Q.Q6_K),
    "MXFP4": (Q.MXFP4, Q.Q8_0),  # as gpt-oss ships: MXFP4 matrices, the rest 8-bit
    # the i-quant grid formats: random codes only (nothing here encodes float weights to them)
    **{t.name: (t, Q.Q6_K) for t in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
                                      Q.IQ1_S, Q.IQ1_M)},
}

# general.file_type of each mix: llama.cpp's own enum (LlamaFileType), which is not the
# tensors' GGML type: writing Q4_K's GGML id (12) made llama.cpp name the 70B "Q3_K - Medium"
FILE_TYPES: dict[str, LlamaFileType] = {
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,  # every layer matrix Q4_K
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "F16": LlamaFileType.MOSTLY_F16,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
    **{name: LlamaFileType[f"MOSTLY_{name}"] for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S",
                                                           "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")},
}

# (byte offset, multiplier) of the float16 scale fields inside one block, per format: the only
# bytes of a random block that must be set rather than random, or the weights would be
# inf/NaN/huge. The second field of the affine formats is the offset ("min"); its multiplier
# is the mean random code, so that the weights come out centred on zero.
_F16_FIELDS: dict[Q, tuple[tuple[int, float], ...]] = {
    Q.Q4_0: ((0, 1.0),), Q.Q4_1: ((0, 1.0), (2, -7.5)), Q.Q5_0: ((0, 1.0),),
    Q.Q5_1: ((0, 1.0), (2, -15.5)), Q.Q8_0: ((0, 1.0),),
    Q.Q2_K: ((80, 1.0), (82, 1.5)), Q.Q3_K: ((108, 1.0),), Q.Q4_K: ((0, 1.0), (2, 7.5)),
    Q.Q5_K: ((0, 1.0), (2, 15.5)), Q.Q6_K: ((208, 1.0),),
    Q.IQ4_NL: ((0, 1.0),), Q.IQ4_XS: ((0, 1.0),),  # IQ4_XS's 6-bit sub-scales stay random
    Q.MXFP4: (),
    Q.IQ2_XXS: ((0, 1.0),), Q.IQ2_XS: ((0, 1.0),), Q.IQ2_S: ((0, 1.0),), Q.IQ3_XXS: ((0, 1.0),),
    Q.IQ3_S: ((0, 1.0),), Q.IQ1_S: ((0, 1.0),),
    Q.IQ1_M: (),  # no f16 field of its own: see _set_iq1_m_scale
}
# Byte offsets of one-byte e8m0 (power of two) scales: 2^(e - 128) is the weights' unit, so a
# field value v is written as e = 128 + round(log2 v); the weights' spread is then within a
# factor of sqrt(2) of the asked one.
_E8M0_FIELDS: dict[Q, tuple[int, ...]] = {Q.MXFP4: (0,)}
# IQ1_M's f16 d is spread over the top nibbles of its four 16-bit scale words (bytes 48-55):
# nibble k of d is the top nibble of word k, i.e. of byte 48 + 2k + 1
_IQ1_M_SCALE_BYTES = (49, 51, 53, 55)


def _set_iq1_m_scale(blocks: np.ndarray, value: float) -> None:
    d = int(np.float16(value).view(np.uint16))
    for k, at in enumerate(_IQ1_M_SCALE_BYTES):
        blocks[:, at] = (blocks[:, at] & 0x0F) | (((d >> (4 * k)) & 0x0F) << 4)


def _scale_for_std(qtype: Q, std: float) -> float:
    """The value of every f16 scale field that gives random blocks of `qtype` about `std`."""
    rng = np.random.default_rng(1234)
    probe = _random_blocks(qtype, 256, rng, 1.0)
    block, _ = GGML_QUANT_SIZES[qtype]
    vals = quant.dequantize(torch.from_numpy(probe).reshape(-1), qtype, (256 * block,))
    return std / max(float(vals.float().std()), 1e-12)


# Random numbers are the slow part of synthesis (numpy makes them at a few hundred MB/s), so
# big tensors are cut from a shared pool of ready-made random bytes at random offsets: each tensor
# still gets different values, and writing runs at copy speed.
_POOL_BYTES = 64 << 20
_pools: dict[tuple, np.ndarray] = {}


def _pool(kind: str, std: float = 1.0) -> np.ndarray:
    key = (kind, std)
    if key not in _pools:
        seed = np.random.default_rng(0xC0FFEE)
        if kind == "bytes":
            pool = np.frombuffer(seed.bytes(_POOL_BYTES), dtype=np.uint8)
        else:
            f = seed.standard_normal(_POOL_BYTES // 4, dtype=np.float32) * np.float32(std)
            if kind == "f16":
                f = f.astype(np.float16)
            elif kind == "bf16":
                f = (f.view(np.uint32) >> 16).astype(np.uint16)
            pool = f.view(np.uint8)
        _pools[key] = pool
    return _pools[key]


def _cut(pool: np.ndarray, n: int, rng: np.random.Generator, align: int) -> np.ndarray:
    """n bytes from the pool, starting at random aligned offsets (wrapping as needed)."""
    out = np.empty(n, dtype=np.uint8)
    done = 0
    while done < n:
        start = int(rng.integers(0, len(pool) // align)) * align
        take = min(n - done, len(pool) - start)
        out[done:done + take] = pool[start:start + take]
        done += take
    return out


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    if n <= 1 << 20:
        return np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
    return _cut(_pool("bytes"), n, rng, 1)


def _random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator,
                   field_value: float) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = _random_bytes(n_blocks * type_size, rng).reshape(n_blocks, type_size)
    for off, mult in _F16_FIELDS[qtype]:
        f16 = np.frombuffer(np.float16(field_value * mult).tobytes(), dtype=np.uint8)
        blocks[:, off:off + 2] = f16
    if qtype == Q.IQ1_M:
        _set_iq1_m_scale(blocks, field_value)
    for off in _E8M0_FIELDS.get(qtype, ()):
        blocks[:, off] = min(max(128 + round(math.log2(field_value)), 0), 252)
    return blocks


def random_tensor(qtype: Q, shape: tuple[int, int], rng: np.random.Generator, std: float,
                  _cache: dict = {}) -> np.ndarray:
    """Random bytes of a (rows, cols) tensor of `qtype` with weights of about `std`."""
    rows, cols = shape
    if qtype in (Q.F32, Q.F16, Q.BF16):
        kind, dt = {Q.F32: ("f32", np.float32), Q.F16: ("f16", np.float16),
                    Q.BF16: ("bf16", np.uint16)}[qtype]
        size = np.dtype(dt).itemsize
        if rows * cols <= 1 << 18:
            f = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            return f.astype(dt) if qtype != Q.BF16 else (f.view(np.uint32) >> 16).astype(dt)
        return _cut(_pool(kind, std), rows * cols * size, rng, size).view(dt).reshape(shape)
    if qtype not in _F16_FIELDS:
        raise BadArgument(f"synth cannot make random {qtype.name} tensors")
    key = (qtype, std)
    if key not in _cache:
        _cache[key] = _scale_for_std(qtype, std)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    return _random_blocks(qtype, n_blocks, rng, _cache[key]).reshape(rows, cols // block *
                                                                     type_size)


def float_tensor(qtype: Q, data: np.ndarray) -> np.ndarray:
    """Quantize real float32 data (rows, cols) into `qtype` bytes (or F32/F16 arrays)."""
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.F16:
        return data.astype(np.float16)
    return quantize(data.astype(np.float32), qtype)


# LongRoPE's divisor tensors and the largest divisor written in each (rising from 1.0)
LONGROPE_DIVISORS = {"rope_factors_short.weight": 3.0, "rope_factors_long.weight": 16.0}


def synth_window(shape: SynthShape) -> int:
    """The sliding window written for families that have one: short enough in the tiny shape
    that a test's few dozen tokens cross it, Gemma 3's 1024 in the others."""
    return 16 if shape.hidden <= 256 else 1024


# The families whose synthesized files rotate part of each head (Phi-4-mini's 0.75, GLM-4's
# 0.5): what
# partial rotary looks like in a real file, so that the tests exercise it
ROPE_FRACTION = {"phi3": 0.75, "glm4": 0.5, "glm4moe": 0.5, "qwen35": 0.25, "qwen35moe": 0.25}
# the families whose files never hold a head apart from the embedding (llama.cpp's loader
# reads Cohere 2's head from token_embd.weight)
TIED = ("cohere2", "gemma4")
# the architectures whose files have query, key and value biases
QKV_BIAS = ("qwen2", "glm4", "glm4moe")
# LongRoPE files (Phi-3): their original context, this fraction of the context written
LONGROPE_ORIGINAL = 4


def synth_rope_dim(shape: SynthShape, arch: str) -> int:
    return int(shape.head * ROPE_FRACTION.get(family_for(file_arch(arch)).name, 1.0)) // 2 * 2


def synth_metadata(shape: SynthShape, arch: str) -> dict[str, object]:
    """The metadata beyond the Llama keys a synthesized file of `arch` holds, which its
    family's `configure` reads."""
    family = family_for(file_arch(arch)).name
    md: dict[str, object] = {}
    if family == "gemma4":
        return gemma4_metadata(shape, arch, synth_window(shape))
    md.update(experts_metadata(shape, arch, file_arch(arch)),
              **mla_metadata(shape, arch, file_arch(arch)),
              **ssm_metadata(shape, arch, synth_rope_dim(shape, arch)))
    if family == "gpt-oss":  # gpt-oss's window and YaRN (factor 32 over 4096 positions);
        # the tiny shape's original context short enough that a test's tokens cross it
        md[f"{arch}.attention.sliding_window"] = synth_window(shape)
        md[f"{arch}.rope.scaling.type"] = "yarn"
        md[f"{arch}.rope.scaling.factor"] = 32.0
        md[f"{arch}.rope.scaling.original_context_length"] = (
            16 if shape.hidden <= 256 else 4096)
    if family in ("gemma3", "phi3", "cohere2"):
        md[f"{arch}.attention.sliding_window"] = synth_window(shape)
    if family == "cohere2":
        md[f"{arch}.logit_scale"] = 0.25  # Command R7B's
        md[f"{arch}.attention.layer_norm_epsilon"] = 1e-5
    if family == "phi3":  # as llama.cpp's converter writes Phi-3-mini-128k
        md[f"{arch}.rope.scaling.type"] = "longrope"
        orig = shape.context // LONGROPE_ORIGINAL
        md[f"{arch}.rope.scaling.original_context_length"] = orig
        # LongRoPE's attention factor, as llama.cpp's converter computes it
        md[f"{arch}.rope.scaling.attn_factor"] = math.sqrt(
            1 + math.log(LONGROPE_ORIGINAL) / math.log(orig))
    if family == "mistral3":  # Ministral 3's YaRN and temperature, over a short original
        # context in the tiny shape so that a test's few dozen tokens cross it (Ministral 3:
        # 16384)
        md[f"{arch}.rope.scaling.type"] = "yarn"
        md[f"{arch}.rope.scaling.factor"] = 16.0
        md[f"{arch}.rope.scaling.original_context_length"] = (
            16 if shape.hidden <= 256 else 16384)
        md[f"{arch}.rope.scaling.yarn_log_multiplier"] = 1.0
        md[f"{arch}.attention.temperature_scale"] = 0.1
    return md


def synth_config(shape: SynthShape, arch: str, fused_experts: bool = False) -> ModelConfig:
    """The ModelConfig the file write_synth makes will read back as (`fused_experts`: its
    experts' gate and up written as one tensor)."""
    if arch not in ARCHITECTURES and arch not in VARIANTS:
        names = ", ".join(sorted({*ARCHITECTURES, *VARIANTS}))
        raise BadArgument(f"unknown arch {arch!r}; choose from {names}")
    name, arch = arch, file_arch(arch)
    family = family_for(arch)
    head_dim = shape.head
    md = synth_metadata(shape, name)
    fields = dict(
        architecture=arch, hidden=shape.hidden, ffn=shape.ffn,
        # (block_count: the layers run and the multi-token-prediction ones after them)
        n_layers=shape.n_layers + md.get(f"{arch}.nextn_predict_layers", 0),
        n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=head_dim,
        rope_dim=synth_rope_dim(shape, name), vocab_size=shape.vocab,
        context_length=shape.context, norm_eps=1e-5, rope_base=shape.rope_base,
        rope_style=ARCHITECTURES[arch], attn_bias=arch in QKV_BIAS,
        **dataclasses.asdict(family.traits))
    if family.optional_qk_norm:  # written, as GLM-4.5's 355B has them
        fields["qk_norm"] = True
    fields.update(mla_shape(shape, name),  # (sigmoid routing's files have the bias)
                  selection_bias=md.get(f"{arch}.expert_gating_func") == 2)
    fields.update(expert_fields(md, arch, "synth", shape.ffn))
    fields["fused_experts"] = fused_experts and bool(fields.get("n_experts"))
    if family.name == "gemma4" and fields.get("n_experts"):
        # as the 26B-A4B's files: each expert's scale, and global layers whose values are
        # their key projection (no attn_v)
        swa = md[f"{arch}.attention.sliding_window_pattern"]
        fields.update(expert_scale=True,
                      v_from_k_layers=tuple(i for i, s in enumerate(swa) if not s))
    if family.name == "gemma4":  # the global layers' heads, twice the sliding ones
        fields.update(head_dim=2 * head_dim, rope_dim=2 * head_dim, layer_scale=True,
                      rope_base=GEMMA4_ROPE_BASE)
    if md.get(f"{arch}.rope.scaling.type") == "yarn":
        fields.update(rope_scaling="yarn", rope_scale=md[f"{arch}.rope.scaling.factor"],
                      **yarn_fields(md, arch, "synth", shape.context))
    if family.configure is not None:
        fields.update(family.configure(md, arch, "synth", fields))
    return ModelConfig(**fields)


def _file_rank(t: TensorSpec) -> int:
    """A layer's tensor order in synthesized files: attn_norm, the matrices, their biases,
    ffn_norm. It fixes which random numbers each tensor gets, so it must never change."""
    return {"attn_norm.weight": 0, "ffn_norm.weight": 3}.get(t.suffix,
                                                           2 if t.kind == "bias" else 1)


def tensor_data(name: str, q: Q, s: tuple[int, ...], sd: float, rng: np.random.Generator,
                gemma4: bool = False, from_floats: bool = False,
                expert_skew: float = 0.0) -> np.ndarray:
    """A synthesized tensor's data (float32, float16, or a quantized type's blocks as bytes),
    drawn from `rng` in the order write_synth writes the tensors."""
    if name.endswith(f"{EXPERTS.gate_up}.weight"):
        # the gate's experts, then the up's, drawn as a file with them apart draws them,
        # each expert's gate rows then its up rows: the same weights either way
        half = (s[0], s[1] // 2, s[2])
        return np.concatenate([tensor_data(name.replace(EXPERTS.gate_up, part), q, half, sd,
                                           rng, gemma4, from_floats, expert_skew)
                               for part in (EXPERTS.gate, EXPERTS.up)], axis=1)
    special = ssm_data(name, s, rng)
    if special is not None:  # Qwen3.5's decay, conv taps and shared-expert gate
        return special
    if expert_skew and name.endswith("ffn_gate_inp.weight"):
        return skewed_router((sd * rng.standard_normal(s)).astype(np.float32),
                             expert_skew, rng)
    # (Gemma 4's experts' pre_ffw_norm_2 and post_ffw_norm_1 and _2 too)
    if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
        return (1.0 + 0.05 * rng.standard_normal(s)).astype(np.float32)
    if name == "rope_freqs.weight" and gemma4:
        # as llama.cpp's converter writes "proportional" RoPE: the pairs past the
        # turning quarter divided by 1e30, i.e. still
        turning = int(s[0] * 2 * GEMMA4_ROPE_FRACTION) // 2
        return np.array([1.0] * turning + [1e30] * (s[0] - turning), dtype=np.float32)
    if name == "rope_freqs.weight":
        return np.linspace(1.0, 8.0, s[0], dtype=np.float32)  # llama3-like divisors
    if name.endswith("layer_output_scale.weight"):  # Gemma 4: well away from 1
        return (0.5 + 0.5 * rng.random(s)).astype(np.float32)
    if name.endswith(".scale"):  # Gemma 4's router input and expert scales: away from 1
        return (0.5 + rng.random(s)).astype(np.float32)
    if name in LONGROPE_DIVISORS:  # Phi-3-like: the long set stretches far more
        return np.linspace(1.0, LONGROPE_DIVISORS[name], s[0], dtype=np.float32)
    if name.endswith("attn_sinks.weight"):  # gpt-oss: logits of the order of the
        # scores they compete with in each softmax
        return rng.standard_normal(s).astype(np.float32)
    if len(s) == 1 or name.endswith(".bias"):  # (gpt-oss's experts' biases are 2-D)
        return (sd * rng.standard_normal(s)).astype(np.float32)
    if from_floats:
        return float_tensor(q, (sd * rng.standard_normal(s)).astype(np.float32))
    # (a 3-D expert tensor as its experts' rows stacked)
    data = random_tensor(q, (math.prod(s[:-1]), s[-1]), rng, sd)
    return data.reshape(*s[:-1], data.shape[-1])


def write_synth(path: str | Path, shape: SynthShape | str, quant_mix: str = "Q4_K",
                n_layers: int | None = None, seed: int = 0, arch: str = "llama",
                from_floats: bool = False, tie_embeddings: bool = False,
                rope_freqs: bool = False, std: float = 0.02,
                progress: Callable[[int, int], None] | None = None,
                chat_template: str = LLAMA3_TEMPLATE, expert_skew: float = 0.0,
                fused_experts: bool = False) -> Path:
    """Write a random-weight GGUF file of architecture `arch` (its family's layer, as
    model.families states it); returns its path.

    progress(bytes_done, bytes_total) is called after each tensor.
    expert_skew: for a mixture of experts, how skewed expert popularity is, as real routing
    is: each layer's router rows scaled by rank^-expert_skew (`skewed_router`), so that a few
    experts take most tokens (0: random weights' near-uniform routing).
    fused_experts: the experts' gate and up as one tensor, ffn_gate_up_exps (each expert's
    gate rows, then its up rows), as newer llama.cpp conversions write them; the weights are
    those of the same file written with them apart.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise BadArgument(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if n_layers is not None:
        shape = replace(shape, n_layers=n_layers)
    if quant_mix not in QUANT_MIXES:
        raise BadArgument(f"unknown --quant {quant_mix!r}; choose from {', '.join(QUANT_MIXES)}")
    if expert_skew < 0 or not math.isfinite(expert_skew):
        raise BadArgument(f"--expert-skew must be a finite exponent >= 0, got {expert_skew}")
    layer_type, out_type = QUANT_MIXES[quant_mix]
    head_dim = shape.head
    rng = np.random.default_rng(seed)
    path = Path(path)

    def layer_q(name: str) -> Q:
        if name == "ffn_gate_inp.weight":  # a router stays F32, as llama.cpp's quantizer
            return Q.F32  # keeps it
        if name in F16_TENSORS and layer_type != Q.F32:
            return Q.F16
        if quant_mix == "MXFP4" and gptoss and not name.endswith("_exps.weight"):
            return Q.Q8_0  # gpt-oss ships its experts only in MXFP4
        if quant_mix == "Q4_K_M" and name in ("attn_v.weight", "ffn_down.weight",
                                              "ffn_down_exps.weight"):
            return Q.Q6_K
        return layer_type

    gptoss = family_for(file_arch(arch)).name == "gpt-oss"
    cfg = synth_config(shape, arch, fused_experts)
    if (expert_skew or fused_experts) and not cfg.n_experts:
        flag = "--expert-skew biases experts' routers" if expert_skew else \
            "--fused-experts writes experts' gate and up as one tensor"
        raise BadArgument(f"{flag}; {arch!r} has no experts")
    variant, arch = arch, file_arch(arch)
    tie_embeddings = tie_embeddings or family_for(arch).name in TIED
    # name -> (ggml type, torch-order shape, weight std)
    plan: list[tuple[str, Q, tuple[int, ...], float]] = []
    plan.append((EMBEDDING, out_type if quant_mix != "Q4_K_M" else Q.Q4_K,
                 (shape.vocab, shape.hidden), std))
    for i in range(shape.n_layers):
        lc = cfg.layer(i)  # layer i's shapes and tensors (Gemma 4's layers differ)
        for t in sorted((t for t in spec_for(arch, cfg.n_experts).at(lc).tensors
                         if t.expected(cfg)),
                        key=_file_rank):
            q, sd = ((fitting_type(layer_q(t.suffix), t.shape(lc)[-1]), std)
                     if t.kind == "weight" else (Q.F32, 0.1 if t.kind == "bias" else 0.0))
            plan.append((f"blk.{i}.{t.suffix}", q, t.shape(lc), sd))
    for i in range(cfg.n_layers, cfg.n_layers + cfg.nextn_layers):  # GLM-4.5's MTP layer:
        lc = cfg.layer(cfg.n_layers - 1)  # a decoder layer and its own tensors
        for t in sorted((t for t in spec_for(arch, cfg.n_experts).at(lc).tensors
                         if t.expected(cfg)), key=_file_rank):
            plan.append((f"blk.{i}.{t.suffix}",
                         fitting_type(layer_q(t.suffix), t.shape(lc)[-1]) if t.kind == "weight"
                         else Q.F32, t.shape(lc), std if t.kind == "weight" else 0.1))
        plan += [(f"blk.{i}.{n}", layer_type if k == "weight" else Q.F32, s, std)
                 for n, s, k in nextn_tensors(shape.hidden)]
    plan.append(("output_norm.weight", Q.F32, (shape.hidden,), 0.0))
    if not tie_embeddings:
        plan.append((HEAD, out_type, (shape.vocab, shape.hidden), std))
    if rope_freqs or family_for(arch).name == "gemma4":
        plan.append(("rope_freqs.weight", Q.F32, (cfg.rope_dim // 2,), -1.0))
    if cfg.per_layer_dim:  # Gemma 4's per-layer embedding tables
        width = cfg.n_layers * cfg.per_layer_dim
        plan += [("per_layer_token_embd.weight", layer_type, (shape.vocab, width), std),
                 ("per_layer_model_proj.weight", layer_type, (width, shape.hidden), std),
                 ("per_layer_proj_norm.weight", Q.F32, (cfg.per_layer_dim,), 0.0)]
    if family_for(arch).name == "phi3":  # LongRoPE's two sets of divisors
        for name in LONGROPE_DIVISORS:
            plan.append((name, Q.F32, (cfg.rope_dim // 2,), -1.0))

    w = GGUFWriter(path, arch)
    w.add_name(f"slipstream-synth-{variant}-{shape.n_layers}l-{shape.hidden}h-{quant_mix}")
    w.add_block_count(cfg.n_layers + cfg.nextn_layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    md = synth_metadata(shape, variant)
    w.add_feed_forward_length(md.pop(f"{arch}.feed_forward_length", shape.ffn))
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(cfg.rope_dim)
    if family_for(arch).name != "llama" or head_dim != shape.hidden // shape.n_heads:
        # readers default other families' head size to their real models' (transformers: 128
        # for Qwen3) rather than hidden / heads
        w.add_key_length(cfg.head_dim)
        w.add_value_length(md.pop(f"{arch}.attention.value_length", cfg.head_dim))
    for key, value in md.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(int(FILE_TYPES[quant_mix]))
    tokens, types, merges, special = build_vocab(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special["<|begin_of_text|>"])
    w.add_eos_token_id(special["<|eot_id|>"])
    w.add_add_bos_token(True)
    w.add_chat_template(chat_template)

    def nbytes(q: Q, s: tuple[int, ...]) -> int:
        block, type_size = GGML_QUANT_SIZES[q]
        return math.prod(s) // block * type_size

    for name, q, s, _ in plan:
        np_dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(q, np.uint8)
        # gguf-py takes quantized shapes in bytes per row and converts them back to elements
        info_shape = s if np_dtype is not np.uint8 else (*s[:-1], nbytes(q, (s[-1],)))
        w.add_tensor_info(name, info_shape, np.dtype(np_dtype), nbytes(q, s), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(nbytes(q, s) for _, q, s, _ in plan)
    done = 0
    for name, q, s, sd in plan:
        data = tensor_data(name, q, s, sd, rng, gemma4=family_for(arch).name == "gemma4",
                           from_floats=from_floats, expert_skew=expert_skew)
        w.write_tensor_data(np.ascontiguousarray(data))
        done += nbytes(q, s)
        if progress is not None:
            progress(done, total)
    w.close()
    return path
