"""Gemma 4's two pieces after the FFN: the per-layer embedding branch and the layer's output
scale (model.families.gemma4).

Per-layer embeddings (E2B, E4B): a second token table gives each token n_layers vectors of
per_layer_dim (256). They are mixed, once per pass, with a projection of the token's
(scaled) embedding:

    inputs = (rms_norm(proj(x) / sqrt(hidden)) + table[id] * sqrt(per_layer_dim)) / sqrt(2)

split per layer, and layer i adds, after its FFN's residual,

    y += rms_norm(proj_i(gelu_tanh(inp_gate_i(y)) * inputs[:, i]))

Then (every Gemma 4) the layer's output is multiplied by its layer_output_scale. These are
transformers' Gemma4TextModel.project_per_layer_inputs and the tail of its decoder layer, and
llama.cpp's gemma4 graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..modelfile.config import ModelConfig
from .llama import LayerWeights, rms_norm

SUM_SCALE = 1.0 / math.sqrt(2.0)  # the two parts of a per-layer input are averaged so


@dataclass
class PerLayerEmbedding:
    """The model-wide half of the per-layer embeddings."""

    table: Callable[[torch.Tensor], torch.Tensor]  # ids (T,) -> (T, n_layers * per_layer_dim)
    model_proj: Callable[[torch.Tensor], torch.Tensor]  # (T, hidden) -> (T, n_layers * dim)
    proj_norm: torch.Tensor  # (per_layer_dim,)

    def inputs(self, cfg: ModelConfig, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every layer's input (T, n_layers, per_layer_dim), float32, for tokens `ids` whose
        scaled embeddings are x (T, hidden)."""
        T, P = x.shape[0], cfg.per_layer_dim
        proj = self.model_proj(x).float() * (1.0 / math.sqrt(cfg.hidden))
        proj = rms_norm(proj.view(T, cfg.n_layers, P), self.proj_norm, cfg.norm_eps)
        tok = self.table(ids).float().view(T, cfg.n_layers, P) * math.sqrt(P)
        return (proj + tok.to(proj.device)) * SUM_SCALE


def layer_tail(cfg: ModelConfig, w: LayerWeights, y: torch.Tensor,
               per_layer: torch.Tensor | None) -> torch.Tensor:
    """A layer's output y (T, hidden) after its per-layer embedding branch (per_layer: its
    input (T, per_layer_dim), or None without one) and its output scale."""
    if per_layer is not None:
        g = F.gelu(w.inp_gate(y).float(), approximate="tanh") * per_layer.to(y.device)
        y = y + rms_norm(w.proj(g.to(y.dtype)), w.post_norm, cfg.norm_eps)
    if cfg.layer_scale and w.layer_output_scale is not None:
        y = y * w.layer_output_scale
    return y
