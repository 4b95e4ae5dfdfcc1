"""Gemma 4's synthesized files (synth.py): the E2B's layout in small, or the 26B-A4B's
(--arch gemma4-moe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model.families import VARIANTS
from .synth_experts import experts_metadata

if TYPE_CHECKING:  # type hints only: synth imports this module
    from .synth import SynthShape

# Gemma 4's global layers turn a quarter of their frequencies ("proportional" RoPE), with
# base 1e6 (its sliding layers: 1e4)
GEMMA4_ROPE_FRACTION = 0.25
GEMMA4_ROPE_BASE = 1e6
GEMMA4_PER_LAYER_DIM = 256


def gemma4_layout(shape: SynthShape, moe: bool = False) -> tuple[list[bool], int]:
    """A synthesized Gemma 4's sliding-window pattern and the layers that compute keys and
    values: every third layer global and the last one too (E2B: every fifth), and the last
    half of the layers, rounded to a whole pattern, reusing the keys and values of the two
    before them (E2B: 20 of 35); with experts (`moe`: the 26B-A4B) every layer its own."""
    n = shape.n_layers
    swa = [(i + 1) % 3 != 0 and i != n - 1 for i in range(n)]
    kv_layers = n // 2 // 3 * 3
    return swa, kv_layers if kv_layers >= 3 and not moe else n


def gemma4_metadata(shape: SynthShape, variant: str, window: int) -> dict[str, object]:
    """Gemma 4's keys, in E2B's proportions: global heads twice the sliding ones, a quarter of
    the global heads' frequencies turning, the reusing layers' FFN twice as wide, per-layer
    embeddings E2B's 256 wide (a whole K-quant block per row), soft-capped logits. The
    26B-A4B's (--arch gemma4-moe): experts (synth_experts), no per-layer embeddings and no
    layers reusing keys and values (synth_config adds each expert's scale and the global
    layers without attn_v). `window`: the sliding window."""
    arch = VARIANTS.get(variant, variant)
    moe = variant != arch
    swa, kv_layers = gemma4_layout(shape, moe)
    md: dict[str, object] = {
        f"{arch}.attention.sliding_window": window,
        f"{arch}.attention.sliding_window_pattern": swa,
        f"{arch}.attention.shared_kv_layers": shape.n_layers - kv_layers,
        f"{arch}.attention.key_length_swa": shape.head,
        f"{arch}.attention.value_length_swa": shape.head,
        f"{arch}.rope.dimension_count_swa": shape.head,
        f"{arch}.rope.freq_base_swa": 10000.0,
        f"{arch}.embedding_length_per_layer_input": 0 if moe else GEMMA4_PER_LAYER_DIM,
        f"{arch}.final_logit_softcapping": 30.0,
        f"{arch}.feed_forward_length": [shape.ffn * (1 if i < kv_layers else 2)
                                        for i in range(shape.n_layers)],
    }
    md.update(experts_metadata(shape, variant, arch))
    return md
