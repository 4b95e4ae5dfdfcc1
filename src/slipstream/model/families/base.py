"""What a family module states: its architecture names, its layer, and the block's variations
it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..layer_spec import LayerSpec


@dataclass(frozen=True)
class BlockTraits:
    """The named ways a family's block differs from the Llama block (model.llama). Each is
    off in the Llama block; a family turns on the ones its graph has, and ModelConfig carries
    them to the block math."""

    # RMSNorm over each query and key head (weights attn_q_norm / attn_k_norm, (head_dim,)),
    # after the projection and before RoPE: Qwen3, OLMo 2, Gemma 3
    qk_norm: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    # general.architecture -> how it pairs RoPE dimensions: "normal" where llama.cpp's
    # converter permuted Q/K rows so adjacent dimensions pair, "neox" where they are stored as
    # trained and dimension i pairs with i + rope_dim / 2
    architectures: Mapping[str, str]
    layer: LayerSpec
    traits: BlockTraits = field(default_factory=BlockTraits)
    # what sets the family apart, in a few words (the README's model table, `slipstream info`)
    quirks: str = ""
