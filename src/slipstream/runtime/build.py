"""What `load()` and `plan()` do under the public API: open a model's file, plan its tiers
within the budgets, and build its engine (weights, stores, stages) from the plan."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from .. import envs
from ..errors import (BadArgument, BudgetTooSmall, SlipstreamError, SlipstreamWarning,
                      UnsupportedArchitecture, UnsupportedTensorType)
from ..hub.pull import resolve
from ..hub.store import cache_dir
from ..hybrid.host_io import HostIO
from ..hybrid.plan import parse_hybrid, plan_hybrid
from ..hybrid.policy import HybridSplit
from ..hybrid.probe import clear_weights, cpu_packed_gbps
from ..memory.budget import fmt_bytes, mem_available, parse_size
from ..memory.cuda_context import outside_allocator_bytes
from ..memory.devices import per_device_budgets, resolve_devices, stage_ranges
from ..memory.layer_reads import staged_sources
from ..memory.planner import Plan, StagePlan
from ..memory.probes import h2d_pinned_gbps
from ..memory.resident_image import attach_resident_image, image_wanted
from ..memory.setup import (check_io, disk_images, make_store, measure_bandwidths,
                            pin_streamed_layers, plan_for)
from ..model.families import family_for
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..modelfile.tokenizer_cache import is_cached, load_tokenizer
from ..precision import Precision
from ..weights import load_weights
from ..weights.file_bytes import read_ahead
from ..weights.expert_stream import StreamRates
from ..weights.split_build import SplitPlacement
from .engine import GRAPH_BUCKET, PREFILL_CHUNK, Engine
from ..load_clock import LoadClock, maybe
from .stage import Stage
from ..threads import default_threads, threads_given

DEFAULT_MAX_CTX = 4096  # the KV cache is preallocated, so the default does not take 128k

_stream_delay = None  # testing only: see injected_stream_delay


@contextmanager
def injected_stream_delay(delay) -> Iterator[None]:
    """Testing only: every model loaded inside the block streams with `delay` injected, a
    memory.StreamDelays, a callable run in reader threads before each read, or an int of GPU
    cycles to stall the copy stream at random before each copy; the streamed output must stay
    bit-identical to the resident output under it."""
    global _stream_delay
    before, _stream_delay = _stream_delay, delay
    try:
        yield
    finally:
        _stream_delay = before


def resolve_path(path: str | os.PathLike[str] | None, progress: bool) -> Path:
    """A model's file from what `-m` takes (pull.resolve): an existing file as it is; else a
    cached name, USER/REPO/FILE.gguf or a URL, pulled if the cache lacks it; None: the default
    model."""
    if path is not None and Path(path).is_file():
        return Path(path)
    return resolve(None if path is None else str(path), quiet=not progress)


def open_model(path, progress: bool) -> tuple[Path, GGUFFile, ModelConfig]:
    model_path = resolve_path(path, progress)
    gf = GGUFFile.open(model_path)  # a parse the CLI made of it already, where there is one
    return model_path, gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors),
                                                     source=model_path.name)


def start_reading(gf: GGUFFile, dev: torch.device, ram_budget, private: bool | None) -> None:
    """Start reading a CPU model's tensor data into private memory (weights.file_bytes.read_ahead) where
    its load will read it whole: on the CPU, with private weights (None: the CPU's default),
    and far within RAM (a quarter of MemAvailable, half of a RAM budget), where the plan keeps
    every layer resident. The read then goes on beside the tokenizer's build. Anything else,
    or a budget that does not parse (reported by the plan, in its turn), reads nothing now."""
    if dev.type != "cpu" or private is False:
        return
    size = sum(t.n_bytes for t in gf.tensors.values())
    try:
        budget = parse_size(ram_budget)
    except SlipstreamError:
        return
    if 4 * size > mem_available() or (budget is not None and 2 * size > budget):
        return
    read_ahead(gf)


def tokenizer_beside(gf: GGUFFile, dev: torch.device) -> Future:
    """The model's tokenizer (built once per file, then read from the cache): on CUDA, read
    from the cache in a thread beside the load (0.6-1.2 s for a 128k-token vocabulary, most of
    it in the tokenizers library, which lets the load's Python go on); built here where there
    is no entry yet, so that a file whose tokenizer cannot be built fails before its weights
    load. On the CPU here too: its load's packing takes both cores of a small machine."""
    folder = cache_dir() / "tokenizers"
    if dev.type == "cuda" and is_cached(gf, folder):
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-tokenizer")
        try:
            return pool.submit(load_tokenizer, gf, folder)
        finally:
            pool.shutdown(wait=False)
    done: Future = Future()
    done.set_result(load_tokenizer(gf, folder))
    return done


def context_size(cfg: ModelConfig, ctx: int | None) -> int:
    n_ctx = min(cfg.context_length, DEFAULT_MAX_CTX) if ctx is None else int(ctx)
    if n_ctx <= 0:
        raise BadArgument(f"ctx={n_ctx} is invalid: the context must hold at least one token")
    return n_ctx


def check_skip_layers(cfg: ModelConfig, k, what: str = "skip_layers") -> None:
    most = max(cfg.n_layers - 2, 0)  # the first and last layers are never skipped
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise BadArgument(f"{what}={k!r} is invalid: between 0 and {most} for a model of "
                          f"{cfg.n_layers} layers (never the first or the last)")


def allocator_budget(vram: int | None, dev: torch.device) -> tuple[int | None, int]:
    """A VRAM budget is what the driver counts for the process: what is left of it for torch's
    allocator once the CUDA context is counted (memory.cuda_context), and that context."""
    if vram is None or dev.type != "cuda":
        return vram, 0
    outside = outside_allocator_bytes(dev)
    if vram <= outside:
        raise BudgetTooSmall(f"a {fmt_bytes(vram)} VRAM budget does not cover the CUDA context "
                             f"({fmt_bytes(outside)} outside torch's allocator); raise "
                             f"--vram-budget")
    return vram - outside, outside


def plan_model(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, precision: Precision,
               ctx: int, ram_budget, vram_budget: int | None, io: str, gpu_slots: int,
               vram_layers: int | None = None, stream_first: list[int] | None = None,
               stage: StagePlan | None = None) -> Plan:
    """The one planning path of `load` and `plan` (stage: a pipeline process's own)."""
    check_io(io, dev)
    if vram_layers is not None and (isinstance(vram_layers, bool)
                                    or not isinstance(vram_layers, int) or vram_layers < 0):
        raise BadArgument(f"vram_layers={vram_layers!r} is invalid: must be an integer >= 0 "
                          f"(the most layers held in VRAM)")
    check_experts_device(cfg, dev)
    if cfg.n_experts and dev.type == "cuda" and stage is not None:
        raise UnsupportedArchitecture(
            f"{gf.path.name}: a mixture-of-experts model runs on CUDA in one process (every "
            f"expert in its VRAM); pipeline stages of one are not built yet")
    check_types_device(gf, dev)
    plan = plan_for(gf, cfg, dev, precision, ctx, parse_size(ram_budget), vram_budget, io,
                    gpu_slots, prefill_chunk=PREFILL_CHUNK, graph_bucket=GRAPH_BUCKET,
                    vram_layers=vram_layers, stream_first=stream_first, stage=stage)
    if cfg.n_experts and plan.streamed_layers:
        raise UnsupportedArchitecture(
            f"{gf.path.name}: the plan streams {len(plan.streamed_layers)} of its "
            f"{cfg.n_layers} layers, and a mixture-of-experts model runs resident only: "
            f"placing its experts across RAM and disk is not built yet; give a RAM budget "
            f"that holds the whole model")
    return plan


def check_experts_device(cfg: ModelConfig, dev: torch.device) -> None:
    """A mixture-of-experts model runs on the CPU, or on CUDA where SLIPSTREAM_CUDA_MOE=1:
    every expert in VRAM (weights.routed_experts), or, where the VRAM budget holds the dense
    part but not every expert, the experts split between VRAM slots and the CPU
    (memory.expert_split_plan, weights.split_experts; a budget short of the dense part is
    refused with both numbers). That path's kernels are tested in Triton's interpreter
    against gguf-py's dequantization, and it stays opt-in until it has run on a GPU. Not
    covered on CUDA, each with its own error: whole layers streamed (vram_layers, memory.
    setup), pipeline stages (plan_model), CUDA graphs of a split layer (weights.
    split_experts). A family whose CUDA path is refused (Family.cuda_refused) runs on the CPU
    only."""
    if dev.type == "cpu":
        return
    if cfg.n_experts and dev.type != "cuda":
        raise UnsupportedArchitecture(
            f"{cfg.architecture} with {cfg.n_experts} experts runs on the CPU or CUDA only "
            f"(placing mixture-of-experts layers on {dev} is not built); use --device cpu")
    refused = family_for(cfg.architecture).cuda_refused
    if refused:
        raise UnsupportedArchitecture(
            f"{cfg.architecture} runs on the CPU only for now ({refused}); use --device cpu")
    if cfg.n_experts and not envs.get("SLIPSTREAM_CUDA_MOE"):
        raise UnsupportedArchitecture(
            f"{cfg.architecture} with {cfg.n_experts} experts runs on the CPU by default: its "
            f"CUDA path (every expert in VRAM) has not yet run on a GPU; use --device cpu, or "
            f"set SLIPSTREAM_CUDA_MOE=1 to try it")


def device_for_auto(gf: GGUFFile, cfg: ModelConfig, dev: torch.device) -> torch.device:
    """What device="auto" computes on: the GPU it found, unless the model runs on the CPU only
    there (a family or a mixture of experts whose CUDA path is refused, a format without a GPU
    kernel), then the CPU, with a warning that says why; `--device cpu` runs such a model, so
    "auto" must not refuse it."""
    if dev.type != "cuda":
        return dev
    try:
        check_experts_device(cfg, dev)
        check_types_device(gf, dev)
    except (UnsupportedArchitecture, UnsupportedTensorType) as e:
        warnings.warn(f"running on the CPU: {e}", SlipstreamWarning, stacklevel=3)
        return torch.device("cpu")
    return dev


def check_types_device(gf: GGUFFile, dev: torch.device) -> None:
    """On CUDA the layers' weights and the head stay quantized, repacked for the GPU kernels
    (kernels.pack). They cover every format the CPU reads today; one the CPU reads and the
    kernels do not (a format added to quant/ first) is named here before the plan, whose VRAM
    sizes are those of the packed planes, with a pointer to the CPU. Every tensor counts, the
    embedding too: its rows would be dequantized on the GPU by code no GPU test has run for
    such a format."""
    if dev.type != "cuda":
        return
    from ..kernels.pack import SUPPORTED  # format tables only: no Triton, no CUDA
    from ..quant import supported_types

    missing = sorted({t.ggml_type for t in gf.tensors.values()} - set(SUPPORTED), key=int)
    if missing:
        names = ", ".join(t.name for t in missing)
        what = "tensor type" if len(missing) == 1 else "tensor types"
        if set(missing) <= set(supported_types()):
            raise UnsupportedTensorType(
                f"{gf.path.name}: {what} {names} has no GPU kernel yet (the CPU engine reads "
                f"it); load with device='cpu' (--device cpu)")
        raise UnsupportedTensorType(f"{gf.path.name}: {what} {names} is not supported")


def plain_plan(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, precision: Precision,
               ctx: int, ram_budget, vram_budget: int | None, io: str, gpu_slots: int,
               vram_layers: int | None) -> Plan | None:
    """The model's plan at these budgets without a draft (planned before the draft loads, so
    that an unset budget reads the same free VRAM), or None where that plan fails. The model
    planned beside the draft streams its streamed layers first (planner.plan_cuda), so
    that giving the draft up (Model.release_draft) brings back plain decode's own layout. On
    the H200 (70B at 24 GiB, 8B draft), promoting an even spread of the draft plan's layers
    instead left plain decode 7% under plain decode at the same budget without a draft, with
    one streamed layer more and the streamed ones spread otherwise."""
    try:
        return plan_model(gf, cfg, dev, precision, ctx, ram_budget, vram_budget, io,
                          gpu_slots, vram_layers)
    except BudgetTooSmall:
        return None


def hybrid_mode(hybrid: str | float, precision: str) -> str | float:
    """Placement.hybrid's value checked, with "auto" off at precision="exact" (see
    Placement)."""
    mode = parse_hybrid(hybrid)
    return "off" if mode == "auto" and precision == "exact" else mode


def with_hybrid(gf: GGUFFile, cfg: ModelConfig, plan: Plan, hybrid: str | float,
                threads: int | None) -> Plan:
    """The plan with its hybrid split, for a CUDA plan whose bandwidths are measured; the
    CPU's threads set."""
    if plan.device != "cuda" or hybrid == "off":
        return plan
    split = plan_hybrid(gf, cfg, plan, hybrid, threads)
    if split is not None:
        torch.set_num_threads(split.threads)
    return dataclasses.replace(plan, hybrid=split)


def measured(gf: GGUFFile, cfg: ModelConfig, plan: Plan, io: str, precision: Precision,
             hybrid: str | float, threads: int | None) -> Plan:
    """A plan that streams, with its links measured now and its hybrid split made; a plan
    that splits a mixture of experts with the CPU, with the links its prefill chooses by
    (weights.expert_stream.StreamRates): pinned copies up, and the CPU's expert kernel
    ("cpu experts": hybrid's probe of its Q4_K kernel on one row, the packed layout the
    CPU's experts take at "fast"; at "exact" they are float32 and slower, so a pass streams
    somewhat later than it could)."""
    if plan.vram_expert_slots is not None:
        # the copies' probe within the budget, as measure_bandwidths sizes it (the device
        # holds nothing else yet); no "vram" rate: a split plan's decode is the CPU's and the
        # GPU's together, which whole_layers_tok_s does not predict
        probe = max(min(256 << 20, (plan.budget or 1 << 33) // 8), 8 << 20)
        plan.bandwidth_gbps["pinned"] = h2d_pinned_gbps(probe)
        plan.bandwidth_gbps["cpu experts"], _ = cpu_packed_gbps(
            threads or torch.get_num_threads())
        clear_weights()  # the probe's weight (three last-level caches) not kept
        return plan
    if not plan.streamed_layers:
        return plan
    measure_bandwidths(gf, plan, io, cfg, precision)
    return with_hybrid(gf, cfg, plan, hybrid, threads)


def build_engine(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, plan: Plan, n_ctx: int,
                 precision: Precision, progress: bool, io: str,
                 private_weights: bool | None = None, pipeline=None,
                 auto_threads: bool = False, clock: LoadClock | None = None) -> Engine:
    """Load the planned model (its bandwidths measured and split made: `measured`): streamed
    tiers first, then the resident weights, the store and the engine. `auto_threads` (no
    thread count given) on CPU: torch's threads are set to the physical cores
    (threads.default_threads), before anything is built. `clock` times the phases."""
    if auto_threads and dev.type == "cpu" and not threads_given():
        torch.set_num_threads(default_threads())
    resident = {i for i, t in enumerate(plan.tiers) if t in ("ram", "vram")}
    # CUDA tiers B and C are built first, while the GPU holds nothing else, so the transient
    # GPU copy of the layer being built never sits on top of the resident model (on CPU:
    # the "packed" layers' images and the disk layers' image file).
    images, split = pin_streamed_layers(gf, cfg, dev, precision, plan,
                                        HybridSplit.of(plan, cfg, dev), clock)
    with maybe(clock, "disk images"):
        disk = disk_images(gf, cfg, dev, precision, plan, progress)
    with maybe(clock, "resident weights"):
        weights = load_weights_with_progress(gf, cfg, dev, precision, progress, resident,
                                             plan.embed_on_host, private_weights, plan)
    if dev.type == "cpu" and precision.cpu_packed_decode and \
            image_wanted(Path(gf.path), envs.get("SLIPSTREAM_CPU_IMAGE")):
        # the packed decode copies from the image cached beside the model (written now where
        # missing), instead of packed again at the first decode step
        with maybe(clock, "packed CPU image"):
            weights.packed_image = attach_resident_image(gf, weights.layers, weights.output,
                                                         cfg.n_layers, precision, progress)
    with maybe(clock, "store and stages"):
        if dev.type == "cuda":
            # Give load-time transients back, so the run's own peak starts from the steady
            # state (memory.vram reserves the larger of the two, not their sum).
            torch.cuda.empty_cache()
        store = make_store(gf, cfg, dev, precision, weights, plan, io, _stream_delay, images,
                           disk, split)
        if weights.experts is not None:  # cold experts count hits and reads in the store's
            weights.experts.stats = store.stats
        # one stage per planned stage, all served by the store
        stages = [Stage.build(cfg, torch.device(st.device) if st.device != dev.type else dev,
                              st.layers, store, n_ctx, precision.kv_dtype,
                              weights.rope_freqs_for(n_ctx))
                  for st in plan.stages]
    if pipeline is not None:
        from .pipeline import PipelineEngine  # torch.distributed: only a pipeline loads it

        return PipelineEngine(cfg, weights, stages, precision.act_dtype,
                              prefill_chunk=plan.prefill_chunk or PREFILL_CHUNK,
                              layers=plan.stages[0].layers, pipeline=pipeline)
    return Engine(cfg, weights, stages, precision.act_dtype,
                  use_graphs=None if plan.graphs else False,
                  prefill_chunk=plan.prefill_chunk or PREFILL_CHUNK)


def stage_devices(devices: Sequence[str | torch.device], vram_budget):
    """load(device=[...]): the device the stages run on, its VRAM budget, and the devices one
    stage each. One process runs its stages on one device today: the hidden state's hand-over
    from GPU to GPU and a store per GPU are not built, so distinct devices are refused."""
    devs = resolve_devices(devices)
    budgets = per_device_budgets(vram_budget, len(devs))
    distinct = sorted({str(d) for d in devs})
    if len(distinct) > 1:
        raise BadArgument(f"stages on {len(distinct)} devices ({', '.join(distinct)}) are not "
                          f"supported yet: give the same device for each stage, e.g. "
                          f"--devices cpu,cpu")
    # one device, a budget per stage: together, the device's
    sizes = [parse_size(b) for b in budgets]
    budget = None if any(b is None for b in sizes) else sum(sizes)
    return devs[0], budget, devs


def stage_plans(cfg: ModelConfig, devices: list[torch.device]) -> list[StagePlan]:
    """One StagePlan per device, over contiguous layer ranges: the embedding on the first, the
    head on the last."""
    ranges = stage_ranges(cfg.n_layers, len(devices))
    last = len(devices) - 1
    return [StagePlan(dev.type, layers, holds_embedding=k == 0, holds_head=k == last)
            for k, (dev, layers) in enumerate(zip(devices, ranges))]


def load_weights_with_progress(gf, cfg, dev, precision: Precision, show: bool,
                               resident: set[int] | None = None, embed_on_host: bool = False,
                               private: bool | None = None, plan: Plan | None = None):
    total = sum(t.n_bytes for t in gf.tensors.values())
    # on stderr: stdout carries the generated text, which may be piped
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), disable=not show, transient=True,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(f"loading {gf.path.name}", total=total)
        return load_weights(gf, cfg, dev, precision,
                            progress=lambda n: bar.advance(task, n), resident_layers=resident,
                            embed_on_host=embed_on_host, private=private,
                            scratch_elements=plan.scratch_elements if plan else None,
                            fuse_scales=plan.fuse_scales if plan else True,
                            head_dense_on_demand=plan.head_dense_on_demand if plan else False,
                            flat_layers=plan.flat_layers if plan else False,
                            holds_embedding=plan.stages[0].holds_embedding if plan else True,
                            holds_head=plan.stages[-1].holds_head if plan else True,
                            expert_slots=plan.expert_slots
                            if plan and plan.vram_expert_slots is None else None,
                            expert_split=split_placement(plan),
                            # a CUDA load's layers read into locked staging beside the builds
                            layer_sources=functools.partial(staged_sources, gf, device=dev)
                            if dev.type == "cuda" else None)


def split_placement(plan: Plan | None) -> SplitPlacement | None:
    """A CUDA plan's experts split between VRAM slots and the CPU (memory.expert_split_plan),
    as the loader takes it, with the dense hybrid's hand-off to the CPU's worker; None where
    the plan splits none."""
    if plan is None or plan.vram_expert_slots is None:
        return None
    gbps = plan.bandwidth_gbps
    # unmeasured (a plan not through `measured`): prefill's experts stay the CPU's
    rates = StreamRates(gbps["pinned"], gbps["cpu experts"]) \
        if "pinned" in gbps and "cpu experts" in gbps else None
    return SplitPlacement(plan.vram_expert_slots, plan.expert_slots,
                          lambda dev, hidden: HostIO(dev, hidden, max_tokens=1), rates)
