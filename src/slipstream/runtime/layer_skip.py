"""Layer skip: leave out the layers that change the hidden state least, chosen on a calibration
text by the cosine similarity between each layer's input and output.

A layer whose output points where its input did mostly adds little to the residual stream, so
skipping it costs little. `calibrate` measures that on prefill passes (through the engine's
`layer_hook`, so the engine's own layer loop runs); `choose` picks the layers; setting
`engine.skip` applies them (the engine neither streams nor computes a skipped layer).

What skipping costs is measured, not assumed: `slipstream perplexity --skip-layers K`
(bench/layer_skip_ppl.py).
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .engine import Engine

# Preferred layers (streamed ones) win among near-equals: a preferred layer outranks another
# unless the other's distance from identity (1 - similarity) is smaller by more than this
# fraction of the preferred one's. See choose().
PREFER_MARGIN = 0.25
CALIBRATION_CHUNK = 512  # tokens per calibration pass (fewer when the context is smaller)

__all__ = ["CALIBRATION_CHUNK", "PREFER_MARGIN", "calibrate", "calibration_text", "choose"]


def calibration_text() -> str:
    """The calibration text shipped with the package (plain English prose)."""
    return (resources.files("slipstream") / "data" / "calibration.txt").read_text("utf-8")


def calibrate(engine: "Engine", token_ids: Sequence[int], chunk: int | None = None
              ) -> list[float]:
    """Per layer, the mean over tokens of the cosine similarity between the layer's input and
    output hidden states, on `token_ids` run as prefill passes of `chunk` tokens (default: the
    engine's context, at most CALIBRATION_CHUNK), each in a fresh context.

    Runs every layer (engine.skip is cleared meanwhile and restored after; setting it resets
    the context, which calibration leaves empty anyway)."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("calibration needs at least one token")
    chunk = chunk or min(engine.ctx, CALIBRATION_CHUNK)
    n = engine.cfg.n_layers
    sums = torch.zeros(n, dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.long)

    def record(i: int, x_in: torch.Tensor, x_out: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)
        sums[i] += float(cos.double().sum())  # one host sync per layer: calibration only
        counts[i] += cos.numel()

    saved = engine.skip
    engine.skip = frozenset()
    engine.layer_hook = record
    try:
        for start in range(0, len(ids), chunk):
            engine.reset()
            engine.forward(ids[start:start + chunk])
    finally:
        engine.layer_hook = None
        engine.skip = saved  # also resets the context
    return [float(s / c) for s, c in zip(sums.tolist(), counts.tolist())]


def choose(similarities: Sequence[float], k: int | None = None,
           threshold: float | None = None, prefer: set[int] | frozenset[int] | None = None,
           margin: float = PREFER_MARGIN, keep: frozenset[int] = frozenset()
           ) -> frozenset[int]:
    """The layers to skip: the k most redundant (highest similarity), or every one at or above
    `threshold`, or with both, at most k of those at or above it.

    Layer 0 and the last layer are never chosen: the first builds the residual stream out of
    the token embedding and the last feeds the final norm and head; both are far from
    identity in practice, and skipping either shifts every later (or the output) distribution.

    prefer (e.g. a plan's streamed layers: skipping one saves its PCIe or disk transfer, not
    only its compute) breaks near-ties by this rule: layers are ranked by their distance from
    identity, d = 1 - similarity, where a preferred layer's distance counts as d / (1 + margin).
    So a preferred layer beats a resident one unless the resident one's d is smaller by more
    than `margin` of the preferred one's (with margin 0.25, a streamed layer at 0.960 beats a
    resident one at 0.965, but not one at 0.970). Ties fall to the higher similarity, then the
    lower index. prefer changes which k are taken, never what a threshold admits.

    keep: layers never chosen either, such as those whose keys and values later layers read
    (ModelConfig.kv_sources: Gemma 4's shared caches).
    """
    n = len(similarities)
    if k is None and threshold is None:
        raise ValueError("choose() needs k, threshold or both")
    if k is not None and k < 0:
        raise ValueError(f"k={k} is invalid: the number of layers to skip must be >= 0")
    # never the first or the last layer (see above), nor one to keep
    candidates = [i for i in range(1, n - 1) if i not in keep]
    if k is not None and k > len(candidates):
        raise ValueError(f"cannot skip {k} layers of {n}: the first and last are never skipped, "
                         f"nor {len(keep)} whose keys and values later layers read, which "
                         f"leaves {len(candidates)}" if keep else
                         f"cannot skip {k} layers of {n}: the first and last are never skipped, "
                         f"which leaves {len(candidates)}")
    if threshold is not None:
        candidates = [i for i in candidates if similarities[i] >= threshold]
    prefer = prefer or frozenset()

    def rank(i: int) -> tuple[float, float, int]:
        d = max(1.0 - float(similarities[i]), 0.0)  # rounding may pass 1.0
        if i in prefer:
            d /= 1.0 + margin
        return d, -float(similarities[i]), i

    ranked = sorted(candidates, key=rank)
    return frozenset(ranked if k is None else ranked[:k])
