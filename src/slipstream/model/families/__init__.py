"""The model families slipstream runs, one module each, and the lookup from a file's
`general.architecture` to its family.

A family says what its decoder layer holds (a LayerSpec: tensors, fusion rules, norms), which
architecture names it covers and how each pairs RoPE dimensions, and which of the block's
named variations it uses (`BlockTraits`). The block math itself is shared (model.llama); the
memory tiers, streaming, hybrid decode and speculation read only the layer spec, so a family
gets all of them by being listed here.

Pure data, like model.layer_spec: nothing here imports torch, so that `slipstream info` and
modelfile.config stay light.
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedArchitecture
from ..layer_spec import LayerSpec
from .base import BlockTraits, Family
from .cohere2 import COHERE2
from .deepseek2 import DEEPSEEK2
from .gemma3 import GEMMA3
from .gemma4 import GEMMA4
from .glm4 import GLM4
from .glm4moe import GLM4MOE
from .gptoss import GPTOSS
from .llama import LLAMA
from .mistral3 import MISTRAL3
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen3 import QWEN3
from .qwen35 import QWEN35, QWEN35MOE
from .qwen3moe import QWEN3MOE

__all__ = ["ARCHITECTURES", "BlockTraits", "FAMILIES", "Family", "VARIANTS", "family_for",
           "file_spec", "spec_for"]

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN3, GEMMA3, GEMMA4, PHI3, MISTRAL3, OLMO2, GLM4,
                                 COHERE2, QWEN3MOE, GPTOSS, GLM4MOE, DEEPSEEK2, QWEN35,
                                 QWEN35MOE)

# general.architecture -> its family
_BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}

# general.architecture -> how it pairs RoPE dimensions ("normal" or "neox")
ARCHITECTURES: dict[str, str] = {arch: style for f in FAMILIES
                                 for arch, style in f.architectures.items()}

# Names of a family's variants that no file carries as its general.architecture (what
# `slipstream synth --arch` takes beside the architectures) -> the architecture their files
# carry: Mixtral is a `llama` file with experts; DeepSeek-V2-Lite a `deepseek2` file without
# a query latent, routed by softmax without a selection bias; Gemma 4's 26B-A4B a `gemma4`
# file with experts
VARIANTS: dict[str, str] = {"mixtral": "llama", "deepseek2-lite": "deepseek2",
                            "gemma4-moe": "gemma4"}


def family_for(architecture: str) -> Family:
    """The family of `architecture` (general.architecture, as in ModelConfig.architecture)."""
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}")
    return family


def spec_for(architecture: str, n_experts: int = 0) -> LayerSpec:
    """The decoder layer of `architecture`, in its files with `n_experts` experts
    (ModelConfig.n_experts; 0: none)."""
    family = family_for(architecture)
    if n_experts and family.moe_layer is not None:
        return family.moe_layer
    return family.layer


def file_experts(gf: Any) -> int:
    """The expert count a GGUF file's metadata gives (`{arch}.expert_count`), for what reads a
    file's layers without its ModelConfig (the file's values checked by ModelConfig); 0 where
    absent or unreadable."""
    md = getattr(gf, "metadata", None) or {}
    n = md.get(f"{gf.architecture}.expert_count", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def file_spec(gf: Any) -> LayerSpec:
    """The decoder layer of a GGUF file (GGUFFile, or what carries its architecture and
    metadata)."""
    return spec_for(gf.architecture, file_experts(gf))
