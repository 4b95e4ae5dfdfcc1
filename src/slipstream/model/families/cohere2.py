"""Cohere 2 (Command R7B, Command A): a block unlike Llama's in four ways:
- LayerNorm (the mean subtracted, a weight and no bias; `attention.layer_norm_epsilon`)
  instead of RMSNorm, before the block and over the final hidden state;
- attention and the FFN in parallel, both reading the one normed input, both outputs added
  to the residual (x + attn(h) + ffn(h)); there is no ffn_norm;
- three sliding-window layers to one global: layer i attends globally when (i + 1) % 4 == 0
  (`attention.sliding_window_pattern`, 4 where absent, as llama.cpp reads it), otherwise to
  the last `attention.sliding_window` positions (4096 in both models); only the sliding
  layers rotate their queries and keys: the global ones take no RoPE at all;
- the logits multiplied by `logit_scale` (0.25 for Command R7B, 0.125 for Command A).
NORMAL RoPE pairing (Cohere trains with interleaved pairs, so llama.cpp's converter leaves
the rows alone); the head is the token embedding (tied). A sliding-window layer may rotate
with its own base (`rope.freq_base_swa`).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...modelfile.hparams import md_float, md_int
from ..layer_spec import LayerSpec
from .base import BlockTraits, Family
from .llama import LLAMA_LINEARS, LLAMA_TENSORS

SWA_PATTERN = 4  # llama.cpp's default for Cohere 2, and transformers'


def configure(md: Mapping[str, Any], arch: str, source: str,
              base: Mapping[str, Any]) -> dict[str, Any]:
    window = md_int(md, f"{arch}.attention.sliding_window", source, 1, base["context_length"])
    pattern = md_int(md, f"{arch}.attention.sliding_window_pattern", source, 1, 1 << 12,
                     default=SWA_PATTERN)
    eps = md_float(md, f"{arch}.attention.layer_norm_epsilon", source, base["norm_eps"], 0.0,
                   1.0, lo_open=True, hint=" (Cohere uses 1e-5)")
    scale = md_float(md, f"{arch}.logit_scale", source, 1.0, 0.0, 1e3, lo_open=True,
                     hint=" (Command R7B's is 0.25)")
    local_base = md_float(md, f"{arch}.rope.freq_base_swa", source, 0.0, 0.0, 1e30)
    return dict(sliding_window=window, swa_pattern=pattern, norm_eps=eps, logit_scale=scale,
                rope_base_local=local_base)


COHERE2 = Family(
    name="cohere2",
    architectures={"cohere2": "normal"},
    layer=LayerSpec(tensors=tuple(t for t in LLAMA_TENSORS
                                  if t.suffix != "ffn_norm.weight" and t.kind != "bias"),
                    norms=("attn_norm",), linears=LLAMA_LINEARS),
    traits=BlockTraits(norm="layer", parallel=True, global_rope=False),
    configure=configure,
    quirks="LayerNorm, attention and FFN in parallel, 3:1 sliding-window layers with RoPE "
           "only on the sliding ones, a logit scale, tied embeddings",
)
