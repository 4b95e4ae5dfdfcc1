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
GPU_MARGIN = 1 << 30  # activations, graph pools, allocator slack on the GPU


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
        # Kernel-packed weights run up to ~4% over GGUF size (K-quant scales kept as bytes).
        packed = [int(r * 1.04) for r in resident]
        largest = max(t.n_elements for t in gf.tensors.values() if len(t.shape) == 2)
        workspace = 2 * largest  # fp16 prefill dequant scratch for the largest weight
        # (the GPU slots are added by plan_layers as its staging buffers)
        fixed_gpu = int(head_bytes * 1.04) + kv + workspace + GPU_MARGIN
        plan = plan_layers("cuda", packed, file_bytes, fixed_gpu, vram_budget,
                           staging_buffers=2, names=("vram", "pinned"))
        pinned = sum(packed[i] for i in plan.streamed_layers)
        if ram_budget is not None and pinned > ram_budget:
            raise BudgetTooSmall(
                f"{len(plan.streamed_layers)} layers ({fmt_bytes(pinned)}) must stream from "
                f"pinned RAM but --ram-budget is {fmt_bytes(ram_budget)}; streaming from disk "
                f"to the GPU is not implemented yet: raise --ram-budget or --vram-budget")
        return plan
    return plan_layers("cpu", resident, file_bytes, fixed, ram_budget)


def measure_bandwidths(gf: GGUFFile, plan: Plan, io: str) -> None:
    """Fill plan.bandwidth_gbps with what this machine does now: RAM read (a large sum) and,
    when layers stream, a read of the streamed spans through the chosen I/O path."""
    import time

    from ..runtime.bench import h2d_pinned_gbps, memory_read_gbps
    from .disk import AlignedBuffer, DirectReader

    if plan.device == "cuda":
        plan.bandwidth_gbps["vram"] = memory_read_gbps(torch.device("cuda"), 1 << 30)
        plan.bandwidth_gbps["pinned"] = h2d_pinned_gbps()
        return
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


def pin_streamed_layers(gf: GGUFFile, cfg: ModelConfig, device: torch.device, weight_dtype,
                        plan: Plan) -> dict:
    """CUDA tier B: build each streamed layer once on the GPU and keep its image in pinned RAM.

    Runs before the resident layers load, so the transient GPU copy of the layer being built
    never sits on top of the resident model: the peak VRAM stays the steady-state one."""
    if plan.device != "cuda" or not plan.streamed_layers:
        return {}
    from rich.progress import BarColumn, DownloadColumn, Progress

    from ..weights.linear import Workspace
    from ..weights.loader import TensorSource
    from .gpu_stream import to_image

    builder = LayerBuilder(cfg, device, weight_dtype, workspace=Workspace(device))
    images = {}
    total = sum(plan.resident_bytes_per_layer[i] for i in plan.streamed_layers)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  transient=True) as bar:
        task = bar.add_task("pinning streamed layers", total=total)
        for i in plan.streamed_layers:
            images[i] = to_image(builder.build(TensorSource(gf), i))
            bar.advance(task, plan.resident_bytes_per_layer[i])
    del builder
    torch.cuda.empty_cache()
    return images


def make_store(gf: GGUFFile, cfg: ModelConfig, device: torch.device, weight_dtype, weights,
               plan: Plan, io: str, delay=None, images: dict | None = None):
    if io not in IO_MODES:
        raise BadArgument(f"--io {io!r} is not supported; choose from {', '.join(IO_MODES)}")
    if plan.device == "cuda":
        if not plan.streamed_layers:
            return ResidentLayerStore(weights.layers)
        from .gpu_stream import PinnedLayerStore

        # the streamed layers share the resident layers' prefill workspace
        return PinnedLayerStore(weights.layers, images or {}, device,
                                weights.output.workspace, n_slots=plan.staging_buffers,
                                delay=delay or 0)
    if not plan.disk_layers:
        return ResidentLayerStore(weights.layers)
    builder = LayerBuilder(cfg, device, weight_dtype)
    if io == "mmap":
        return MmapLayerStore(gf, builder, weights.layers)
    return DiskLayerStore(gf, builder, weights.layers, n_buffers=plan.staging_buffers, io=io,
                          delay=delay)
