"""From budgets to a running layer store: size each layer, plan the tiers, build the store."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import BadArgument, BudgetTooSmall
from ..gguf_file import GGUFFile
from ..weights.loader import LAYER_TENSORS, LayerBuilder, layer_span
from .budget import fmt_bytes
from .planner import Plan, plan_layers
from .store import DiskLayerStore, MmapLayerStore, ResidentLayerStore

IO_MODES = ("direct", "buffered", "mmap")


def layer_resident_bytes(gf: GGUFFile, i: int, weight_dtype: torch.dtype, device) -> int:
    """Memory a resident layer takes: dense weights on CPU, the GGUF bytes on CUDA."""
    total = 0
    for n in LAYER_TENSORS:
        info = gf.tensors.get(f"blk.{i}.{n}")
        if info is None:
            continue
        if device.type == "cuda" or len(info.shape) == 1:
            total += info.n_bytes if device.type == "cuda" else info.n_elements * 4
        else:
            total += info.n_elements * torch.finfo(weight_dtype).bits // 8
    return total


def plan_for(gf: GGUFFile, cfg: ModelConfig, device: torch.device, weight_dtype: torch.dtype,
             kv_dtype: torch.dtype, ctx: int, ram_budget: int | None,
             vram_budget: int | None) -> Plan:
    n = cfg.n_layers
    resident = [layer_resident_bytes(gf, i, weight_dtype, device) for i in range(n)]
    spans = [layer_span(gf, i) for i in range(n)]
    file_bytes = [e - s for s, e in spans]
    head = gf.tensors.get("output.weight") or gf.tensors["token_embd.weight"]
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * ctx * cfg.head_dim * \
        torch.finfo(kv_dtype).bits // 8
    head_bytes = head.n_bytes if device.type == "cuda" else \
        head.n_elements * torch.finfo(weight_dtype).bits // 8
    fixed = head_bytes + kv + cfg.hidden * 4
    if device.type == "cuda":
        plan = plan_layers("cuda", resident, file_bytes, fixed, None)
        need = sum(resident) + fixed
        if vram_budget is not None and need > vram_budget:
            raise BudgetTooSmall(
                f"the model needs {fmt_bytes(need)} of VRAM resident (weights, head, KV cache "
                f"for --ctx {ctx}) but --vram-budget is {fmt_bytes(vram_budget)}; streaming "
                f"layers through the GPU is not implemented yet: raise the budget, lower "
                f"--ctx, or run on --device cpu with --ram-budget")
        plan.budget = vram_budget
        return plan
    return plan_layers("cpu", resident, file_bytes, fixed, ram_budget)


def measure_bandwidths(gf: GGUFFile, plan: Plan, io: str) -> None:
    """Fill plan.bandwidth_gbps with what this machine does now: RAM read (a large sum) and,
    when layers stream, a read of the streamed spans through the chosen I/O path."""
    import time

    from ..runtime.bench import memory_read_gbps
    from .disk import AlignedBuffer, DirectReader

    plan.bandwidth_gbps["ram"] = memory_read_gbps(torch.device("cpu"), 128 << 20)
    if not plan.disk_layers or io == "mmap":
        return
    spans = [layer_span(gf, i) for i in plan.disk_layers]
    reader = DirectReader(gf.path, io=io)
    buf = AlignedBuffer(max(e - s for s, e in spans) + 8192)
    try:
        total, t0 = 0, time.perf_counter()
        for s, e in spans:
            reader.read_span(buf, s, e).result()
            total += e - s
            if total >= 64 << 20:
                break
        plan.bandwidth_gbps["disk"] = total / (time.perf_counter() - t0) / 1e9
    finally:
        reader.close()
        buf.close()


def make_store(gf: GGUFFile, cfg: ModelConfig, device: torch.device, weight_dtype, weights,
               plan: Plan, io: str, delay=None):
    if io not in IO_MODES:
        raise BadArgument(f"--io {io!r} is not supported; choose from {', '.join(IO_MODES)}")
    if not plan.disk_layers:
        return ResidentLayerStore(weights.layers)
    builder = LayerBuilder(cfg, device, weight_dtype)
    if io == "mmap":
        return MmapLayerStore(gf, builder, weights.layers)
    return DiskLayerStore(gf, builder, weights.layers, n_buffers=plan.staging_buffers, io=io,
                          delay=delay)
