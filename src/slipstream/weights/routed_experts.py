"""A mixture of experts' experts in VRAM (model.moe.ExpertBank on CUDA): each projection's
experts stacked in one packed weight, as the GGUF file stacks them (an expert tensor
(n_experts, rows, cols) is expert after expert, so it packs as one (n_experts * rows, cols)
weight whose expert e is rows [e * rows, (e + 1) * rows)).

Two paths over the same planes:
- a pass of up to MAX_M rows, or any pass inside a CUDA graph capture (a speculative tree's
  step graphs): `mix` runs one routed GEMV per projection for every (token, slot) pair at
  once (kernels.gemv.gemv_routed, kernels.gemv_q8.gemv_q8_routed), which read the expert ids
  on the device. No host sync, so the decode step is captured whole (runtime.graphs). The
  gated product is fused into the int8 quantization of the down projection's input where the
  dense FFN fuses it (SwiGLU at precision "fast"), and the k outputs are weighted and summed
  on the device;
- a longer pass (prefill): model.moe.experts_ffn groups the rows by expert (one host sync for
  the counts) and runs each expert as a QuantLinear over its rows of the stacked planes
  (views, no copy), the dense layers' GEMV / qgemm / dequantize + cuBLAS dispatch.

Biases (gpt-oss) are (n_experts, rows) float32, gathered by the ids on the device."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import kernels
from ..kernels.pack import FLOAT_DTYPES, PackedWeight, f16_scales, fuse_scales
from ..model.llama import gated
from ..model.moe import expert_ffn, experts_ffn, swiglu_oai
from .linear import Linear, QuantLinear, Workspace


class RoutedLinear:
    """One projection of every expert: a (n_experts * rows, cols) packed weight, its per-expert
    QuantLinears as views of it (prefill), and the routed GEMV (decode)."""

    def __init__(self, packed: PackedWeight, n_experts: int, bias: torch.Tensor | None,
                 workspace: Workspace, fuse: bool = True):
        """bias: (n_experts, rows) float32 or None. fuse: as QuantLinear's (int8 activations
        only: the scales folded into one f16 plane, once for the whole stack, so that each
        expert's QuantLinear takes its rows of it instead of a copy)."""
        if packed.rows % n_experts:
            raise ValueError(f"a weight of {packed.rows} rows does not stack {n_experts} "
                             f"experts")
        self.n_experts = n_experts
        self.rows = packed.rows // n_experts
        self.cols = packed.cols
        int_codes = packed.qtype not in FLOAT_DTYPES and packed.spec.int_codes
        self.q8 = workspace.int8_activations and int_codes
        if self.q8:
            packed = fuse_scales(packed) if fuse else f16_scales(packed)
        self.packed = packed
        self.bias = bias
        self.experts = [QuantLinear(packed.row_slice(e * self.rows, (e + 1) * self.rows),
                                    None if bias is None else bias[e], workspace, fuse)
                        for e in range(n_experts)]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, x_div: int) -> torch.Tensor:
        """(P, rows) float32: pair p's expert ids[p] on x row p // x_div (x (P / x_div, cols))."""
        if self.q8:
            return self.quantized(*kernels.gemv_q8.quantize_x(x), ids, x_div)
        y = kernels.gemv_routed(x, self.packed, ids, self.n_experts, x_div,
                                out_dtype=torch.float32)
        return self._biased(y, ids)

    def quantized(self, xq: torch.Tensor, xm: torch.Tensor, ids: torch.Tensor, x_div: int
                  ) -> torch.Tensor:
        """__call__ on an x already quantized (kernels.gemv_q8.quantize_x); q8 only."""
        y = kernels.gemv_q8.gemv_q8_routed(xq, xm, self.packed, ids, self.n_experts, x_div)
        return self._biased(y, ids)

    def _biased(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.index_select(0, ids)


class _Concat(Linear):
    """An expert's gate and up linears of different formats, as one [gate | up] linear."""

    def __init__(self, parts: Sequence[Linear]):
        self.parts = list(parts)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if residual is None else residual + y


class RoutedExperts:
    """A layer's experts in VRAM (model.moe.ExpertBank): `gate_up` one RoutedLinear over
    [gate | up] rows per expert, or two (gate, up) where their formats differ; `down` one.
    act: "silu" (SwiGLU) or "swiglu_oai" (gpt-oss)."""

    def __init__(self, gate_up: Sequence[RoutedLinear], down: RoutedLinear, act: str = "silu"):
        if act not in ("silu", "swiglu_oai"):
            raise ValueError(f"unknown expert activation {act!r}; expected silu or swiglu_oai")
        if not gate_up or any(g.n_experts != down.n_experts for g in gate_up):
            raise ValueError(f"gate/up of {[g.n_experts for g in gate_up]} experts for a down "
                             f"projection of {down.n_experts}")
        self.gate_up = list(gate_up)
        self.down = down
        self.act = act

    @property
    def n_experts(self) -> int:
        return self.down.n_experts

    def _gate_up(self, e: int) -> Linear:
        parts = [g.experts[e] for g in self.gate_up]
        return parts[0] if len(parts) == 1 else _Concat(parts)

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return expert_ffn(self._gate_up(e), self.down.experts[e], h, self.act)

    def warm(self, hidden: int, top_k: int) -> None:
        """Run the routed path once on zeros, so that its Triton kernels are compiled and
        loaded at the load: a speculative tree's step graph wider than MAX_M rows warms up
        through the grouped path and would otherwise first launch them inside its capture
        (the launch specializations do not depend on the number of rows)."""
        dev = self.down.packed.device
        ids = torch.zeros(1, top_k, dtype=torch.long, device=dev)
        self.mix(torch.zeros(1, hidden, device=dev), ids,
                 torch.full((1, top_k), 1.0 / top_k, device=dev))

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One token's experts, weighted and summed through the routed launches (`mix`)."""
        return self.mix(h, torch.tensor([ids], device=h.device), weights.view(1, -1))

    def mix(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        if T > kernels.MAX_M and not (h.is_cuda and torch.cuda.is_current_stream_capturing()):
            return experts_ffn(h, ids, weights, self)
        flat = ids.reshape(-1)  # pair p = token p // k, slot p % k
        parts = [g(h, flat, x_div=k) for g in self.gate_up]  # (T * k, 2 * ffn) together
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if self.act == "silu" and self.down.q8:
            # SwiGLU formed inside the quantizing kernel, as QuantLinear.glu_matmul does
            xq, xm = kernels.gemv_q8.quantize_x(gate_up, glu=True)
            y = self.down.quantized(xq, xm, flat, x_div=1)
        else:
            act = swiglu_oai(gate_up) if self.act == "swiglu_oai" else gated("silu", gate_up)
            y = self.down(act, flat, x_div=1)  # (T * k, hidden)
        return (y.view(T, k, -1) * weights.unsqueeze(-1).float()).sum(dim=1)
