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
prefill; or, where the plan holds only some of them in VRAM, the layer's experts are split
between VRAM slots and the CPU (weights.split_build, weights.split_experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .. import kernels, quant
from ..errors import UnsupportedArchitecture
from ..model.layer_spec import ExpertPart, ExpertSpec
from ..model.moe import (ExpertMix, ExpertRows, MoeWeights, OneTokenSum, ResidentExperts,
                         SharedExpert, expert_ffn, expert_sum)
from .cpu import PackedDecodeLinear
from .cpu.expert_decode import native_expert_ffn, native_expert_sum
from .cpu.expert_rows import NativeExpertRows
from .expert_tiers import ExpertFile, ExpertSlice, TieredExperts
from .linear import DenseLinear, Linear, OnDemandDenseLinear
from .routed_experts import RoutedExperts, RoutedLinear
from .split_build import build_split

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


def shared_expert(spec: ExpertSpec, fields: dict, act: str = "silu",
                  post_norm: torch.Tensor | None = None) -> SharedExpert | None:
    """The shared expert of a layer whose linears are built into `fields` (LayerWeights
    fields by name), or None where the layer has none; `act` its gated product and
    `post_norm` its output's norm (Gemma 4's dense MLP: GeGLU, post_ffw_norm_1)."""
    gate_up, down = fields.get(spec.shared_gate_up), fields.get(spec.shared_down)
    if gate_up is None or down is None:
        if fields.get(spec.shared_down) is not None:  # (its gate and up not fused: CUDA)
            raise UnsupportedArchitecture(
                f"the shared FFN's gate and up ({spec.shared_gate_up}) could not be built as "
                f"one linear; their formats differ")
        return None
    # Qwen3.5-MoE's per-token sigmoid gate over the shared expert's output, (hidden,)
    return SharedExpert(gate_up, down, "silu" if act == "swiglu_oai" else act, post_norm,
                        fields.get(spec.shared_gate))


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
                  fields: dict | None = None) -> MoeWeights:
    """Layer `p`'s (the `blk.N` prefix) mixture of experts: the router as a float32 matrix
    and every expert's linears (expert_linears); with `slots` (and the model's `file`), only
    that many experts in RAM, in a TieredExperts bank. `fields`: the layer's other linears,
    built already (LayerWeights fields by name), of which the shared expert, which stays in
    RAM whatever `slots` says."""
    spec, cfg = builder.spec.experts, builder.cfg
    assert spec is not None

    def vector(name: str) -> torch.Tensor | None:
        """Layer p's float32 vector `name` (a norm, a scale, a bias) where its layer lists it
        and the file has it, else None."""
        if name not in builder.shapes or not src.has(f"{p}.{name}"):
            return None
        return src.dense(f"{p}.{name}", builder.shapes[name], torch.float32, builder.device)

    act = cfg.ffn_act
    shared = shared_expert(spec, fields or {}, act, vector(f"{spec.shared_post_norm}.weight"))
    router = src.dense(f"{p}.{spec.router}.weight", builder.shapes[f"{spec.router}.weight"],
                       torch.float32, builder.device)
    # gate, up and down: each a tensor of its own, or gate and up the halves of one
    parts = spec.parts(cfg.fused_experts)
    names = [f"{p}.{part.tensor}.weight" for part in parts]
    stored = [builder.shapes[f"{part.tensor}.weight"] for part in parts]
    full = [(s[0], part.rows(s[1]), s[2]) for part, s in zip(parts, stored)]
    types = [src.type_of(n) for n in names]
    shapes = [(s[1], s[2]) for s in full]

    def projections(read: Callable[[str, tuple], torch.Tensor]) -> list[torch.Tensor]:
        """Each projection's bytes (n_experts, rows, row_bytes), views of its stored tensor's
        bytes as `read` gives them, each tensor read once (gate_up's halves share it)."""
        whole = {n: read(n, s) for n, s in zip(names, stored)}
        out = []
        for n, part, s, f in zip(names, parts, stored, full):
            first = part.first(s[1])
            out.append(whole[n].view(s[0], s[1], -1)[:, first:first + f[1]])
        return out
    # gpt-oss's router and experts have biases: (n_experts,) and (n_experts, rows), float32
    split = builder.quantized and builder.expert_split is not None
    biased = [part for part in (spec.router, spec.gate, spec.up, spec.down)
              if f"{part}.bias" in builder.shapes and src.has(f"{p}.{part}.bias")]
    # a split layer's expert biases stay on the host, its slots' rows copied up
    # (weights.split_build)
    biases = {part: src.dense(f"{p}.{part}.bias", builder.shapes[f"{part}.bias"],
                              torch.float32, builder.device)
              for part in biased if not split or part == spec.router}

    def expert_biases(e: int) -> list[torch.Tensor | None]:
        return [biases[part][e] if part in biases else None
                for part in (spec.gate, spec.up, spec.down)]

    if split:  # CUDA, experts split between VRAM slots and the CPU
        slices = [expert_slice(src.gf.tensors[n], part, s)
                  for n, part, s in zip(names, parts, stored)]
        bank = build_split(builder, src, int(p.rsplit(".", 1)[1]), projections(src.raw),
                           slices, full, types, act,
                           [f"{p}.{part}.bias" if part in biased else None
                            for part in (spec.gate, spec.up, spec.down)])
    elif builder.quantized:  # CUDA: every expert in VRAM, each projection's stacked
        bank = _routed(builder, projections(src.raw), full, types,
                       [biases.get(part) for part in (spec.gate, spec.up, spec.down)], act)
        bank.warm(cfg.hidden, cfg.n_experts_used)
    elif slots is not None:
        assert file is not None
        slices = [expert_slice(src.gf.tensors[n], part, s)
                  for n, part, s in zip(names, parts, stored)]
        bank = _tiered(builder, projections(src.raw), slices, types, shapes, slots, file,
                       expert_biases, act)
    else:
        # bytes viewed (n_experts, rows, row_bytes); each expert's a contiguous slice
        raws = projections(src.raw_held if src.lazy else src.raw)
        gate_up, down = [], []
        for e in range(cfg.n_experts):
            gu, d = expert_linears(builder, [r[e] for r in raws], types, shapes, src.lazy,
                                   expert_biases(e))
            gate_up.append(gu)
            down.append(d)
        bank = ResidentExperts(gate_up, down, act, *expert_ops(builder),
                               many=expert_mix(builder))
    return MoeWeights(router, bank, cfg.n_experts_used, normalize=cfg.moe_norm,
                      router_bias=biases.get(spec.router), gating=cfg.moe_gating,
                      selection_bias=vector(f"{spec.selection_bias}.bias"),
                      groups=cfg.expert_groups, groups_used=cfg.expert_groups_used,
                      scale=cfg.moe_scale, shared=shared,
                      router_scale=vector(spec.router_scale),
                      expert_scale=vector(spec.expert_scale),
                      expert_norm=vector(f"{spec.expert_norm}.weight"),
                      expert_post_norm=vector(f"{spec.expert_post_norm}.weight"))


def expert_slice(info, part: ExpertPart, stored: tuple[int, int, int]) -> ExpertSlice:
    """Where projection `part`'s bytes of each expert lie in the file, for its stored 3-D
    tensor (`info`: gguf_file's TensorInfo) of torch shape `stored`."""
    n_experts, rows = stored[0], stored[1]
    per = info.n_bytes // n_experts
    row_bytes = per // rows
    return ExpertSlice(info.offset + part.first(rows) * row_bytes, per, part.rows(rows),
                       row_bytes)


def _tiered(builder: LayerBuilder, raws_all: list[torch.Tensor], slices: list[ExpertSlice],
            types: list, shapes: list, slots: int, file: ExpertFile,
            expert_biases: Callable[[int], list], act: str) -> TieredExperts:
    n_experts = raws_all[0].shape[0]

    def make(e: int, raws: list[torch.Tensor]):
        # the bytes are the expert's own (read, or copied below): lazy dense weights may
        # keep them
        return expert_linears(builder, raws, types, shapes, lazy=True,
                              biases=expert_biases(e))

    held = {}
    for e in range(slots):
        # copies of the map's slices: the model does not read its map after the load
        held[e] = make(e, [r[e].clone() for r in raws_all])
    one_token, rows = expert_ops(builder)
    return TieredExperts(n_experts, slots, file, slices, make, held, act=act,
                         one_token=one_token, rows=rows)


def _routed(builder: LayerBuilder, raws: list[torch.Tensor], full: list,
            types: list, biases: list[torch.Tensor | None], act: str) -> RoutedExperts:
    """The layer's experts on the GPU (weights.routed_experts): the gate, up and down tensors
    packed whole, gate and up interleaved expert by expert into one [gate_e | up_e] stack
    where their formats agree (one launch for both, as the dense FFN's ffn_gate_up).
    `raws`: the projections' (n_experts, rows, row_bytes) views of the map, each copied to the
    GPU when packed: one tensor's bytes at a time on the GPU beside its planes (memory.vram's
    load transient)."""
    n, dev = full[0][0], builder.device
    ws, fuse = builder.workspace, builder.fuse_scales
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
