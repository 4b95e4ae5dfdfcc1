"""The multi-head latent attention of synthesized DeepSeek files (synth.py): its metadata, in
DeepSeek-V3's proportions scaled to the shape, and the ModelConfig fields it sets apart from
the shape's heads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: synth imports this module
    from .synth import SynthShape

# DeepSeek-V3: a 1536-wide query latent and a 512-wide key/value latent beside 7168 hidden,
# heads of 128 unrotated and 64 rotated key dimensions and 128 value ones. The tiny shape
# keeps the latents a whole K-quant block (256) wide and the heads' parts at 64 and 32, so
# that a test's heads are not the hidden width's quarter
MLA_TINY = dict(q_lora=256, kv_lora=256, nope=64, rope=32, v_head=64)
MLA_FULL = dict(q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128)
# the layer tensors kept F16 whatever the mix: 64 unrotated dimensions are no whole K-quant
# block
F16_TENSORS = ("attn_k_b.weight", "attn_v_b.weight")


def mla_metadata(shape: SynthShape, variant: str, arch: str) -> dict[str, object]:
    """The keys of a synthesized `deepseek2` file beyond the experts' (synth_experts): the
    latents and head widths, the cache's key and value lengths, and DeepSeek-V3's YaRN
    (factor 40, mscale_all_dim 1) over an original context short enough in the tiny shape
    that a test's tokens cross it. --arch deepseek2-lite: V2-Lite's, no query latent (a
    q_lora_rank of 0 written, which llama.cpp reads where it cannot tell a Lite model by its
    layer count) and mscale_all_dim 0.707."""
    if arch != "deepseek2":
        return {}
    d = MLA_TINY if shape.hidden <= 256 else MLA_FULL
    lite = variant == "deepseek2-lite"
    return {f"{arch}.attention.q_lora_rank": 0 if lite else d["q_lora"],
            f"{arch}.attention.kv_lora_rank": d["kv_lora"],
            f"{arch}.attention.key_length_mla": d["nope"] + d["rope"],
            f"{arch}.attention.value_length_mla": d["v_head"],
            f"{arch}.attention.value_length": d["kv_lora"],
            f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": 40.0,
            f"{arch}.rope.scaling.original_context_length": 16 if shape.hidden <= 256 else 4096,
            f"{arch}.rope.scaling.yarn_log_multiplier": 0.0707 if lite else 0.1}


def mla_shape(shape: SynthShape, arch: str) -> dict[str, int]:
    """The ModelConfig fields a synthesized `deepseek2` file sets apart from the shape's: one
    cache head of the key/value latent and the rotated part, and the rotated width."""
    if arch not in ("deepseek2", "deepseek2-lite"):
        return {}
    d = MLA_TINY if shape.hidden <= 256 else MLA_FULL
    return dict(n_kv_heads=1, rope_dim=d["rope"], head_dim=d["kv_lora"] + d["rope"])
