"""The loader's side of a mixture of experts split between VRAM and the CPU (weights.
split_experts): per layer, the VRAM slots filled with experts 0..v-1 one expert at a time (no
stacked projection of every expert on the GPU at once: the plan's load transient is one
expert's), the next r experts built for the CPU in RAM from private copies of their bytes,
the rest left in the file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .expert_slots import SlotMap
from .expert_stream import ExpertStreamer, StreamRates
from .expert_tiers import ExpertFile, ExpertSlice, TieredExperts
from .split_experts import ExpertBytes, SlotStacks, SplitExperts, SplitRuntime

if TYPE_CHECKING:  # the loader imports this module
    from .loader import LayerBuilder, TensorSource


@dataclass
class SplitSpec:
    """A split load's placement (memory.expert_split_plan) and what its layers share: per
    layer, the experts in VRAM slots and the CPU's in RAM; the builder of the CPU's experts
    (a CPU LayerBuilder at the same precision: packed decode copies at "fast"), and the
    runtime (file, hand-off, counters)."""

    vram_slots: list[int]
    ram_slots: list[int]
    cpu_builder: "LayerBuilder"
    runtime: SplitRuntime


@dataclass(frozen=True)
class SplitPlacement:
    """What load_weights takes for a split: the plan's per-layer experts in VRAM slots and in
    RAM, and how to make the hand-off to the CPU's worker (hybrid.host_io.HostIO, handed in:
    weights/ does not import hybrid/), called with (device, hidden); `rates`: what decides a
    prefill between streaming the experts outside VRAM to the GPU and the CPU (weights.
    expert_stream; None: the CPU's, as decode's)."""

    vram_slots: list[int]
    ram_slots: list[int]
    host_io: Callable[[torch.device, int], object]
    rates: StreamRates | None = None

    def spec(self, path: str | os.PathLike[str], device: torch.device, hidden: int,
             cpu_builder: "LayerBuilder", n_layers: int) -> SplitSpec:
        if len(self.vram_slots) != n_layers or len(self.ram_slots) != n_layers:
            raise ValueError(f"expert split of {len(self.vram_slots)} and "
                             f"{len(self.ram_slots)} layers for a model of {n_layers}")
        runtime = SplitRuntime(ExpertFile(path), device, hidden,
                               lambda: self.host_io(device, hidden))
        if self.rates is not None:
            runtime.streamer = ExpertStreamer(runtime, self.rates)
        return SplitSpec(self.vram_slots, self.ram_slots, cpu_builder, runtime)


def build_split(builder: LayerBuilder, src: TensorSource, layer: int,
                raws: list[torch.Tensor], slices: list[ExpertSlice],
                full: list[tuple[int, int, int]], types: list, act: str,
                bias_names: list[str | None]) -> SplitExperts:
    """Layer `layer`'s split bank from its gate, up and down projections: their bytes
    (n_experts, rows, row_bytes) as mapped, where each expert's lies in the file, their full
    (n_experts, rows, cols) shapes and types; bias_names: each one's bias tensor, or None."""
    from .experts import expert_linears, expert_ops  # experts.py dispatches here

    spec: SplitSpec = builder.expert_split
    n = full[0][0]
    v, r = spec.vram_slots[layer], spec.ram_slots[layer]
    cpu = torch.device("cpu")
    shapes = [(s[1], s[2]) for s in full]
    biases = [src.dense(b, (n, s[1]), torch.float32, cpu) if b is not None else None
              for b, s in zip(bias_names, full)]
    layout = ExpertBytes(types, shapes, slices, biases)
    stacks = None
    if v:
        stacks = SlotStacks(layout, [x[0] for x in raws], v, builder.device,
                            builder.workspace, builder.fuse_scales, act)
        for e in range(v):
            stacks.write(e, e, [x[e] for x in raws])
        stacks.bank.warm(builder.cfg.hidden, builder.cfg.n_experts_used)
    cpu_b = spec.cpu_builder

    def expert_biases(e: int) -> list[torch.Tensor | None]:
        return [b[e] if b is not None else None for b in biases]

    def make(e: int, expert_raws: list[torch.Tensor]):
        return expert_linears(cpu_b, expert_raws, types, shapes, lazy=True,
                              biases=expert_biases(e))

    # copies of the map's slices: the model does not read its map after the load
    held = {e: make(e, [x[e].clone() for x in raws]) for e in range(v, min(n, v + r))}
    one_token, rows = expert_ops(cpu_b)
    tiered = TieredExperts(n, r, spec.runtime.file, slices, make, held, act=act,
                           one_token=one_token, rows=rows)
    per_expert = sum(sl.expert_bytes for sl in slices)

    def staging(first: list[torch.Tensor], slots: int) -> SlotStacks:
        return SlotStacks(layout, first, slots, builder.device, builder.workspace,
                          builder.fuse_scales, act)

    return SplitExperts(layer, stacks, SlotMap(n, v), tiered, spec.runtime,
                        cpu_b.precision.act_dtype, per_expert, layout, staging)
