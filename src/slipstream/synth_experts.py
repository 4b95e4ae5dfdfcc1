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
# and 128 of them, 4 used), 8 of them, 2 used; GLM-4.5's as Qwen3-MoE's (GLM-4.5-Air: 128 of
# 1408 beside a dense 10944, 8 used)
MOE_DEFAULTS: dict[str, tuple[int, int, int]] = {"qwen3moe": (16, 4, 0), "mixtral": (8, 2, 0),
                                                 "gpt-oss": (8, 2, 0), "glm4moe": (16, 4, 0),
                                                 "deepseek2": (16, 4, 0),
                                                 "deepseek2-lite": (16, 4, 0),
                                                 "qwen35moe": (16, 4, 0),
                                                 "gemma4-moe": (16, 4, 0)}
# the archs whose file states the experts' width apart from feed_forward_length
OWN_WIDTH = ("qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "deepseek2-lite", "qwen35moe",
             "gemma4-moe")


def synth_experts(shape: SynthShape, arch: str) -> tuple[int, int, int]:
    """(experts, used per token, expert width) of a file of `arch` in `shape`: (0, 0, 0) for
    a dense arch; the shape's where it sets them, else MOE_DEFAULTS (Qwen3-MoE's width half
    the dense width, gpt-oss's the hidden width)."""
    if arch not in MOE_DEFAULTS:
        return 0, 0, 0
    n, used, width = ((shape.n_experts, shape.n_experts_used, shape.expert_ffn)
                      if shape.n_experts else MOE_DEFAULTS[arch])
    if not width:
        width = {"qwen3moe": shape.ffn // 2, "gpt-oss": shape.hidden,
                 "glm4moe": shape.ffn // 2, "deepseek2": shape.ffn // 2,
                 "deepseek2-lite": shape.ffn // 2, "qwen35moe": shape.ffn // 2,
                 # (Gemma-4-26B-A4B: 128 of 704 beside a dense 2112, 8 used)
                 "gemma4-moe": shape.ffn // 2}.get(arch, shape.ffn)
    return n, used, width


def experts_metadata(shape: SynthShape, arch: str, key: str) -> dict[str, object]:
    """The mixture-of-experts keys of a synthesized file of --arch `arch` (its architecture
    `key`): none for a dense arch. GLM-4.5's and DeepSeek-V3's as their released files have
    them (one shared expert, the first layer dense, sigmoid routing scaled by 2.5 and
    renormalised; GLM-4.5's one multi-token-prediction layer), with 4 groups of 4 experts, 2
    open (GLM-4.5's files leave groups at 1) so that the piece is exercised; DeepSeek-V2-Lite's
    (softmax routing, no groups, no scale) for --arch deepseek2-lite."""
    n_experts, used, width = synth_experts(shape, arch)
    if not n_experts:
        return {}
    md: dict[str, object] = {f"{key}.expert_count": n_experts,
                             f"{key}.expert_used_count": used}
    if arch in OWN_WIDTH:  # (a `llama` file's experts are feed_forward_length wide)
        md[f"{key}.expert_feed_forward_length"] = width
    if arch in ("glm4moe", "deepseek2"):  # (DeepSeek-V3's: 8 groups, 4 open, scale 2.5)
        md.update({f"{key}.expert_shared_count": 1, f"{key}.leading_dense_block_count": 1,
                   f"{key}.expert_gating_func": 2, f"{key}.expert_weights_scale": 2.5,
                   f"{key}.expert_weights_norm": True, f"{key}.expert_group_count": 4,
                   f"{key}.expert_group_used_count": 2})
    if arch == "glm4moe":
        md[f"{key}.nextn_predict_layers"] = 1
    if arch == "qwen35moe":  # one shared expert as wide as a routed one (35B-A3B: 512)
        md[f"{key}.expert_shared_feed_forward_length"] = width
    if arch == "deepseek2-lite":  # V2-Lite's: 2 shared experts, the first layer dense, and
        # llama.cpp's defaults for the rest (softmax, no groups, not renormalised, factor 1)
        md.update({f"{key}.expert_shared_count": 2, f"{key}.leading_dense_block_count": 1})
    return md


def nextn_tensors(hidden: int) -> list[tuple[str, tuple[int, ...], str]]:
    """A multi-token-prediction layer's own tensors (suffix, torch-order shape, kind), beside
    a whole decoder layer's, as llama.cpp's converter writes GLM-4.5's: the projection of
    [embedding | hidden state] and its two norms."""
    return [("nextn.eh_proj.weight", (hidden, 2 * hidden), "weight"),
            ("nextn.enorm.weight", (hidden,), "norm"), ("nextn.hnorm.weight", (hidden,), "norm"),
            ("nextn.shared_head_norm.weight", (hidden,), "norm")]


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
