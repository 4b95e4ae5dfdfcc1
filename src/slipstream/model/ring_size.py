"""How many slots each layer's keys and values take: the whole context, or for a
sliding-window layer a ring of its window plus RING_RESERVE (model.ring says why and how it
is read). Pure arithmetic on the config, without torch, so that the planner's sizing
(model.layer_spec.kv_cache_bytes) and the cache (runtime.kv_cache) count the same slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: modelfile.config imports the families, which import us
    from ..modelfile.config import ModelConfig

# False: windowed layers keep the whole context, as global ones do (tests compare the two)
RING = True
RING_TREE = 512  # the most slots a cache may roll back (speculative.sizing.NODE_CHOICES[-1])
RING_PAD = 128  # a captured tree level's padding rows (runtime.graphs.STEP_WIDTHS[-1])
RING_RESERVE = RING_TREE + RING_PAD


def ring_slots(cfg: ModelConfig, layer: int, ctx: int) -> int:
    """The slots layer `layer`'s keys and values take in a cache of ctx positions: ctx for a
    global layer (and for a windowed one whose keys later layers reuse: they read after it
    wrote, which a prefill chunk longer than the reserve would have overwritten), else its
    window plus the reserve."""
    window = cfg.window_of(layer)
    if not RING or not window or layer in _reused(cfg):
        return ctx
    return min(ctx, window + RING_RESERVE)


def _reused(cfg: ModelConfig) -> set[int]:
    if not cfg.kv_layers:
        return set()
    return {cfg.kv_source(i) for i in range(cfg.n_layers) if cfg.kv_source(i) != i}
