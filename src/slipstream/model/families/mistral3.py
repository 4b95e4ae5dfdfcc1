"""Mistral 3 (llama.cpp's `mistral3`: Ministral 3 and the Mistral Small 3.x files its newer
converter writes): the Llama block (NORMAL RoPE pairing, permuted Q/K rows, SwiGLU) with one
addition, the attention temperature of Llama 4 that Ministral 3 trains with: each query is
multiplied, after RoPE, by

    1 + attention.temperature_scale * ln(1 + floor(position / original context))

where the original context is `rope.scaling.original_context_length` (else the trained
context, as llama.cpp's n_ctx_orig_yarn). Below the original context (16384 positions for
Ministral 3) the factor is exactly 1; files without the key (Mistral Small 3.x) have no
temperature at all. A query's factor depends on its position, so such a model takes the
block's general path on every device (the fused decode kernels and the CPU's native layer
take one scale for all queries).

Ministral 3 also stretches RoPE with YaRN (factor 16 over 16384, `rope.scaling.yarn_*`),
which ModelConfig reads for every family and model.rope applies.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...modelfile.hparams import md_float, md_int
from ..layer_spec import LayerSpec
from .base import Family
from .llama import LLAMA_LINEARS, LLAMA_TENSORS


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    scale = md_float(md, f"{arch}.attention.temperature_scale", source, 0.0, 0.0, 10.0,
                     hint=" (Ministral 3's is 0.1)")
    if not scale:
        return {}
    context = base["context_length"]
    floor = md_int(md, f"{arch}.rope.scaling.original_context_length", source, 1, 1 << 24,
                   default=context)
    return dict(attn_temp_scale=scale, attn_temp_floor=floor)


MISTRAL3 = Family(
    name="mistral3",
    architectures={"mistral3": "normal"},
    layer=LayerSpec(tensors=LLAMA_TENSORS, norms=("attn_norm", "ffn_norm"),
                    linears=LLAMA_LINEARS),
    configure=configure,
    quirks="the Llama block; Llama 4's position-dependent query temperature and YaRN "
           "(Ministral 3)",
)
