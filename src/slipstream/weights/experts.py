"""A mixture-of-experts layer's weights (model.moe) from its GGUF tensors: the router, and
each expert's linears cut from the layer's 3-D expert tensors.

An expert tensor (n_experts, rows, cols) stores expert after expert, each expert's rows whole
blocks of its format (a row is cols / block_size blocks), so expert e's bytes are one
contiguous slice, rows [e * rows, (e + 1) * rows) of the tensor viewed (n_experts * rows,
row_bytes). Each slice becomes a linear exactly as a 2-D weight of the same format does in
weights.loader (dense made at its first use, a packed decode copy at "fast"), so an expert
dequantizes to the bits gguf-py's dequantize gives that slice of the whole tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import quant
from ..model.moe import MoeWeights, ResidentExperts
from .linear import DenseLinear, LazyDenseLinear, Linear, lazy_dense

if TYPE_CHECKING:  # the loader imports this module
    from .loader import LayerBuilder, TensorSource


def build_experts(builder: LayerBuilder, src: TensorSource, p: str) -> MoeWeights:
    """Layer `p`'s (the `blk.N` prefix) mixture of experts: the router as a float32 matrix,
    each expert's gate and up fused into one linear (gate rows, then up rows: the dense
    FFN's ffn_gate_up), and its down linear."""
    spec, cfg = builder.spec.experts, builder.cfg
    assert spec is not None
    router = src.dense(f"{p}.{spec.router}.weight", builder.shapes[f"{spec.router}.weight"],
                       torch.float32, builder.device)
    # gpt-oss's router and experts have biases: (n_experts,) and (n_experts, rows), float32
    biases = {part: src.dense(f"{p}.{part}.bias", builder.shapes[f"{part}.bias"],
                              torch.float32, builder.device)
              for part in (spec.router, spec.gate, spec.up, spec.down)
              if f"{part}.bias" in builder.shapes and src.has(f"{p}.{part}.bias")}
    dtype = builder.precision.weight_dtype
    # part -> (bytes viewed (n_experts, rows, row_bytes), GGML type, one expert's (rows, cols))
    parts = {}
    for part in (spec.gate, spec.up, spec.down):
        name, shape = f"{p}.{part}.weight", builder.shapes[f"{part}.weight"]
        raw = src.raw_held(name, shape) if src.lazy else src.raw(name, shape)
        parts[part] = (raw.view(shape[0], shape[1], -1), src.type_of(name),
                       (shape[1], shape[2]))

    def bias(part: str, e: int) -> torch.Tensor | None:
        return biases[part][e] if part in biases else None

    def linear(part: str, e: int) -> Linear:
        raw, qtype, shape = parts[part]
        if src.lazy:
            return lazy_dense(raw[e], qtype, shape, dtype, bias(part, e))
        return DenseLinear(quant.dequantize_as(raw[e], qtype, shape, dtype).to(builder.device),
                           bias(part, e))

    fuse = LazyDenseLinear.fuse if src.lazy else DenseLinear.fuse
    gate_up, down = [], []
    for e in range(cfg.n_experts):
        fused, _ = fuse([linear(spec.gate, e), linear(spec.up, e)])
        pair = (parts[spec.gate], parts[spec.up])
        gate_up.append(builder._packed([t for _, t, _ in pair], [s for _, _, s in pair],
                                       [bias(spec.gate, e), bias(spec.up, e)], fused,
                                       [r[e] for r, _, _ in pair]))
        raw, qtype, shape = parts[spec.down]
        down.append(builder._packed([qtype], [shape], [bias(spec.down, e)],
                                    linear(spec.down, e), [raw[e]]))
    act = "swiglu_oai" if cfg.ffn_act == "swiglu_oai" else "silu"
    return MoeWeights(router, ResidentExperts(gate_up, down, act), cfg.n_experts_used,
                      router_bias=biases.get(spec.router), gating=cfg.moe_gating)
