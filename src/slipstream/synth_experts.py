"""The experts of synthesized mixture-of-experts files (synth.py): how many, how many a token
uses and how wide, per architecture, and routers skewed as trained ones are."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # type hints only: synth imports this module
    from .synth import SynthShape

# the mixture-of-experts archs: experts, used per token and width (0: the arch's default)
# where the shape sets none. The tiny shape's are small enough for the reference tests and
# keep the real models' traits: Qwen3-MoE's many experts narrower than the file's unused dense
# width (128 of 768 beside 6144 there, 8 used; 16 of half the dense width here, 4 used: the
# narrowest a K-quant's 256-element rows allow in the tiny shape), Mixtral's 8 experts of the
# full width, 2 used; gpt-oss's experts as wide as its hidden state (2880 in both models; 32
# and 128 of them, 4 used), 8 of them, 2 used
MOE_DEFAULTS: dict[str, tuple[int, int, int]] = {"qwen3moe": (16, 4, 0), "mixtral": (8, 2, 0),
                                                 "gpt-oss": (8, 2, 0)}


def synth_experts(shape: SynthShape, arch: str) -> tuple[int, int, int]:
    """(experts, used per token, expert width) of a file of `arch` in `shape`: (0, 0, 0) for
    a dense arch; the shape's where it sets them, else MOE_DEFAULTS (Qwen3-MoE's width half
    the dense width, gpt-oss's the hidden width)."""
    if arch not in MOE_DEFAULTS:
        return 0, 0, 0
    n, used, width = ((shape.n_experts, shape.n_experts_used, shape.expert_ffn)
                      if shape.n_experts else MOE_DEFAULTS[arch])
    if not width:
        width = {"qwen3moe": shape.ffn // 2, "gpt-oss": shape.hidden}.get(arch, shape.ffn)
    return n, used, width


# Skewed routing (write_synth's expert_skew). A router without a bias has no constant offset
# to prefer an expert by (random hidden states share no direction, and a constant one would
# fade through the layers' residual adds); its rows' lengths set how far each expert's logit
# spreads, and the experts with the longest rows win the top-k most often, in every layer.
def skewed_router(router: np.ndarray, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """router (n_experts, hidden) float32 with expert e's row scaled by rank_e^-exponent (rank_e:
    e's place, from 1, in a random order of the layer's experts), the scales' mean kept at 1:
    the longer a row, the more often its expert is among a token's top k."""
    ranks = rng.permutation(router.shape[0]) + 1
    scale = ranks.astype(np.float64) ** -exponent
    return (router * (scale / scale.mean())[:, None]).astype(np.float32)
