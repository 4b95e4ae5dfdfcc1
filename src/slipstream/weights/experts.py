"""A mixture-of-experts layer's weights (model.moe) from its GGUF tensors: the router, and
each expert's linears cut from the layer's 3-D expert tensors.

An expert tensor (n_experts, rows, cols) stores expert after expert, each expert's rows whole
blocks of its format (a row is cols / block_size blocks), so expert e's bytes are one
contiguous slice, rows [e * rows, (e + 1) * rows) of the tensor viewed (n_experts * rows,
row_bytes). Each slice becomes a linear as a 2-D weight of the same format does in
weights.loader (a packed decode copy at "fast", made at the load), except that its dense
weight is made from the slice's bytes at each call that needs it (prefill) and dropped after,
so an expert dequantizes to the bits gguf-py's dequantize gives that slice of the whole
tensor, and RAM holds the GGUF bytes and the packed copies only.

With `expert_slots` (a plan that holds only some experts in RAM, memory.expert_plan), the
layer's experts go into a TieredExperts bank (weights.expert_tiers): its first slots experts
built now from private copies of their slices, the others read from the file when used and
built by the same `expert_linears`.

On CUDA every expert goes to VRAM, each projection's experts packed as one stacked weight
(weights.routed_experts), read by routed GEMVs in decode and cut into per-expert views for
prefill."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .. import kernels, quant
from ..model.layer_spec import ExpertSpec
from ..model.moe import (ExpertMix, ExpertRows, MoeWeights, OneTokenSum, ResidentExperts,
                         SharedExpert, expert_ffn, expert_sum)
from .cpu import PackedDecodeLinear
from .cpu.expert_decode import native_expert_ffn, native_expert_sum
from .cpu.expert_rows import NativeExpertRows
from .expert_tiers import ExpertFile, ExpertSlice, TieredExperts
from .linear import DenseLinear, Linear, OnDemandDenseLinear
from .routed_experts import RoutedExperts, RoutedLinear

if TYPE_CHECKING:  # the loader imports this module
    from .loader import LayerBuilder, TensorSource


def expert_linears(builder: LayerBuilder, raws: list[torch.Tensor], types: list,
                   shapes: list[tuple[int, int]], lazy: bool,
                   biases: list[torch.Tensor | None] | None = None) -> tuple[Linear, Linear]:
    """One expert's (gate_up, down) linears from its bytes of the gate, up and down tensors
    (each (rows, row_bytes) uint8, in that order), their GGML types and (rows, cols): gate
    and up fused into one linear (gate rows, then up rows: the dense FFN's ffn_gate_up).
    `lazy`: `raws` stay valid, and the dense weights are made from them at each call that
    needs them and dropped after (OnDemandDenseLinear: a pass's routed experts only, never
    every expert's float16 copy at once); else made now. At precision "fast" the packed decode
    copies are made now, once: a token never waits for an expert's packing.
    `biases`: the expert's gate, up and down biases (gpt-oss), float32, or None."""
    dtype = builder.precision.weight_dtype
    biases = biases or [None, None, None]
    if lazy:
        fused: Linear = OnDemandDenseLinear.stacked(raws[:2], types[:2], shapes[:2], dtype,
                                                    biases[:2])
        down: Linear = OnDemandDenseLinear(raws[2], types[2], shapes[2], dtype, biases[2])
    else:
        parts = [DenseLinear(quant.dequantize_as(raws[k], types[k], shapes[k], dtype)
                             .to(builder.device), biases[k]) for k in range(3)]
        fused, _ = DenseLinear.fuse(parts[:2])
        down = parts[2]
    gate_up = builder._packed(types[:2], shapes[:2], biases[:2], fused, raws[:2])
    down = builder._packed(types[2:], shapes[2:], biases[2:], down, raws[2:])
    packs = [lin for lin in (gate_up, down) if isinstance(lin, PackedDecodeLinear)]
    if packs:
        # on one thread: an expert's packing is a few small ops (1.8 MB of Qwen3-30B-A3B's
        # gate/up), and on the 2-core machine with a load average of 5 it took 5.6 ms on one
        # thread against 79 ms on two, each op waiting for a descheduled second thread
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for lin in packs:
                lin.packed  # noqa: B018 (packed now)
        finally:
            torch.set_num_threads(threads)
    return gate_up, down


def shared_expert(spec: ExpertSpec, fields: dict) -> SharedExpert | None:
    """The shared expert of a layer whose linears are built into `fields` (LayerWeights
    fields by name), or None where the layer has none."""
    gate_up, down = fields.get(spec.shared_gate_up), fields.get(spec.shared_down)
    return SharedExpert(gate_up, down) if gate_up is not None and down is not None else None


def expert_ops(builder: LayerBuilder) -> tuple[OneTokenSum, ExpertRows]:
    """How a bank of this build sums a decode token's experts and runs an expert on its rows:
    natively where the experts are packed on the CPU (weights.cpu.expert_decode), else op by
    op (model.moe)."""
    if builder.precision.cpu_packed_decode:
        return native_expert_sum, native_expert_ffn
    return expert_sum, expert_ffn


def expert_mix(builder: LayerBuilder) -> ExpertMix | None:
    """How a bank of resident experts of this build mixes a pass of several rows in one go:
    natively where the experts are packed on the CPU (weights.cpu.expert_rows; one per bank,
    which keeps its experts' table), else None (model.moe.experts_ffn, expert by expert)."""
    return NativeExpertRows() if builder.precision.cpu_packed_decode else None


def build_experts(builder: LayerBuilder, src: TensorSource, p: str,
                  slots: int | None = None, file: ExpertFile | None = None,
                  shared: SharedExpert | None = None) -> MoeWeights:
    """Layer `p`'s (the `blk.N` prefix) mixture of experts: the router as a float32 matrix
    and every expert's linears (expert_linears); with `slots` (and the model's `file`), only
    that many experts in RAM, in a TieredExperts bank. `shared`: the layer's shared expert
    (built with its other linears), which stays in RAM whatever `slots` says."""
    spec, cfg = builder.spec.experts, builder.cfg
    assert spec is not None
    router = src.dense(f"{p}.{spec.router}.weight", builder.shapes[f"{spec.router}.weight"],
                       torch.float32, builder.device)
    names = [f"{p}.{part}.weight" for part in (spec.gate, spec.up, spec.down)]
    full = [builder.shapes[f"{part}.weight"] for part in (spec.gate, spec.up, spec.down)]
    types = [src.type_of(n) for n in names]
    shapes = [(s[1], s[2]) for s in full]
    # gpt-oss's router and experts have biases: (n_experts,) and (n_experts, rows), float32
    biases = {part: src.dense(f"{p}.{part}.bias", builder.shapes[f"{part}.bias"],
                              torch.float32, builder.device)
              for part in (spec.router, spec.gate, spec.up, spec.down)
              if f"{part}.bias" in builder.shapes and src.has(f"{p}.{part}.bias")}

    def expert_biases(e: int) -> list[torch.Tensor | None]:
        return [biases[part][e] if part in biases else None
                for part in (spec.gate, spec.up, spec.down)]

    act = "swiglu_oai" if cfg.ffn_act == "swiglu_oai" else "silu"
    if builder.quantized:  # CUDA: every expert in VRAM, each projection's stacked
        bank = _routed(builder, src, names, full, types,
                       [biases.get(part) for part in (spec.gate, spec.up, spec.down)], act)
        bank.warm(cfg.hidden, cfg.n_experts_used)
    elif slots is not None:
        assert file is not None
        bank = _tiered(builder, src, names, full, types, shapes, slots, file, expert_biases,
                       act)
    else:
        # bytes viewed (n_experts, rows, row_bytes)
        raws = [(src.raw_held(n, s) if src.lazy else src.raw(n, s)).view(s[0], s[1], -1)
                for n, s in zip(names, full)]
        gate_up, down = [], []
        for e in range(cfg.n_experts):
            gu, d = expert_linears(builder, [r[e] for r in raws], types, shapes, src.lazy,
                                   expert_biases(e))
            gate_up.append(gu)
            down.append(d)
        bank = ResidentExperts(gate_up, down, act, *expert_ops(builder),
                               many=expert_mix(builder))
    sel = f"{spec.selection_bias}.bias"
    selection_bias = (src.dense(f"{p}.{sel}", builder.shapes[sel], torch.float32, builder.device)
                      if sel in builder.shapes and src.has(f"{p}.{sel}") else None)
    return MoeWeights(router, bank, cfg.n_experts_used, normalize=cfg.moe_norm,
                      router_bias=biases.get(spec.router), gating=cfg.moe_gating,
                      selection_bias=selection_bias, groups=cfg.expert_groups,
                      groups_used=cfg.expert_groups_used, scale=cfg.moe_scale, shared=shared)


def _tiered(builder: LayerBuilder, src: TensorSource, names: list[str], full: list,
            types: list, shapes: list, slots: int, file: ExpertFile,
            expert_biases: Callable[[int], list], act: str) -> TieredExperts:
    n_experts = full[0][0]
    slices = []
    for n, s in zip(names, full):
        info = src.gf.tensors[n]
        per = info.n_bytes // n_experts
        slices.append(ExpertSlice(info.offset, per, s[1], per // s[1]))

    def make(e: int, raws: list[torch.Tensor]):
        # the bytes are the expert's own (read, or copied below): lazy dense weights may
        # keep them
        return expert_linears(builder, raws, types, shapes, lazy=True,
                              biases=expert_biases(e))

    held = {}
    for e in range(slots):
        # copies of the map's slices: the model does not read its map after the load
        raws = [src.raw(n, s).view(s[0], s[1], -1)[e].clone() for n, s in zip(names, full)]
        held[e] = make(e, raws)
    one_token, rows = expert_ops(builder)
    return TieredExperts(n_experts, slots, file, slices, make, held, act=act,
                         one_token=one_token, rows=rows)


def _routed(builder: LayerBuilder, src: TensorSource, names: list[str], full: list,
            types: list, biases: list[torch.Tensor | None], act: str) -> RoutedExperts:
    """The layer's experts on the GPU (weights.routed_experts): the gate, up and down tensors
    packed whole, gate and up interleaved expert by expert into one [gate_e | up_e] stack
    where their formats agree (one launch for both, as the dense FFN's ffn_gate_up)."""
    n, dev = full[0][0], builder.device
    ws, fuse = builder.workspace, builder.fuse_scales
    # (n_experts, rows, row_bytes) views of the map, each copied to the GPU when packed: one
    # tensor's bytes at a time on the GPU beside its planes (memory.vram's load transient)
    raws = [src.raw(name, s).view(n, s[1], -1) for name, s in zip(names, full)]
    (_, ffn, hidden), (_, out, width) = full[0], full[2]

    def stack(raw: torch.Tensor, qtype, rows: int, cols: int, bias) -> RoutedLinear:
        packed = kernels.pack_weight(raw.reshape(n * rows, -1).to(dev), qtype, n * rows, cols)
        return RoutedLinear(packed, n, bias, ws, fuse)

    if types[0] == types[1]:
        bias = None
        if biases[0] is not None or biases[1] is not None:
            bias = torch.cat([b if b is not None else torch.zeros(n, ffn, device=dev)
                              for b in biases[:2]], dim=1)
        gate_up = [stack(torch.cat(raws[:2], dim=1), types[0], 2 * ffn, hidden, bias)]
    else:
        gate_up = [stack(raws[k], types[k], ffn, hidden, biases[k]) for k in (0, 1)]
    down = stack(raws[2], types[2], out, width, biases[2])
    return RoutedExperts(gate_up, down, act)
