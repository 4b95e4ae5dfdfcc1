"""From budgets to a running layer store: size each layer, plan the tiers, build the store."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from contextlib import nullcontext

import torch

from ..modelfile.config import ModelConfig
from ..errors import BadArgument, BudgetTooSmall
from ..load_clock import LoadClock, maybe
from ..modelfile.gguf_file import GGUFFile
from ..model.families import file_spec
from ..model.layer_spec import head_tensor_name, kv_cache_bytes
from ..precision import Precision
from ..weights.cpu import kind_for, packed_nbytes, packed_prefill_on
from ..weights.cpu_image import cpu_image_of, image_nbytes
from ..weights.image import to_image
from ..weights.loader import LayerBuilder, layer_span, release_transients
from .budget import mem_available
from .cuda_store import CudaLayerStore, SplitPolicy
from .cuda_context import outside_allocator_bytes
from .devices import pad_stage_plan
from .image_file import build_cpu_images, build_images
from .kvikio_io import require_kvikio
from .layer_reads import staged_sources
from .pinned import PinAhead
from .probes import cpu_decode_rates, h2d_pinned_gbps, memory_read_gbps, span_read_gbps
from .expert_plan import plan_experts
from .expert_split_plan import expert_sizes, plan_expert_split, staging_vram_bytes
from .planner import Plan, StagePlan, plan_cuda, plan_layers
from .protocol import LayerStore
from .store import DiskLayerStore, MmapLayerStore, ResidentLayerStore, StreamDelays
from .vram import (alloc_bytes, extra_tensor_bytes, layer_flat_bytes, layer_image_bytes,
                   layer_vram_bytes, vram_reserve)

IO_MODES = ("direct", "buffered", "mmap", "kvikio")
N_SLOTS = 2  # GPU slots (default): one being computed on while the next one's copy lands
N_STAGING = 3  # tier C pinned staging buffers: one being copied while two are read
# CPU: staging buffers of the GGUF spans where streamed layers decode from packed images; only
# prefill reads those, and a prefill pass computes long enough per layer to hide one read
PREFILL_STAGING = 1
# Prefill scratch of streamed plans, in fp16 elements (128 MiB): a 70B's fused gate/up
# (470M elements) goes in row chunks, and the 0.75 GiB saved holds another layer and a half.
# A streamed prefill waits on the copies, not on the extra launches.
STREAMED_SCRATCH_ELEMENTS = 64 << 20
# Prefill chunk of streamed CUDA plans. A chunk's activations are reserved in VRAM (2 GiB for a
# 70B at 2048 tokens, memory.vram.activation_bytes); each chunk also streams every layer once,
# but at 512 tokens a pass is already bound by compute, not by the copies (on the H200 a 70B
# prefills 512 tokens in 0.45 s while its 38 streamed layers copy in 0.34 s, an 8B 56 ms
# against 36 ms), so smaller chunks cost no time and give their VRAM to layers.
STREAMED_PREFILL_CHUNK = 512
# What a streamed plan keeps unallocated beyond its counted parts, in resident layers. On the
# H200 a 70B planned at 24 GiB with none (45 layers) failed its first 512-token prefill with
# 23.54 GiB allocated and 0.47-0.57 GiB reserved but free only in holes between the loaded
# layers' small planes; 2.25 layers of slack (42 layers) then ran. Resident layers of streamed
# plans now take one buffer each (weights.image.flattened), which leaves no such holes; half a
# layer stays for the head's packing and the allocator's rounding.
STREAMED_SLACK_LAYERS = 0.5


def check_io(io: str, device: torch.device) -> None:
    """Fail early, before anything is loaded, on an I/O mode this setup cannot run."""
    if io not in IO_MODES:
        raise BadArgument(f"--io {io!r} is not supported; choose from {', '.join(IO_MODES)}")
    if io == "kvikio":
        if device.type != "cuda":
            raise BadArgument("--io kvikio reads into GPU memory and needs --device cuda")
        require_kvikio()


def layer_resident_bytes(gf: GGUFFile, i: int, precision: Precision) -> int:
    """RAM a resident layer takes on CPU: dense weights (norms and biases in float32), plus
    the packed decode copies of its matrices where precision.cpu_packed_decode makes them. A
    mixture of experts' 3-D expert tensors count their GGUF bytes instead of dense weights:
    an expert keeps its bytes and makes a dense weight only for a call that needs one
    (weights.experts)."""
    total = 0
    for name in file_spec(gf).names(i, gf.tensors):
        info = gf.tensors[name]
        bits = 32 if len(info.shape) == 1 else torch.finfo(precision.weight_dtype).bits
        held = info.n_bytes if len(info.shape) == 3 else info.n_elements * bits // 8
        total += held + _packed_bytes(info, precision)
    return total


def _packed_bytes(info, precision: Precision) -> int:
    """RAM of a tensor's packed decode copy (weights.cpu.PackedDecodeLinear; 0 where
    none is made). Counted per tensor: a fused group packs its parts' rows together, which
    pads less."""
    if len(info.shape) not in (2, 3) or not precision.cpu_packed_decode:
        return 0
    # a 3-D expert tensor (n_experts, rows, cols) packs expert by expert (weights.experts)
    experts = int(info.shape[0]) if len(info.shape) == 3 else 1
    rows, cols = (int(n) for n in info.shape[-2:])
    return experts * (packed_nbytes(info.ggml_type, (rows, cols)) or 0)


def head_decode_bytes(gf: GGUFFile, precision: Precision) -> int:
    """Bytes the head's decode matvec reads on CPU: its packed copy where one is made, else
    its dense weight."""
    head = gf.tensors[head_tensor_name(gf.tensors)]
    return _packed_bytes(head, precision) or \
        head.n_elements * torch.finfo(precision.weight_dtype).bits // 8


def default_ram_budget() -> int | None:
    """MemAvailable less a margin for the OS, the page cache and Python (None: unknown)."""
    avail = mem_available()
    return max(avail - max(4 << 30, avail // 10), 0) if avail else None


def check_gpu_slots(gpu_slots: int) -> None:
    """The ring needs a slot being computed on and one being filled."""
    if not isinstance(gpu_slots, int) or gpu_slots < 2:
        raise BadArgument(f"gpu_slots={gpu_slots!r} is invalid: the streaming ring needs at "
                          f"least 2 GPU slots (one computed on while the next is copied)")


def plan_for(gf: GGUFFile, cfg: ModelConfig, device: torch.device, precision: Precision,
             ctx: int, ram_budget: int | None, vram_budget: int | None, io: str = "direct",
             gpu_slots: int = N_SLOTS, *, prefill_chunk: int, graph_bucket: int,
             vram_layers: int | None = None,
             stream_first: Collection[int] | None = None,
             stage: StagePlan | None = None) -> Plan:
    """The plan of a model on one device: one stage of every layer (plan_stage); or, with
    `stage`, of that stage alone (a process of a pipeline, runtime.pipeline), its per-layer
    lists then indexed by layer with the other stages' layers in the tier "remote"
    (devices.pad_stage_plan).

    vram_layers (CUDA): hold at most this many layers in VRAM whatever the budget allows
    (the user's override of the plan, as llama.cpp's -ngl); the rest stream.
    stream_first (CUDA): layers that stream before any other, where layers stream
    (planner.plan_cuda).

    gpu_slots (CUDA): K, the slots of the ring streamed layers are copied into; more slots
    let copies run further ahead of compute, at one layer's VRAM each. prefill_chunk and
    graph_bucket: the engine's (runtime.engine.PREFILL_CHUNK, GRAPH_BUCKET), which size the
    CUDA reserve; the caller passes them because memory/ never imports runtime/."""
    check_gpu_slots(gpu_slots)
    whole = stage is None
    stage = StagePlan(device.type, range(cfg.n_layers)) if whole else stage
    plan = plan_stage(gf, cfg, stage, device, precision, ctx, ram_budget, vram_budget, io,
                      gpu_slots, prefill_chunk=prefill_chunk, graph_bucket=graph_bucket,
                      vram_layers=vram_layers, stream_first=stream_first)
    if not whole:
        plan = pad_stage_plan(plan, stage, cfg.n_layers)
    return plan


def plan_stage(gf: GGUFFile, cfg: ModelConfig, stage: StagePlan, device: torch.device,
               precision: Precision, ctx: int, ram_budget: int | None,
               vram_budget: int | None, io: str = "direct", gpu_slots: int = N_SLOTS, *,
               prefill_chunk: int, graph_bucket: int, vram_layers: int | None = None,
               stream_first: Collection[int] | None = None) -> Plan:
    """Tiers for the layers of one stage within its device's budgets. The fixed part counts
    the stage's own KV cache, and the embedding and head only where the stage holds them."""
    layers = stage.layers
    if ram_budget is None:
        ram_budget = default_ram_budget()
    spans = [layer_span(gf, i) for i in layers]
    file_bytes = [e - s for s, e in spans]
    if device.type == "cuda":
        plan = _plan_cuda(gf, cfg, stage, device, precision, ctx, ram_budget, vram_budget, io,
                          gpu_slots, prefill_chunk, graph_bucket, vram_layers, stream_first)
    else:
        plan = _plan_cpu(gf, cfg, stage, precision, ctx, ram_budget, file_bytes)
    return dataclasses.replace(plan, stages=[stage])


def _plan_cpu(gf: GGUFFile, cfg: ModelConfig, stage: StagePlan, precision: Precision,
              ctx: int, ram_budget: int | None, span_bytes: list[int]) -> Plan:
    """Resident layers hold their dense weights, and their packed decode copies at
    precision.cpu_packed_decode; so does the head. Where copies are made, a streamed layer
    moves its packed image per decode token (weights.cpu_image: the bytes its decode reads,
    nothing rebuilt), and per prefill pass that image too where it serves prefill
    (weights.cpu_image.prefills_from_image), else its GGUF span, through a ring of one buffer
    (memory.store.DiskLayerStore), which the plan holds either way.

    And where not every layer fits whole, layers are kept "packed": only their image in RAM
    (a quarter of the dense weights and copies of a Q4 layer), which is all a decode pass
    reads (and prefill, where the image serves it; else prefill rebuilds them from the file as
    a streamed layer). As many layers as fit
    are kept so, in order, since each is one less image read per token; the rest stream. Room
    left once every layer is packed makes the first ones whole again ("ram"), which saves
    their rebuilds in prefill. Such a plan also holds the head without its dense weight
    (head_dense_on_demand): its GGUF bytes instead, dequantized for the calls of more than
    GEMV_MAX_ROWS rows alone (all-logits passes: perplexity, speculation trees), while decode
    and a prompt's last row go through its packed copy."""
    layers = stage.layers
    resident = [layer_resident_bytes(gf, i, precision) for i in layers]
    head_bytes = head_decode_bytes(gf, precision) if stage.holds_head else 0
    fixed = cpu_fixed_bytes(gf, cfg, precision, ctx, stage)
    if cfg.n_experts and ram_budget is not None and len(layers) == cfg.n_layers and \
            not _holds_whole(resident, span_bytes, fixed, ram_budget):
        # a mixture of experts too large for the budget: experts in RAM or read from the
        # file, the rest resident (memory.expert_plan)
        plan = plan_experts(gf, cfg, precision, resident, span_bytes, fixed, ram_budget)
        return dataclasses.replace(plan, head_bytes=head_bytes)
    images = precision.cpu_packed_decode
    if images:
        moved = [image_nbytes(gf, cfg, i, precision) for i in layers]
        staging = PREFILL_STAGING * max(span_bytes, default=0)
        on_demand = head_dense_on_demand(gf, precision, stage)
        try:
            plan = plan_layers("cpu", resident, moved, fixed, ram_budget,
                               prefill_staging=staging)
            streams = bool(plan.disk_layers)
        except BudgetTooSmall:
            if not on_demand:
                raise
            streams = True  # too small even to stream with the dense head: try without
        if streams and on_demand:
            plan = plan_layers("cpu", resident, moved,
                               cpu_fixed_bytes(gf, cfg, precision, ctx, stage, True),
                               ram_budget, prefill_staging=staging)
            plan = dataclasses.replace(plan, head_dense_on_demand=True)
        if plan.disk_layers:
            plan = _keep_packed(plan, resident, moved)
    else:
        plan = plan_layers("cpu", resident, span_bytes, fixed, ram_budget)
    # head_bytes: one matvec over it per token (the CPU prediction)
    return dataclasses.replace(plan, cpu_images=images, head_bytes=head_bytes)


def _holds_whole(resident: list[int], span_bytes: list[int], fixed: int, budget: int) -> bool:
    """Whether a plain CPU plan keeps every layer resident at `budget` (plan_layers counts
    its staging buffers even then)."""
    try:
        return not plan_layers("cpu", resident, span_bytes, fixed, budget).streamed_layers
    except BudgetTooSmall:
        return False


def head_dense_on_demand(gf: GGUFFile, precision: Precision, stage: StagePlan | None = None
                         ) -> bool:
    """Whether a CPU plan that streams may hold the head without its dense weight: where it
    has a packed copy for decode (weights.loader.load_weights(head_dense_on_demand=...))."""
    holds = stage is None or stage.holds_head
    head = gf.tensors[head_tensor_name(gf.tensors)]
    return holds and precision.cpu_packed_decode and kind_for(head.ggml_type) is not None


def cpu_fixed_bytes(gf: GGUFFile, cfg: ModelConfig, precision: Precision, ctx: int,
                    stage: StagePlan | None = None, head_on_demand: bool = False) -> int:
    """RAM a CPU plan holds whatever its tiers: the KV cache of the stage's layers, the
    head where the stage holds it (dense weight and packed copy, or with `head_on_demand`
    its GGUF bytes and packed copy), and a row of activations."""
    layers = stage.layers if stage is not None else range(cfg.n_layers)
    kv = kv_cache_bytes(cfg, layers, ctx, torch.finfo(precision.kv_dtype).bits // 8)
    held = 0
    if stage is None or stage.holds_head:
        head = gf.tensors[head_tensor_name(gf.tensors)]
        dense = head.n_bytes if head_on_demand else \
            head.n_elements * torch.finfo(precision.weight_dtype).bits // 8
        held = dense + _packed_bytes(head, precision)
    if stage is None or stage.holds_embedding:  # Gemma 4's per-layer embedding tables
        held += extra_tensor_bytes(gf, cfg, table_on_host=False)
    return held + kv + cfg.hidden * 4


def _keep_packed(plan: Plan, whole: list[int], image: list[int]) -> Plan:
    """Re-tier a CPU plan that streams (see _plan_cpu): "packed" layers while their images
    fit, then "disk"; once every layer is packed, the first ones "ram" while the room left
    holds the rest of them (whole minus image)."""
    n = len(whole)
    room = plan.budget - plan.fixed_bytes - plan.staging_buffers * max(image) - \
        plan.prefill_staging
    tiers = []
    for b in image:
        if b <= room and (not tiers or tiers[-1] == "packed"):
            tiers.append("packed")
            room -= b
        else:
            tiers.append("disk")
    for i in range(n):
        if tiers[i] != "packed" or "disk" in tiers or whole[i] - image[i] > room:
            break
        tiers[i] = "ram"
        room -= whole[i] - image[i]
    return dataclasses.replace(plan, tiers=tiers, resident_bytes_per_layer=[
        b if t == "ram" else m for b, m, t in zip(whole, image, tiers)])


def _plan_cuda(gf: GGUFFile, cfg: ModelConfig, stage: StagePlan, device: torch.device,
               precision: Precision, ctx: int, ram_budget: int | None,
               vram_budget: int | None, io: str, gpu_slots: int, prefill_chunk: int,
               graph_bucket: int, vram_layers: int | None = None,
               stream_first: Collection[int] | None = None) -> Plan:
    """VRAM budget: what is free on the device now (capped by --vram-budget), less a reserve
    computed from the stage's shapes (memory.vram); stream_first in global layer indices.
    precision.fuse_scales (precision="fast") packs resident layers' scales fused
    (kernels.pack.fuse_scales), which changes their sizes."""
    fused = precision.fuse_scales
    free, _ = torch.cuda.mem_get_info(device)
    budget = free if vram_budget is None else min(vram_budget, free)
    vram = [layer_vram_bytes(gf, cfg, i, fused) for i in stage.layers]
    # streamed layers keep the GGUF layout whatever the precision (pack.f16_scales)
    image = [layer_image_bytes(gf, cfg, i) for i in stage.layers]
    kv_elem = torch.finfo(precision.kv_dtype).bits // 8
    per_stage = dict(graph_bucket=graph_bucket, kv_layers=stage.layers,
                     holds_embedding=stage.holds_embedding, holds_head=stage.holds_head)
    # CUDA graphs (and their pools) only serve a fully resident model: plan with their pools
    # first; if layers stream anyway (or only fit without the pools), plan without them.
    try:
        if vram_layers is not None and vram_layers < len(vram):
            raise BudgetTooSmall("the user holds fewer layers than the model's in VRAM")
        reserve = vram_reserve(gf, cfg, ctx, kv_elem, prefill_chunk, True, fused, **per_stage)
        plan = plan_cuda(vram, image, reserve, budget, ram_budget, gpu_slots, N_STAGING, io)
    except BudgetTooSmall:
        plan = None
    if cfg.n_experts and (plan is None or plan.streamed_layers):
        if vram_layers is not None and vram_layers < len(vram):
            _refuse_streamed_experts(vram_layers, len(vram))
        # the dense part in VRAM, the experts split between VRAM slots and the CPU
        reserve = vram_reserve(gf, cfg, ctx, kv_elem, prefill_chunk, False, fused,
                               stacked_experts=False, **per_stage)
        sizes = expert_sizes(gf, cfg, Precision.of(precision.name, torch.device("cpu")), fused)
        # a prefill's experts streamed to staging slots (weights.expert_stream)
        reserve["expert staging"] = staging_vram_bytes(
            sizes, cfg, min(prefill_chunk, ctx), slot_writes=reserve["expert slot writes"])
        return plan_expert_split(sizes, cfg, reserve, budget, ram_budget, image, gf.path.name)
    # Streamed plans give what they can to layers, since each resident layer is one less to
    # copy every token: the token embedding stays on the host (one row per token), resident
    # layers keep the GGUF scale layout as streamed ones do (the same results: QuantLinear),
    # each in one buffer, prefill dequantizes the largest weights in row chunks of a smaller
    # scratch, and runs prompts in chunks of STREAMED_PREFILL_CHUNK tokens.
    if plan is None or plan.streamed_layers:
        vram = [layer_flat_bytes(gf, cfg, i) for i in stage.layers]
        chunk = min(prefill_chunk, STREAMED_PREFILL_CHUNK)
        reserve = vram_reserve(gf, cfg, ctx, kv_elem, chunk, False, False,
                               embed_on_host=True, scratch_cap=STREAMED_SCRATCH_ELEMENTS,
                               **per_stage)
        reserve["allocator slack"] = int(STREAMED_SLACK_LAYERS * max(vram, default=0))
        first = None
        if stream_first is not None:  # global indices to the stage's own
            wanted = set(stream_first)
            first = [k for k, i in enumerate(stage.layers) if i in wanted]
        plan = plan_cuda(vram, image, reserve, budget, ram_budget, gpu_slots, N_STAGING, io,
                         vram_layers, first)
        plan = dataclasses.replace(plan, graphs=False, embed_on_host=True,
                                   fuse_scales=False, flat_layers=True,
                                   scratch_elements=STREAMED_SCRATCH_ELEMENTS,
                                   prefill_chunk=chunk)
    return plan


def expert_split_vram_budget(gf: GGUFFile, cfg: ModelConfig, precision: Precision, ctx: int,
                             experts_per_layer: int, *, prefill_chunk: int,
                             graph_bucket: int) -> int:
    """A VRAM budget (as the driver counts it: the CUDA context included) whose CUDA plan
    splits this mixture of experts with `experts_per_layer` experts in each layer's VRAM
    slots (memory.expert_split_plan), for tests and benchmarks that must split a small
    model: its all-VRAM plan's graph pools may cost more than half its experts."""
    fused = precision.fuse_scales
    kv_elem = torch.finfo(precision.kv_dtype).bits // 8
    reserve = vram_reserve(gf, cfg, ctx, kv_elem, prefill_chunk, False, fused,
                           stacked_experts=False, graph_bucket=graph_bucket)
    sizes = expert_sizes(gf, cfg, Precision.of(precision.name, torch.device("cpu")), fused)
    reserve["expert staging"] = staging_vram_bytes(
        sizes, cfg, min(prefill_chunk, ctx), slot_writes=reserve["expert slot writes"])
    slots = [experts_per_layer if p else 0 for p in sizes.expert_planes]
    return (sum(sizes.dense_vram) + sum(reserve.values()) + sizes.slots_vram(slots, cfg.n_experts)
            + outside_allocator_bytes(torch.device("cuda")))


def _refuse_streamed_experts(vram_layers: int, n_layers: int) -> None:
    """A mixture of experts runs on CUDA with every layer's dense part in VRAM (its experts
    split with the CPU where the budget is short: memory.expert_split_plan): streaming whole
    layers is not built for it."""
    raise BudgetTooSmall(
        f"vram_layers={vram_layers}: a mixture-of-experts model runs on CUDA with all "
        f"{n_layers} of its layers in VRAM (the experts that do not fit computed by the CPU); "
        f"streaming whole layers is not built for it (leave vram_layers unset, or use "
        f"--device cpu)")


def streamed_slack(plan: Plan) -> int:
    """The allocator slack a streamed CUDA plan of this model reserves, from a plan that may
    not stream (its own slack, if it has one, is not counted twice)."""
    if "allocator slack" in plan.reserve:
        return 0
    return int(STREAMED_SLACK_LAYERS * max(_flat_sizes(plan), default=0))


def _flat_sizes(plan: Plan) -> list[int]:
    """Each layer's VRAM resident in a streamed CUDA plan, from any CUDA plan of it: one
    buffer of its image (vram.layer_flat_bytes), whose size a CUDA plan holds as the bytes
    one streamed use moves."""
    return [alloc_bytes(n) for n in plan.file_bytes_per_layer]


def streamed_vram_budget(plan: Plan, resident_layers: int, slack: int = 1) -> int:
    """A VRAM budget whose plan holds `resident_layers` of this model's layers in VRAM and
    streams the rest, from any CUDA plan of it (a streamed plan reserves no graph pools,
    keeps the embedding on the host, holds each layer in one buffer and leaves the allocator
    its slack); `slack` bytes on top. A small model's streaming reserve costs more than its
    layers, so a budget stepped up from below reaches the all-resident plan first: tests and
    benchmarks that must stream a small model ask for a budget this way."""
    staging = plan.staging_buffers * max(plan.file_bytes_per_layer, default=0)
    fixed = plan.fixed_bytes - plan.reserve.get("CUDA graph pools", 0) \
        - plan.reserve.get("embedding", 0) + streamed_slack(plan)
    # a budget is what the driver counts: load takes the CUDA context out of it first
    context = outside_allocator_bytes(torch.device(plan.device)) if plan.device == "cuda" else 0
    return fixed + staging + sum(_flat_sizes(plan)[:resident_layers]) + slack + context


def measure_bandwidths(gf: GGUFFile, plan: Plan, io: str, cfg: ModelConfig | None = None,
                       precision: Precision | None = None) -> None:
    """Fill plan.bandwidth_gbps with what this machine does now: memory read (a large sum on
    CPU, a device copy on CUDA), pinned host-to-device copies (CUDA), and, when layers stream
    from disk, an O_DIRECT (or buffered) sequential read of the disk layers' file spans; on
    CPU with cfg and precision, also what a decode step costs per byte (probes.cpu_decode_rates:
    "compute", "gemv", and "rebuild", the CPU disk store dequantizing every streamed layer on
    every token), which the CPU prediction needs (Plan.cpu_token_seconds)."""
    if plan.device == "cuda":
        # probes sized within the budget: they run before the model loads, and the peak VRAM
        # must stay under the budget however small it is
        probe = max(min(1 << 30, (plan.budget or 1 << 33) // 8), 8 << 20)
        plan.bandwidth_gbps["vram"] = memory_read_gbps(torch.device("cuda"), probe)
        plan.bandwidth_gbps["pinned"] = h2d_pinned_gbps(min(256 << 20, probe))
        limit = 512 << 20
    else:
        plan.bandwidth_gbps["ram"] = memory_read_gbps(torch.device("cpu"), 128 << 20)
        limit = 64 << 20
        if cfg is not None and precision is not None:
            # a CPU token is bound by compute and by making its streamed layers (rebuilt, or
            # views into packed images): their rates, measured on the first streamed layer
            # (or the first layer)
            first = plan.stages[0].layers.start
            layer = first + (plan.disk_layers[0] if plan.disk_layers else 0)
            plan.bandwidth_gbps.update(cpu_decode_rates(
                gf, cfg, precision, layer, layer_resident_bytes(gf, layer, precision),
                head_decode_bytes(gf, precision)))
    if not plan.disk_layers or io == "mmap":
        return
    # the disk's rate on the layers' GGUF spans: a read of the same sizes from the same disk
    # as the packed images' (which are not written yet when a plan is made)
    spans = [layer_span(gf, i) for i in plan.disk_layers]
    plan.bandwidth_gbps["disk"], _ = span_read_gbps(
        gf.path, spans, "buffered" if io == "buffered" else "direct", limit)


def pin_streamed_layers(gf: GGUFFile, cfg: ModelConfig, device: torch.device,
                        precision: Precision, plan: Plan, split: SplitPolicy | None = None,
                        clock: LoadClock | None = None) -> tuple[dict, SplitPolicy | None]:
    """CUDA tier B: build each streamed layer once on the GPU and keep its image in pinned RAM.
    With `split` (hybrid decode's, hybrid.policy.HybridSplit), its layers are built in two FFN
    shares and the CPU's share is packed for the CPU. Returns (images, split; None where
    nothing was split). On CPU: the "packed" layers' images (packed_cpu_layers).

    Runs before the resident layers load, so the transient GPU copy of the layer being built
    never sits on top of the resident model: the peak VRAM stays the steady-state one.
    `clock` times the GPU builds, the pinned copies and the waits for the CPU's packing."""
    if plan.device == "cpu":
        return packed_cpu_layers(gf, cfg, precision, plan), None
    pinned = [i for i, t in enumerate(plan.tiers) if t == "pinned"]
    if plan.device != "cuda" or not pinned:
        return {}, None
    # rich, the terminal UI, is imported where a bar is drawn
    from rich.progress import BarColumn, DownloadColumn, Progress

    builder = LayerBuilder(cfg, device, precision, fuse_scales=False)
    splits = split.layers if split is not None else frozenset()
    images = {}
    total = sum(plan.file_bytes_per_layer[i] for i in pinned)
    # the CPU's shares are packed beside the GPU's building (split.packing)
    with split.packing(gf, cfg) if splits else nullcontext(), PinAhead(device) as ahead:
        with Progress("[progress.description]{task.description}", BarColumn(),
                      DownloadColumn(), transient=True) as bar:
            task = bar.add_task("pinning streamed layers" + (
                " and packing the CPU's share" if splits else ""), total=total)
            # read into locked staging where the model is dense (memory.layer_reads)
            for k, (i, src) in enumerate(staged_sources(gf, pinned, device)):
                with maybe(clock, "streamed layers: read and built on the GPU"):
                    built = (split.build_layer(builder, src, i) if i in splits
                             else builder.build(src, i))
                with maybe(clock, "streamed layers: copied to pinned RAM"):
                    images[i] = to_image(built, alloc=ahead.alloc(i in splits))
                del built
                if k + 1 < len(pinned):  # the next one's buffer locked beside its build
                    ahead.expect(pinned[k + 1] in splits)
                if i in splits:
                    with maybe(clock, "streamed layers: waiting for the CPU's packing"):
                        split.attach(i)
                release_transients(device)
                bar.advance(task, plan.file_bytes_per_layer[i])
    del builder
    torch.cuda.empty_cache()
    return images, split if splits else None


def packed_cpu_layers(gf: GGUFFile, cfg: ModelConfig, precision: Precision,
                      plan: Plan) -> dict[int, tuple]:
    """The CPU plan's "packed" layers: each built once and kept as its packed image (weights.
    cpu_image: (uint8 image, layout)) in RAM, which decode passes compute on as views."""
    return {i: cpu_image_of(gf, cfg, precision, i)
            for i, t in enumerate(plan.tiers) if t == "packed"}


def disk_images(gf: GGUFFile, cfg: ModelConfig, device: torch.device, precision: Precision,
                plan: Plan, progress: bool = False):
    """The disk layers' images, in a file (built now, or reused): CUDA tier C's repacked
    layers, or on CPU the packed decode copies (plan.cpu_images)."""
    if not plan.disk_layers:
        return None
    if plan.device == "cpu":
        if not plan.cpu_images:  # precision "exact": rebuilt from the GGUF file every pass
            return None
        return build_cpu_images(gf, cfg, precision, plan.disk_layers,
                                plan.file_bytes_per_layer, progress=progress)
    return build_images(gf, cfg, device, precision, plan.disk_layers,
                        plan.file_bytes_per_layer, progress=progress)


def make_store(gf: GGUFFile, cfg: ModelConfig, device: torch.device, precision: Precision,
               weights, plan: Plan, io: str, delay=None, images: dict | None = None,
               disk=None, split: SplitPolicy | None = None) -> LayerStore:
    """The plan's layer store: resident, or streaming (CUDA: CudaLayerStore, with hybrid
    decode's `split` where pin_streamed_layers made one; CPU: the disk or mmap store)."""
    check_io(io, device)
    delays = StreamDelays.of(delay)
    if plan.device == "cuda":
        if not plan.streamed_layers:
            return ResidentLayerStore(weights.layers)
        # the streamed layers share the resident layers' prefill workspace
        return CudaLayerStore(weights.layers, device, weights.output.workspace,
                              images=images or {}, disk=disk, io=io,
                              n_slots=plan.staging_buffers,
                              n_staging=plan.host_staging or N_STAGING, delays=delays,
                              split=split)
    if not plan.streamed_layers:
        return ResidentLayerStore(weights.layers)
    # a streamed layer rebuilt from its GGUF span serves prefill passes its packed image
    # (`disk`, or `images` for the "packed" layers, where there is one) does not: built as a
    # resident layer is, its packed copies made where its prefill takes them (packed prefill:
    # a layer mixing those with cb4's, iq's or torch's layouts, which prefill dense), else
    # dense only
    builder = LayerBuilder(cfg, device, dataclasses.replace(
        precision, cpu_packed_decode=precision.cpu_packed_decode and packed_prefill_on()))
    if io == "mmap":
        return MmapLayerStore(gf, builder, weights.layers, images=disk, packed=images)
    return DiskLayerStore(gf, builder, weights.layers, n_buffers=plan.staging_buffers, io=io,
                          delay=delays.reader, images=disk, packed=images,
                          gguf_buffers=PREFILL_STAGING if plan.cpu_images else None)
