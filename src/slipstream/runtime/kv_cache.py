"""A preallocated KV cache: allocated once for the whole context, written in place."""

from __future__ import annotations

import torch

from ..config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_ctx: int, device: torch.device, dtype: torch.dtype):
        self.max_ctx = max_ctx
        # (n_layers, n_kv_heads, max_ctx, head_dim) for keys and for values
        shape = (cfg.n_layers, cfg.n_kv_heads, max_ctx, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
