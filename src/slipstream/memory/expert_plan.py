"""The CPU plan of a mixture of experts whose budget does not hold every expert: the unit of
placement is an expert, not a layer.

The dense part stays resident whatever the budget: every layer's attention, norms and router,
the embedding, the head and the KV cache (the plan's fixed part), and room to read and build
one cold expert. A budget below that fails with BudgetTooSmall, giving both numbers. What is
left holds whole experts, spread evenly over the layers (a token passes every layer, and an
even spread gives each layer the same share of its most used experts; the first layers take
the remainder, one each; a leading dense layer holds none). The other experts stay in the
GGUF file and are read when a token routes to them (weights.expert_tiers, which also decides
which experts fill a layer's slots).
Every layer keeps the tier "ram": no layer streams whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BudgetTooSmall
from ..model.families import spec_for
from ..model.layer_spec import EMBEDDING
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..precision import Precision
from ..weights.cpu import packed_nbytes
from .budget import fmt_bytes
from .planner import Plan


@dataclass(frozen=True)
class ExpertProjection:
    """One projection (gate, up or down) of layer i's experts as stored: its tensor, GGML
    type, rows and columns per expert, and the file bytes it takes per expert."""

    tensor: str
    ggml_type: object
    rows: int
    cols: int
    nbytes: int


def expert_projections(gf: GGUFFile, cfg: ModelConfig, i: int) -> list[ExpertProjection]:
    """Layer i's experts' gate, up and down projections, from three 3-D tensors or from
    gate_up's halves and down (model.layer_spec.ExpertSpec.parts)."""
    spec = spec_for(cfg.architecture, cfg.n_experts).experts
    assert spec is not None
    out = []
    for part in spec.parts(cfg.fused_experts):
        info = gf.tensors[f"blk.{i}.{part.tensor}.weight"]
        rows, cols = (int(n) for n in info.shape[-2:])
        out.append(ExpertProjection(f"blk.{i}.{part.tensor}.weight", info.ggml_type,
                                    part.rows(rows), cols,
                                    info.n_bytes // cfg.n_experts // part.halves))
    return out


def expert_ram_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, precision: Precision) -> int:
    """RAM one expert of layer i takes once built (as memory.setup.layer_resident_bytes counts
    a layer's): its GGUF bytes, which its linears keep (a dense weight is made from them per
    call that needs one, and dropped), plus its packed decode copies at
    precision.cpu_packed_decode."""
    total = 0
    for proj in expert_projections(gf, cfg, i):
        total += proj.nbytes
        if precision.cpu_packed_decode:
            total += packed_nbytes(proj.ggml_type, (proj.rows, proj.cols)) or 0
    return total


def expert_dense_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, precision: Precision) -> int:
    """The dense weights one expert of layer i makes for a call (gate and up, then down, at
    precision.weight_dtype): a transient, one at a time."""
    bits = torch.finfo(precision.weight_dtype).bits
    return sum(p.rows * p.cols * bits // 8 for p in expert_projections(gf, cfg, i)[:2])


def expert_file_bytes(gf: GGUFFile, cfg: ModelConfig, i: int) -> int:
    """Bytes one cold expert of layer i reads from the file."""
    return sum(p.nbytes for p in expert_projections(gf, cfg, i))


def plan_experts(gf: GGUFFile, cfg: ModelConfig, precision: Precision, resident: list[int],
                 span_bytes: list[int], fixed: int, budget: int) -> Plan:
    """The plan at `budget` of a model whose layers, whole, take `resident` bytes each (memory.
    setup.layer_resident_bytes) beside `fixed` (head, KV cache: setup.cpu_fixed_bytes)."""
    n = cfg.n_layers
    # the layers with experts (a leading dense layer holds none: GLM-4.5, DeepSeek)
    moe = [i for i in range(n) if cfg.layer(i).n_experts]
    per_expert = [expert_ram_bytes(gf, cfg, i, precision) if i in moe else 0 for i in range(n)]
    dense_layers = [r - (cfg.n_experts * per_expert[i] if i in moe else 0)
                    for i, r in enumerate(resident)]
    embed = gf.tensors[EMBEDDING].n_bytes  # a private copy of its GGUF bytes
    # one cold expert read and built at a time, beside those held, and one dense weight
    # made for a call
    staging = max(per_expert) + max(expert_file_bytes(gf, cfg, i) for i in moe) + \
        max(expert_dense_bytes(gf, cfg, i, precision) for i in moe)
    dense = fixed + embed + sum(dense_layers) + staging
    if budget < dense:
        raise BudgetTooSmall(
            f"a {fmt_bytes(budget)} RAM budget cannot hold this mixture of experts' dense part: "
            f"it needs at least {fmt_bytes(dense)} ({budget} < {dense} bytes: attention, norms "
            f"and routers of {n} layers {fmt_bytes(sum(dense_layers))}, embedding "
            f"{fmt_bytes(embed)}, head and KV cache {fmt_bytes(fixed)}, one cold expert's read "
            f"and build {fmt_bytes(staging)}) before any expert is held; raise --ram-budget or "
            f"lower --ctx")
    total = (budget - dense) // max(per_expert)
    m = len(moe)
    slots = [0] * n
    for j, i in enumerate(moe):
        slots[i] = min(cfg.n_experts, total // m + (1 if j < total % m else 0))
    held = [d + s * e for d, s, e in zip(dense_layers, slots, per_expert)]
    return Plan("cpu", ["ram"] * n, held, span_bytes, fixed + embed + staging, budget, 0,
                expert_slots=slots, n_experts=cfg.n_experts, expert_bytes=max(per_expert),
                expert_read_bytes=max(expert_file_bytes(gf, cfg, i) for i in moe),
                expert_layers=tuple(moe) if m < n else ())
