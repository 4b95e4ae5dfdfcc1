"""A stage: one device, a contiguous range of layers, the store that hands them out, and the KV
cache and RoPE table of those layers.

The engine chains stages and moves the hidden state across each boundary. A model on one GPU
(or on the CPU) is one stage; a second GPU, or layers computed on the CPU beside a GPU, is
another stage rather than a fork of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..modelfile.config import ModelConfig
from ..model import RopeTable
from .kv_cache import KVCache

if TYPE_CHECKING:  # the engine knows stores by their protocol only
    from ..memory import LayerStore


@dataclass
class Stage:
    device: torch.device
    layers: range  # global layer indices, contiguous
    store: "LayerStore"  # acquire(i) / release(i) with the global index
    kv: KVCache  # keys and values of `layers` only
    rope: RopeTable  # on `device`
    # the sliding-window layers' table where their RoPE differs (cfg.rope_base_local), or None
    rope_local: RopeTable | None = None

    @classmethod
    def build(cls, cfg: ModelConfig, device: torch.device, layers: range, store: "LayerStore",
              ctx: int, kv_dtype: torch.dtype,
              rope_freqs: torch.Tensor | None = None) -> "Stage":
        local = None
        if cfg.rope_base_local and (cfg.sliding_window or cfg.swa_layers):
            # the sliding-window layers rotate with their own base and no scaling (and, in
            # Gemma 4, over their own head size)
            local = RopeTable(replace(cfg, rope_base=cfg.rope_base_local, rope_scaling="none",
                                      rope_scale=1.0, rope_dim=cfg.rope_dim_swa or cfg.rope_dim),
                              ctx, device)
        kv = KVCache(cfg, ctx, device, kv_dtype, len(layers), layers.start)
        return cls(device, layers, store, kv, RopeTable(cfg, ctx, device, rope_freqs), local)

    @property
    def graph_capturable(self) -> bool:
        """A captured CUDA graph would freeze one set of streamed weights: only a stage whose
        store hands out fixed layers on a CUDA device can be captured."""
        return self.device.type == "cuda" and self.store.graph_capturable
