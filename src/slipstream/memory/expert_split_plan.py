"""The CUDA plan of a mixture of experts whose VRAM budget holds the dense part but not every
expert: the GPU keeps the dense part and as many whole experts as fit, the CPU computes the
others beside it (weights.split_experts).

VRAM, first the dense part, whatever the budget: every layer's attention, norms, router and
shared expert, the embedding, the head, the KV cache and the engine's reserve (memory.vram,
planned without CUDA graphs: a split layer syncs once for its routing ids, which no graph
holds). A budget below it fails with BudgetTooSmall giving both numbers. What is left holds
whole experts in per-layer slots, spread evenly over the layers with experts (a token passes
every layer, so an even spread gives each layer the same share of its most used experts; the
first layers take the remainder, one each).

RAM, then: the experts not in VRAM are held built for the CPU (their GGUF bytes and packed
decode copies, memory.expert_plan.expert_ram_bytes) while the RAM budget lasts, spread as
evenly, beside room to read and build one cold expert; the rest stay in the GGUF file and are
read when routed to, as the CPU plan's cold experts are (weights.expert_tiers).

Which experts fill the slots is decided as the model runs (weights.expert_slots): the first
ones at the load, then the most used ones, counted from the routing."""

from __future__ import annotations

import dataclasses

from ..errors import BudgetTooSmall
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..precision import Precision
from .budget import fmt_bytes
from .expert_plan import expert_dense_bytes, expert_file_bytes, expert_ram_bytes
from .planner import Plan
from .vram import (alloc_bytes, expert_layout, expert_planes, layer_dense_vram_bytes,
                   slot_stack_bytes, write_transient)
from ..weights.expert_stream import STAGING_SLOTS, STAGING_WRITE_ELEMENTS


@dataclasses.dataclass(frozen=True)
class ExpertSizes:
    """Per layer (0 or none for a layer without experts): the dense VRAM, one expert's planes
    in the VRAM slot stacks, one expert's RAM built for the CPU; and one cold expert's read
    and build in RAM (a transient), and its bytes in the file."""

    dense_vram: list[int]
    expert_planes: list[list[int]]
    expert_ram: list[int]
    cold_staging: int
    read_bytes: int
    # per layer, what makes its experts' stacks alike (memory.vram.expert_layout; () for a
    # layer without experts); empty: layers alike where their planes are
    layouts: list[tuple] = dataclasses.field(default_factory=list)

    @property
    def expert_vram(self) -> list[int]:
        return [sum(p) for p in self.expert_planes]

    def slots_vram(self, slots: list[int], n_experts: int) -> int:
        """VRAM of every layer's slot stacks, the allocator's rounding included."""
        return sum(slot_stack_bytes(p, v, n_experts) for p, v in zip(self.expert_planes, slots))


def expert_sizes(gf: GGUFFile, cfg: ModelConfig, cpu_precision: Precision,
                 fused: bool) -> ExpertSizes:
    """The sizes a split plan is made of; `cpu_precision`: the CPU side's (its packed copies
    at "fast"), `fused`: the GPU's scale layout (precision.fuse_scales)."""
    moe = [i for i in range(cfg.n_layers) if cfg.layer(i).n_experts]
    has = set(moe)
    return ExpertSizes(
        dense_vram=[layer_dense_vram_bytes(gf, cfg, i, fused) for i in range(cfg.n_layers)],
        expert_planes=[expert_planes(gf, cfg, i, fused) if i in has else []
                       for i in range(cfg.n_layers)],
        expert_ram=[expert_ram_bytes(gf, cfg, i, cpu_precision) if i in has else 0
                    for i in range(cfg.n_layers)],
        cold_staging=max(expert_ram_bytes(gf, cfg, i, cpu_precision)
                         + expert_file_bytes(gf, cfg, i)
                         + expert_dense_bytes(gf, cfg, i, cpu_precision) for i in moe),
        read_bytes=max(expert_file_bytes(gf, cfg, i) for i in moe),
        layouts=[expert_layout(gf, cfg, i) if i in has else () for i in range(cfg.n_layers)])


def staging_vram_bytes(sizes: ExpertSizes, cfg: ModelConfig, chunk: int,
                       slots: int = STAGING_SLOTS, slot_writes: int = 0) -> int:
    """VRAM of a split prefill's streaming (weights.expert_stream), held from the first
    prefill on: `slots` staging slots for each layout of expert among the layers (the
    runtime makes one staging per layout), a pass's (row, expert) pairs' outputs, float32,
    for a prefill chunk of `chunk` rows (Qwen3-30B-A3B at 512: 32 MiB), and the packing of
    STAGING_WRITE_ELEMENTS weights at a time into a slot, less the swaps' `slot_writes`
    reserved already (memory.vram's "expert slot writes": swaps run in decode, never beside a
    prefill's writes, so the larger of the two is reserved)."""
    keys = sizes.layouts or [tuple(p) for p in sizes.expert_planes]
    first: dict[tuple, list[int]] = {}
    for key, planes in zip(keys, sizes.expert_planes):
        if planes:
            first.setdefault(key, planes)
    if not first:
        return 0
    stacks = sum(alloc_bytes(slots * p) for planes in first.values() for p in planes)
    writes = max((write_transient(q, min(rows, max(1, STAGING_WRITE_ELEMENTS // cols)), cols)
                  for layout in sizes.layouts for q, rows, cols, _ in layout), default=0)
    return stacks + alloc_bytes(chunk * cfg.n_experts_used * cfg.hidden * 4) \
        + max(writes - slot_writes, 0)


def spread(total: int, layers: list[int], n_layers: int, most: int) -> list[int]:
    """`total` units over `layers` evenly, the first ones taking the remainder one each, at
    most `most` a layer; 0 for the layers not listed."""
    out = [0] * n_layers
    m = len(layers)
    for j, i in enumerate(layers):
        out[i] = min(most, total // m + (1 if j < total % m else 0))
    return out


def plan_expert_split(sizes: ExpertSizes, cfg: ModelConfig, reserve: dict[str, int],
                      budget: int, ram_budget: int | None, span_bytes: list[int],
                      name: str = "the model") -> Plan:
    """The split plan at `budget` bytes of VRAM (for torch's allocator) and `ram_budget` of
    RAM (None: unlimited), with the engine's VRAM `reserve` by part (memory.vram.vram_reserve
    without graph pools, experts packed one at a time)."""
    n, n_experts = cfg.n_layers, cfg.n_experts
    per_expert = sizes.expert_vram
    moe = [i for i in range(n) if per_expert[i]]
    dense_layers = sum(sizes.dense_vram)
    fixed = sum(reserve.values())
    dense = dense_layers + fixed
    if budget < dense:
        raise BudgetTooSmall(
            f"{name}: a {fmt_bytes(budget)} VRAM budget cannot hold this mixture of experts' "
            f"dense part: it needs at least {fmt_bytes(dense)} ({budget} < {dense} bytes: "
            f"attention, norms, routers and shared experts of {n} layers "
            f"{fmt_bytes(dense_layers)}, KV cache, head, embedding and workspaces "
            f"{fmt_bytes(fixed)}) before any expert is held in VRAM; raise --vram-budget or "
            f"lower --ctx")
    vram_slots = spread((budget - dense) // max(per_expert), moe, n, n_experts)
    # the stacks' rounding (2 MiB per plane of 10 MiB or more, the map): a slot less where
    # they overflow, from the layers holding the most
    while sum(vram_slots) and dense + sizes.slots_vram(vram_slots, n_experts) > budget:
        most = max(moe, key=lambda i: (vram_slots[i], i))
        vram_slots[most] -= 1
    rest = [n_experts - v if i in moe else 0 for i, v in enumerate(vram_slots)]
    if ram_budget is None:
        ram_slots = rest
    else:
        room = max(ram_budget - sizes.cold_staging, 0) // max(sizes.expert_ram)
        # even over the layers, then what a full layer could not take to the others
        ram_slots = [0] * n
        left = [i for i in moe if rest[i]]
        while room and left:
            share = spread(room, left, n, n_experts)
            take = {i: min(share[i], rest[i] - ram_slots[i]) for i in left}
            for i, k in take.items():
                ram_slots[i] += k
            room -= sum(take.values())
            left = [i for i in left if ram_slots[i] < rest[i]]
            if not sum(take.values()):
                break
    held = [d + slot_stack_bytes(p, v, n_experts)
            for d, v, p in zip(sizes.dense_vram, vram_slots, sizes.expert_planes)]
    return Plan("cuda", ["vram"] * n, held, span_bytes, fixed, budget, 0,
                ram_budget=ram_budget, reserve=dict(reserve), graphs=False,
                expert_slots=ram_slots, n_experts=n_experts, expert_bytes=max(sizes.expert_ram),
                expert_read_bytes=sizes.read_bytes,
                expert_layers=tuple(moe) if len(moe) < n else (),
                vram_expert_slots=vram_slots, expert_vram_bytes=max(per_expert))
