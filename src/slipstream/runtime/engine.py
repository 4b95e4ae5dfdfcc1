"""The forward pass over a sequence: embedding, every block, final norm and head.

The engine owns the KV cache and the position; callers feed it token ids. Prefill runs the whole
prompt as one batch through each layer; decode is the same call with one token.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import ContextOverflow
from ..model import RopeTable, block_forward, rms_norm
from ..weights import ModelWeights
from .kv_cache import KVCache

# Prompts longer than this are prefilled in chunks of it, which bounds the attention scores'
# memory ((heads, chunk, ctx) floats) without giving up batching.
PREFILL_CHUNK = 2048


class Engine:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 ctx: int, act_dtype: torch.dtype, kv_dtype: torch.dtype):
        self.cfg = cfg
        self.weights = weights
        self.device = device
        self.ctx = ctx
        self.act_dtype = act_dtype
        self.kv = KVCache(cfg, ctx, device, kv_dtype)
        self.rope = RopeTable(cfg, ctx, device, weights.rope_freqs)
        self.pos = 0  # tokens already in the KV cache

    def reset(self) -> None:
        self.pos = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], all_logits: bool = False) -> torch.Tensor:
        """Append tokens to the context; return float32 logits (T, vocab) or (1, vocab).

        Tokens go through every layer as one batch (chunked past PREFILL_CHUNK).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        T = int(ids.shape[0])
        if T == 0:
            raise ValueError("forward() needs at least one token")
        if self.pos + T > self.ctx:
            raise ContextOverflow(f"{self.pos + T} tokens do not fit the context of {self.ctx} "
                                  f"tokens; use a shorter prompt or a larger --ctx")
        outs = []
        for start in range(0, T, PREFILL_CHUNK):
            chunk = ids[start: start + PREFILL_CHUNK]
            h = self._hidden(chunk)
            outs.append(h if all_logits else h[-1:])
        h = torch.cat(outs) if len(outs) > 1 else outs[0]
        h = rms_norm(h, self.weights.output_norm, self.cfg.norm_eps)
        return self.weights.output(h).float()

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[0]
        start = self.pos
        positions = torch.arange(start, start + T, device=self.device)
        cos_sin = self.rope.angles(positions)
        x = self.weights.embed(ids.to(self.device)).to(self.act_dtype)  # (T, hidden)
        for i, layer in enumerate(self.weights.layers):
            k_cache, v_cache = self.kv.layer(i)
            x = block_forward(self.cfg, layer, x, cos_sin, start, k_cache, v_cache, self.rope)
        self.pos += T
        return x
