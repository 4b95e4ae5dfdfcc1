"""The public Python API: `slipstream.load(...)` returns a `Model`.

    model = slipstream.load()                      # the default model, pulled if missing
    for event in model.generate("Once upon a time", max_tokens=32, seed=0):
        print(event.text, end="", flush=True)

A Model holds one KV cache, so it runs one generation at a time; the server queues requests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .modelfile.chat_template import ChatTemplate
from .modelfile.config import ModelConfig
from .errors import BadArgument, BudgetTooSmall, DeviceNotFound, oom_summary
from .modelfile.gguf_file import GGUFFile
from .memory.budget import fmt_bytes
from .memory.devices import resolve_device
from .precision import Precision
from .runtime.engine import GRAPH_BUCKET, PREFILL_CHUNK, Engine
from .runtime.generate import GenerationEvent, GenerationStats, autoregressive, generate
from .runtime.sampler import Sampler, SamplingParams
from .runtime.stage import Stage
from .modelfile.tokenizer import Tokenizer
from .weights import load_weights

DEFAULT_MAX_CTX = 4096  # the KV cache is preallocated, so the default does not take 128k
# VRAM a CUDA draft keeps beyond what it holds after its first graphs: the graphs of later
# context spans and level widths are captured as decoding reaches them, and the model planned
# after the draft would otherwise leave them no room (on the H200 they fell back to eager)
DRAFT_GRAPH_HEADROOM = 128 << 20


BadDevice = DeviceNotFound  # api's name for it before memory.devices checked every device


class Model:
    def __init__(self, path: Path, gguf: GGUFFile, config: ModelConfig, engine: Engine,
                 tokenizer: Tokenizer, template: ChatTemplate):
        self.path = path
        self.gguf = gguf
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.last_stats: GenerationStats | None = None
        self.plan = None  # memory.Plan: where each layer lives
        self.draft: Model | None = None  # load(draft=PATH): speculative decoding's draft
        # load(skip_layers=K): each layer's calibrated input/output cosine similarity
        self.layer_similarities: list[float] | None = None
        self._vram_cap = None  # memory.vram_cap.VramCap while the model holds a VRAM budget
        self.owns_resources = True  # False for a self-draft, which borrows the target's
        self._sizers: dict[int, object] = {}  # speculative tree sizers, one per draft engine
        # (draft file, layers made resident) once a draft that did not pay was released
        self.draft_released: tuple[str, list[int]] | None = None
        self.draft_release_s: float | None = None  # how long giving it up took
        self.pipeline_stages: list[dict] | None = None  # distributed: every rank's stage
        # CUDA, with a draft file: the layers the model streams when planned without the draft
        # (its own plan streams them and more), restored when the draft is given up, and how
        # much faster that plan predicts plain decode (what giving the draft up would win)
        self.plain_streamed: list[int] | None = None
        self.release_gain = 1.0
        self.closed = False

    def serve(self) -> None:
        """A --distributed pipeline's ranks after the first: compute this rank's stage of
        every pass rank 0 runs, until rank 0 closes its model (runtime.pipeline)."""
        serve = getattr(self.engine, "serve", None)
        if serve is None:
            raise BadArgument("serve() is for a model loaded with distributed=True")
        serve()

    def close(self) -> None:
        """Release what the model holds: its stores' reader threads, file descriptors, pinned
        buffers and GPU slots, its VRAM cap, and the file's memory map. Safe to call twice; the
        model cannot generate afterwards."""
        if self.closed:
            return
        self.closed = True
        if self.draft is not None:
            self.draft.close()
        if not self.owns_resources:  # a self-draft: what it uses is the target's
            self.engine.release()  # its own KV cache goes
            self.engine = None
            return
        stop = getattr(self.engine, "stop", None)  # a pipeline's rank 0: the others return
        if stop is not None:
            stop()
        stores = {id(st.store): st.store for st in self.engine.stages}  # stages may share one
        for store in stores.values():
            store.close()
        self.engine.release()
        if self._vram_cap is not None:
            self._vram_cap.release()
            self._vram_cap = None
        # the weights (the embedding table of a CPU model views the file's memory map) go with
        # the engine, so the map and its descriptor are released now, not at garbage collection
        self.engine = None
        self.gguf.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def ctx(self) -> int:
        return self.engine.ctx

    @property
    def skipped_layers(self) -> list[int]:
        """The layers the forward pass leaves out (load(skip_layers=K)), in order."""
        return sorted(self.engine.skip)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True
                 ) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids: Sequence[int], one_at_a_time: bool = False) -> torch.Tensor:
        """float32 (len(ids), vocab) logits for ids in a fresh context. one_at_a_time: feed
        the ids as decode steps, through the kernels generation uses (on CUDA the decode
        GEMVs, not the prefill matmuls), to measure what precision costs in generation."""
        self.engine.reset()
        if not one_at_a_time:
            return self.engine.forward(list(ids), all_logits=True).cpu()
        ids = list(ids)
        return torch.cat([self.engine.forward(ids[i:i + 1]) for i in range(len(ids))]).cpu()

    def generate(self, prompt_or_ids: str | Sequence[int], max_tokens: int = 256,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repeat_last_n: int = 64, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, draft: "Model | bool | None" = None,
                 spec_nodes: int | None = None, spec_depth: int | None = None,
                 spec_ahead: int | None = None) -> Iterator[GenerationEvent]:
        """Stream GenerationEvents (.id, .text, .finish_reason) for a prompt in a fresh context.

        draft: decode speculatively with this Model (same vocabulary) guessing trees that the
        model verifies in one pass each; the tokens follow the same distribution as plain
        decoding (speculative.rounds). None: the draft `load(draft=...)` loaded, if any;
        False: plain decoding. spec_nodes: the trees' node budget (the root included); None
        sizes each tree from the measured pass and draft costs and the acceptance so far
        (speculative.sizing), learned across this model's generations; spec_depth fixes the
        depth likewise (None: chosen, 0 included, i.e. a plain step). spec_ahead: draft levels
        grown past each verified tree, so that the next one may be grown already (None: none;
        speculative.rounds). last_stats.extra and `last_speculation` then hold the acceptance
        figures."""
        ids = (self.tokenize(prompt_or_ids) if isinstance(prompt_or_ids, str)
               else list(prompt_or_ids))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, seed=seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.last_stats = GenerationStats()
        sampler = Sampler(params, device=self.engine.device)
        return generate(self.engine, self.tokenizer, ids, sampler, max_tokens, stops,
                        stats=self.last_stats,
                        source=self._source(draft, spec_nodes, spec_depth, spec_ahead))

    def _source(self, draft: "Model | bool | None", nodes: int | None, depth: int | None,
                ahead: int | None = None):
        """The token source generate() decodes with: plain, or speculative with a draft."""
        from .speculative.sizing import TreeSizer
        from .speculative.rounds import check_vocab, speculative_source

        if draft is None or draft is True:
            draft = self.draft
        if draft is None or draft is False:
            return autoregressive
        if draft is not self.draft:  # load(draft=...) checked its own
            check_vocab(_tokens(self.gguf), _tokens(draft.gguf), str(self.path), str(draft.path))
        # one sizer per draft, kept: costs and acceptance carry over between generations
        sizer = self._sizers.setdefault(id(draft.engine), TreeSizer())
        if self.engine.device.type == "cpu":
            # a CPU pass costs in proportion to its rows (FLOP-bound): the sizer's first tree of
            # START_NODES (64) nodes cost the default model's Q8_0 ~250 ms, against ~11 ms for
            # a plain step (session 26)
            sizer.max_nodes = min(sizer.max_nodes, CPU_MAX_TREE_NODES)
        sizer.plain_gain = self.release_gain if draft is self.draft else 1.0
        # the loaded draft, found not to pay, is given up mid-generation and its memory goes to
        # the model; a draft passed in for one generation belongs to the caller
        give_up = self.release_draft if draft is self.draft else None
        return speculative_source(draft.engine, nodes=nodes, depth=depth, sizer=sizer,
                                  give_up=give_up, ahead=ahead)

    def release_draft(self) -> list[int]:
        """Close the loaded draft and give the memory it held to the model: streamed layers
        that now fit (the pinned tier on CUDA) become resident. Called by speculative decoding
        when its sizer finds the draft never pays; later generations decode plainly. Returns
        the layers made resident."""
        draft, self.draft = self.draft, None
        if draft is None:
            return []
        t0 = time.perf_counter()
        held = self.plan.draft[1] if self.plan is not None and self.plan.draft else 0
        draft.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.plain_streamed is not None and self.plan is not None:
            # the plan without the draft: what it holds fits the budget by that plan's own
            # reserve, which the draft's share no longer takes (nor the cap its headroom)
            keep_streaming = set(self.plain_streamed)
            only = [i for i in self.plan.streamed_layers if i not in keep_streaming]
            room = None
            if self._vram_cap is not None:
                self._vram_cap.grow(DRAFT_GRAPH_HEADROOM)
        else:
            only = None
            room = max(held - DRAFT_GRAPH_HEADROOM, 0)  # the headroom stays with the process
        promoted: list[int] = []
        stores = {id(st.store): st.store for st in self.engine.stages}
        cap = self.plan.vram_layers if self.plan is not None else None
        most = None if cap is None else max(cap - self.plan.tiers.count("vram"), 0)
        for store in stores.values():
            promoted += store.promote(room, most, only)
        if self.plan is not None:
            for i in promoted:
                self.plan.tiers[i] = "vram"
            self.plan.draft = None
            if promoted and self.plan.hybrid is not None:
                from .hybrid.plan import after_promotion

                self.plan.hybrid = after_promotion(self.plan, promoted)
        self.draft_released = (draft.path.name, promoted)
        self.draft_release_s = time.perf_counter() - t0
        return promoted

    @property
    def last_speculation(self) -> dict | None:
        """The last generation's speculative figures (tokens per target pass, target passes,
        accepted-depth histogram, mean tree nodes, draft and verify seconds), or None if it
        decoded plainly."""
        extra = self.last_stats.extra if self.last_stats is not None else {}
        spec = {k[len("spec_"):]: v for k, v in extra.items() if k.startswith("spec_")}
        return spec or None

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of the conversation rendered through the model's chat template."""
        text = self.template.render(list(messages), add_generation_prompt=True)
        ids = self.tokenize(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        # Templates that write the BOS text themselves would otherwise get it twice.
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def chat(self, messages: Sequence[dict], **kwargs) -> Iterator[GenerationEvent]:
        return self.generate(self.chat_ids(messages), **kwargs)


def load(path: str | os.PathLike[str] | None = None, device: str | torch.device = "auto",
         ctx: int | None = None, progress: bool = False, precision: str = "fast",
         ram_budget: str | int | None = None, vram_budget: str | int | None = None,
         io: str = "direct", stream_delay=None, gpu_slots: int = 2,
         skip_layers: int = 0, draft: str | os.PathLike[str] | None = None,
         draft_skip_layers: int = 0, draft_lowbit: str | None = None,
         private_weights: bool | None = None, hybrid: str | float = "auto",
         threads: int | None = None,
         vram_layers: int | None = None,
         devices: Sequence[str | torch.device] | None = None,
         distributed: bool = False) -> Model:
    """Open a GGUF model: `path` (and `draft`) take what `slipstream -m` takes, a file, a cached
    model's name (`slipstream list`), USER/REPO/FILE.gguf or a URL, pulled if the cache lacks
    it; None is the default model, pulled if missing.

    precision: "fast" (the default) trades a little accuracy for speed. On CPU it keeps the
    weights as float16 (logits within ~1e-3 of float32), and where every layer is resident,
    decode also gets packed int4/int8 copies (weights.cpu_packed: a quarter of float16's bytes
    per token, bfloat16 activations; logits within ~2e-2, +0.004% perplexity on the default
    model) while prefill keeps the float16 weights. On
    CUDA, where weights always stay in their GGUF formats, decode GEMVs take int8 activations
    (per block of 32, as llama.cpp's q8_1) and each group's scale and min are folded into one
    f16 plane. "exact" keeps float32 CPU weights and float32 GPU activations: the reference
    the GPU is tested against token for token.

    vram_budget (CUDA): bytes (or "24GiB") of VRAM the model may hold, default what is free;
    a reserve computed from the shapes (KV cache for ctx, activations, workspace, slots) comes
    out of it and layers stay resident while the rest lasts; while the model lives, torch's
    caching allocator is capped at what the process held before plus the budget
    (memory.vram_cap), and a load that would pass it raises BudgetTooSmall. ram_budget: bytes
    of RAM for layers (default MemAvailable less a margin): dequantized resident layers on
    CPU, pinned layer images on CUDA (tier B). The layers that fit neither are read from disk on every
    token (tier C). io: "direct" (O_DIRECT reads, the default), "buffered", "kvikio" (CUDA:
    KvikIO into GPU memory), or "mmap" (the naive baseline: page cache, pageable copies).
    gpu_slots (CUDA, >= 2): the ring of GPU slots streamed layers are copied into.
    stream_delay (tests): a memory.StreamDelays, or a callable run in reader threads before
    each read, or an int of GPU cycles to stall the copy stream at random before each copy.
    vram_layers (CUDA): hold at most this many layers in VRAM, whatever the budget allows
    (llama.cpp's -ngl); the rest stream from pinned RAM or disk as the budgets say.
    devices: the model as one stage per entry, each a contiguous range of layers with its own
    KV cache (the embedding on the first, the head on the last), e.g. ["cpu", "cpu"]. A
    vram_budget list ("24GiB,12GiB") gives one budget per entry. Stages on distinct devices
    (GPU to GPU) are not built yet and are refused; a CUDA index the machine lacks raises
    DeviceNotFound.
    distributed: one stage per process under torchrun (runtime.pipeline): this process loads
    and plans only its rank's contiguous range of layers, within its own budgets (the
    embedding on rank 0, the head on the last rank). Rank 0's model generates as usual; the
    others call `model.serve()` until rank 0 closes its model. A draft file is loaded by
    rank 0 alone, out of its budgets, and verified across the ranks. device "auto" is the GPU
    LOCAL_RANK names (NCCL), or the CPU (gloo).
    skip_layers: leave out the K layers whose output is most like their input (cosine
    similarity on a calibration text shipped with the package, runtime.layer_skip), preferring
    streamed layers among near-equals; they are neither streamed nor computed. Costs
    accuracy: measure it with `slipstream perplexity --skip-layers K`. model.skipped_layers
    and model.layer_similarities report the choice.
    draft: a GGUF with the same vocabulary, loaded as `model.draft` on the same device with
    the same ctx and precision, which `generate` and `chat` then decode speculatively with;
    DraftMismatch, before anything loads, if the vocabularies differ. The draft is placed
    first, wholly resident, out of the same budgets (BudgetTooSmall if it does not fit whole);
    the model gets what remains, and `model.plan` shows the draft's share.
    draft_skip_layers: a self-draft instead of a file: the same weights with K layers left out
    (every streamed layer first, so that the draft runs from resident layers alone, then the
    most redundant by layer_skip's calibration). It writes into the model's KV cache (as the
    low-bit draft does: it then reads the model's exact keys and values of the accepted prefix,
    which took the default model's Q8_0 from 4.70 to 5.53 tokens per pass with 4 layers
    skipped, 64-node trees; session 27) and holds no memory of its own.
    draft_lowbit: a self-draft that is the model with a low-bit copy ("Q2_K", "Q3_K", "Q4_0",
    ...) of the layers whose reading bounds it: on CUDA the layers the plan streams, on the
    CPU every layer. The copy is requantized at load (speculative.lowbit), placed first out of the
    budget (the model streams what the rest leaves), and the draft shares the model's
    embedding, head, norms, resident layers and KV cache (SubSpec).
    private_weights: copy every weight that would stay a view of the file's memory map (the
    token embedding, F32 norms, F16 weights at float16) into private memory, and drop the
    map's pages after the load, so that a file truncated or overwritten under the running model
    cannot kill it (SIGBUS) or change its output (weights.loader). None: on CPU yes (the
    default model: the 28.7 MiB embedding copied, RSS 104 MiB lower, its file pages dropped),
    on CUDA no (only a streamed plan's host embedding is concerned; True copies it).
    hybrid (CUDA, layers streamed from pinned RAM): "auto" (default) lets the CPU compute part
    of each such layer's FFN during decode, from a packed copy in RAM, while PCIe brings the
    rest, when the bandwidths measured at start-up predict it at least 5% faster (the plan
    shows the split and the prediction; hybrid.plan); "on" splits whatever it
    predicts, "off" never, a number in (0, 1] sets the CPU's share. Not bit-identical to
    "off": the CPU kernels round weights' scales and activations to bfloat16, so "auto" stays
    off at precision="exact" (where a token must not depend on the batch it ran in: plain
    against speculative decoding, say). threads: the
    CPU threads of that share (default: three quarters of the cores); torch's whole process
    then computes with them.
    """
    hybrid = _hybrid_mode(hybrid, precision)
    stage_devices = None
    pipeline = None
    if distributed:
        if devices is not None or draft_skip_layers or skip_layers or \
                draft_lowbit is not None:
            raise BadArgument("distributed=True runs one stage per process; devices=, layer "
                              "skip and the self-drafts do not combine with it yet (a draft "
                              "file does: rank 0 holds it)")
        from .runtime.pipeline import join

        pipeline = join(device)
        device = pipeline.device
        if not pipeline.first:
            draft = None  # rank 0 holds the draft and grows the trees; the others verify
    if devices is not None:  # checked before the file is opened: a wrong index fails at once
        device, vram_budget, stage_devices = _stage_devices(devices, vram_budget)
    model_path, gf, cfg = _open(path, progress)
    dev = resolve_device(device)
    tokenizer = Tokenizer.from_metadata(gf.metadata)
    template = ChatTemplate.from_metadata(gf.metadata)
    n_ctx = _context(cfg, ctx)
    _check_skip_layers(cfg, skip_layers)  # before the load, which may take minutes
    lowbit_type = None
    if draft_lowbit is not None:
        if draft is not None or draft_skip_layers:
            raise BadArgument("draft_lowbit=... and another draft (draft=, draft_skip_layers=) "
                              "name two drafts: give one")
        from .speculative.lowbit import parse_lowbit_type

        lowbit_type = parse_lowbit_type(draft_lowbit)
    if draft_skip_layers:
        if draft is not None:
            raise BadArgument("draft=... and draft_skip_layers=... name two drafts: give one")
        _check_skip_layers(cfg, draft_skip_layers, what="draft_skip_layers")
    if draft is not None:
        draft = _resolve(draft, progress)
        _check_draft(model_path, gf, draft)
    prec = Precision.of(precision, dev)
    if prec.cpu_packed_decode:
        from . import native

        native.build_in_background()  # a first build (~2 s) runs beside the load, not at decode
    from .memory.budget import parse_size

    vram, ram = parse_size(vram_budget), parse_size(ram_budget)
    vram, outside = _allocator_budget(vram, dev)
    draft_model, plain_plan = None, None
    self_draft = lowbit_type is not None or bool(draft_skip_layers)
    if self_draft and dev.type == "cuda" and vram is None:
        vram = torch.cuda.mem_get_info(dev)[0]  # the draft's share comes out of a known budget
    if (draft is not None or self_draft) and dev.type == "cuda" and pipeline is None:
        plain_plan = _plain_plan(gf, cfg, dev, prec, n_ctx, ram, vram, io, gpu_slots,
                                 vram_layers)
    plain_streamed = plain_plan.streamed_layers if plain_plan is not None else None
    if draft is not None:  # placed first: the model gets what the draft leaves
        draft_model, held = _place_draft(Path(draft), dev, n_ctx, precision, ram, vram, io)
        vram, ram = _remaining(vram, ram, held, dev, f"the draft {Path(draft).name}",
                               draft_model)
    elif lowbit_type is not None:
        copied, held = _size_lowbit(gf, cfg, dev, prec, n_ctx, ram, vram, io, gpu_slots,
                                    vram_layers, lowbit_type, plain_streamed)
        vram, ram = _remaining(vram, ram, held, dev,
                               f"the {lowbit_type.name} copy of {len(copied)} layers", None)
    elif draft_skip_layers:  # on CUDA: its graphs, and a VRAM token table if the model streams
        held = _self_draft_vram(gf, bool(plain_streamed)) if dev.type == "cuda" else 0
        vram, ram = _remaining(vram, ram, held, dev, "the layer-skip self-draft", None)
    stage = None
    if pipeline is not None:
        from .memory.devices import stage_ranges
        from .memory.planner import StagePlan

        layers = stage_ranges(cfg.n_layers, pipeline.world)[pipeline.rank]
        stage = StagePlan(dev.type, layers, holds_embedding=pipeline.first,
                          holds_head=pipeline.last)
    try:
        plan = _plan(gf, cfg, dev, prec, n_ctx, ram, vram, io, gpu_slots, vram_layers,
                     stream_first=plain_streamed, stage=stage)
    except BaseException:
        if draft_model is not None:
            draft_model.close()
        raise
    plan.outside_allocator = outside
    if stage_devices is not None:
        plan.stages = _stage_plans(cfg, stage_devices)
    if draft is not None:
        plan.draft = (Path(draft).name, held)
    elif draft_skip_layers:
        plan.draft = (f"self: {draft_skip_layers} layers skipped", held)
    elif lowbit_type is not None:
        plan.draft = (f"self: {lowbit_type.name} copy, {len(copied)} layers", held)
    from .memory.vram_cap import VramCap

    cap = VramCap(dev, vram) if dev.type == "cuda" else None
    try:
        model = _build(model_path, gf, cfg, dev, tokenizer, template, plan, n_ctx, prec,
                       progress, io, stream_delay, private_weights, hybrid, threads,
                       pipeline)
    except BaseException as e:
        if draft_model is not None:
            draft_model.close()
        if cap is not None:
            cap.release()
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise BudgetTooSmall(
                    f"loading {model_path.name} took more VRAM than the {fmt_bytes(cap.limit)} "
                    f"the budget allows this process ({oom_summary(e)}); raise --vram-budget "
                    f"or lower --ctx") from None
        raise
    if pipeline is not None:
        from .runtime.pipeline import stage_rows

        model.pipeline_stages = stage_rows(pipeline, plan)  # every rank's, for rank 0's table
    if cap is not None:
        cap.attach(model)
        model._vram_cap = cap
    model.draft = draft_model
    model.plain_streamed = plain_streamed
    if plain_plan is not None:
        model.release_gain = _release_gain(gf, cfg, plan, plain_plan, hybrid, threads)
    try:
        if skip_layers:
            _skip_layers(model, skip_layers)
        if self_draft and cap is not None:
            cap.grow(held)  # the draft's share, taken out of the model's budget above
        if draft_skip_layers:
            model.draft = _self_draft(model, draft_skip_layers)
        if lowbit_type is not None:
            model.draft = _lowbit_draft(model, prec, lowbit_type, copied, progress)
        if self_draft and dev.type == "cuda":
            _warm_draft(model.draft.engine)  # its graphs' pools, inside its share
        if model.draft is not None:
            if dev.type == "cuda":
                _warm_target(model.engine)
            else:
                _warm_cpu(model.engine)
                _warm_cpu(model.draft.engine)
    except BaseException:
        model.close()
        raise
    return model


def _allocator_budget(vram: int | None, dev: torch.device) -> tuple[int | None, int]:
    """A VRAM budget is what the driver counts for the process: what is left of it for torch's
    allocator once the CUDA context is counted (memory.cuda_context), and that context."""
    if vram is None or dev.type != "cuda":
        return vram, 0
    from .memory.cuda_context import outside_allocator_bytes

    outside = outside_allocator_bytes(dev)
    if vram <= outside:
        raise BudgetTooSmall(f"a {fmt_bytes(vram)} VRAM budget does not cover the CUDA context "
                             f"({fmt_bytes(outside)} outside torch's allocator); raise "
                             f"--vram-budget")
    return vram - outside, outside


def _place_draft(path: Path, dev: torch.device, ctx: int, precision: str, ram: int | None,
                 vram: int | None, io: str) -> tuple["Model", int]:
    """Load a draft first, out of the budgets, wholly resident (a draft that streamed would
    cost a pass of its own per tree level). Returns it and the bytes it holds: VRAM the CUDA
    allocator reserved for it, or the RAM its plan keeps on CPU."""
    if dev.type == "cuda":
        # blocks cached from earlier work would hide the draft's share (the allocator would
        # hand them out again): start from what live tensors hold
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    if vram is not None and dev.type == "cuda":  # the draft's load counts the context again
        from .memory.cuda_context import outside_allocator_bytes

        vram += outside_allocator_bytes(dev)
    d = load(path, device=dev, ctx=ctx, precision=precision, ram_budget=ram,
             vram_budget=vram, io=io)
    if d.plan is not None and d.plan.streamed_layers:
        n, total = len(d.plan.streamed_layers), d.config.n_layers
        d.close()
        raise BudgetTooSmall(f"the draft {path.name} does not fit the budget whole ({n} of "
                             f"its {total} layers would stream, and a draft must be resident); "
                             f"raise --vram-budget/--ram-budget or use a smaller draft")
    if dev.type == "cuda":
        _warm_draft(d.engine)  # its graphs' memory is the draft's too: count it now
        held = torch.cuda.memory_reserved(dev) - before + DRAFT_GRAPH_HEADROOM
    else:
        held = sum(d.plan.resident_bytes_per_layer) + d.plan.fixed_bytes
    return d, held


def _warm_draft(engine: Engine) -> None:
    """Capture a draft's decode graph and its tree-level graphs (runtime.graphs), whose memory
    pools are then allocated before the model's budget is set from what the draft left."""
    from .runtime.graphs import STEP_WIDTHS
    from .speculative.rounds import CUDA_LEVEL_WIDTH

    if not engine.use_graphs:
        return
    _run_tree_steps(engine, [w for w in STEP_WIDTHS if w <= CUDA_LEVEL_WIDTH])


# Tree passes a CUDA target runs once at load when it has a draft, so that no pass the sizer
# times compiles kernels: one per accumulator width of kernels.qgemm's wide kernel (its M_PAD:
# 16, 32, 64, 128 rows), which passes of 5 to 128 nodes reach, and the wider dequantize +
# cuBLAS path at 256 and 512 (the sizer's widest, tried once early for its pass line; a short
# prompt's prefill never runs that path). Compiling inside timed passes cost: on the H200 the
# first 256-node rounds of the 70B took 1.5 s a pass against 0.44 s once compiled, and a sizer
# that timed them gave the draft up (bench/results/2026-12-02-h200-session16.md); session 28's
# first default-spec generation did the same (passes 0.31 s against 0.07 s in the next run);
# on the H100 (session 29) the 70B's first 16-node round took 1.73 s against 0.54 s for the
# 32-node one after it (s29-spec-bench-h100-call3.json, its trace). 16 and 512 came in
# session 29, not yet run on a GPU.
TARGET_WARM_WIDTHS = (16, 32, 64, 128, 256, 512)


def _warm_target(engine: Engine) -> None:
    """Compile the target's tree-pass kernels before the first generation (see
    TARGET_WARM_WIDTHS), then hand the passes' cached blocks back. A budget too tight for a
    pass's logits leaves the rest to compile on first use (the layers have streamed by then)."""
    try:
        _run_tree_steps(engine, [w for w in TARGET_WARM_WIDTHS if w < engine.ctx])
    except torch.cuda.OutOfMemoryError:
        engine.reset()
    torch.cuda.empty_cache()


# The widest tree the sizer may grow for a CPU target (NODE_CHOICES' two narrowest).
CPU_MAX_TREE_NODES = 32


def _warm_cpu(engine: Engine) -> None:
    """One decode step, then an empty cache: a CPU layer's packed decode copy is made at its
    first call of few rows (weights.cpu_packed.PackedDecodeLinear), which would otherwise fall
    in the first plain step that speculative decoding times. The tree sizer took that step
    (packing every layer) as what a plain step costs, found trees far cheaper, and never
    stepped plainly again: the default model's Q8_0 with its Q4_0 as draft decoded at 11 tok/s
    against 89.5 plain on the 2-core machine (session 26)."""
    engine.reset()
    engine.decode(torch.zeros(1, dtype=torch.long, device=engine.device))
    engine.reset()


def _run_tree_steps(engine: Engine, widths: list[int]) -> None:
    """A decode step, then one tree of each width of siblings below it; the cache is left
    empty."""
    from .model import tree_step

    engine.reset()
    engine.decode(torch.zeros(1, dtype=torch.long, device=engine.device))
    for width in widths:
        step = tree_step([-1] * width, 1, 1, engine.device)
        engine.forward([0] * width, all_logits=True, step=step)
        engine.truncate(1)
    engine.reset()


def _remaining(vram: int | None, ram: int | None, held: int, dev: torch.device, what: str,
               draft_model: "Model | None") -> tuple[int | None, int | None]:
    """The budgets the model gets after `what` took `held` bytes of its device's budget (a
    budget left unset is read from the machine at planning time, after the draft took its
    share, so it needs no subtraction)."""
    if dev.type == "cuda":
        vram, left = (None, 1) if vram is None else (vram - held, vram - held)
    else:
        ram, left = (None, 1) if ram is None else (ram - held, ram - held)
    if left <= 0:
        if draft_model is not None:
            draft_model.close()
        budget = "--vram-budget" if dev.type == "cuda" else "--ram-budget"
        raise BudgetTooSmall(f"{what} takes {fmt_bytes(held)}, all of {budget}: nothing is "
                             f"left for the model; raise {budget} or use a smaller draft")
    return vram, ram


def _self_draft(model: "Model", k: int) -> "Model":
    """The layer-skip self-draft: the model's weights and stores with k layers left out,
    every streamed one first (its store streams them in the target's order only, and a draft
    must run from what is resident), the rest the most redundant by calibration."""
    from .runtime import layer_skip

    streamed = set(model.plan.streamed_layers) if model.plan is not None else set()
    if len(streamed) > k:
        raise BadArgument(f"draft_skip_layers={k} leaves streamed layers in the self-draft: "
                          f"the plan streams {len(streamed)} layers and a self-draft runs from "
                          f"resident layers only; skip at least {len(streamed)}, raise the "
                          f"budget, or give a draft file")
    sims = model.layer_similarities or layer_skip.calibrate(
        model.engine, model.tokenize(layer_skip.calibration_text()))
    model.layer_similarities = sims
    # the streamed layers are taken whatever their similarity; the rest by calibration
    masked = [-1.0 if i in streamed else s for i, s in enumerate(sims)]
    rest = layer_skip.choose(masked, k=k - len(streamed)) if k > len(streamed) else frozenset()
    skip = frozenset(streamed) | rest | model.engine.skip
    draft = Model(model.path, model.gguf, model.config,
                  model.engine.self_draft(skip, share_kv=True), model.tokenizer, model.template)
    draft.plan = model.plan
    draft.owns_resources = False  # the target's stores, map and cap: closed with the target
    return draft


def _size_lowbit(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, prec: Precision,
                 ctx: int, ram, vram, io: str, gpu_slots: int, vram_layers,
                 qtype, plain_streamed: list[int] | None) -> tuple[list[int], int]:
    """The layers a low-bit copy holds and the bytes it takes: on the CPU every layer (each is
    read from RAM every token); on CUDA the layers the model streams once the copy's bytes
    have left its budget, found by planning again until the streamed set is covered (each
    round streams at least the last one's layers: the planner streams `plain_streamed`
    first)."""
    from .memory.setup import layer_resident_bytes
    from .memory.vram import layer_vram_bytes
    from .speculative.lowbit import RetypedFile

    if dev.type != "cuda":
        copied = list(range(cfg.n_layers))
        view = RetypedFile(gf, qtype, copied)
        return copied, sum(layer_resident_bytes(view, i, prec) for i in copied)
    copied: set[int] = set(plain_streamed or ())
    while True:
        view = RetypedFile(gf, qtype, copied)
        held = sum(layer_vram_bytes(view, cfg, i, prec.fuse_scales) for i in copied) + \
            _self_draft_vram(gf, bool(copied))
        if vram - held <= 0:
            raise BudgetTooSmall(f"a {qtype.name} copy of the {len(copied)} layers the model "
                                 f"would stream takes {fmt_bytes(held)}, all of the VRAM "
                                 f"budget ({fmt_bytes(vram)}); raise --vram-budget or choose "
                                 f"a smaller type")
        streamed = set(_plan(gf, cfg, dev, prec, ctx, ram, vram - held, io, gpu_slots,
                             vram_layers, stream_first=plain_streamed).streamed_layers)
        if streamed <= copied:
            return sorted(copied), held
        copied |= streamed


def _self_draft_vram(gf: GGUFFile, streamed: bool) -> int:
    """VRAM a self-draft on CUDA takes beyond any layers of its own: its graphs' headroom, and
    where the model streams (its token table then stays on the host, which no captured graph
    can read: Engine.self_draft) a copy of the token table."""
    from .memory.vram import alloc_bytes
    from .model.layer_spec import EMBEDDING

    table = alloc_bytes(gf.tensors[EMBEDDING].n_bytes) if streamed else 0
    return DRAFT_GRAPH_HEADROOM + table


def _lowbit_draft(model: "Model", prec: Precision, qtype, copied: list[int],
                  show: bool) -> "Model":
    """The low-bit self-draft (speculative.lowbit): the copy of `copied` built on the model's
    device (sharing its CUDA workspace), the model's other layers, and its KV cache."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .speculative.lowbit import build_lowbit_layers

    workspace = getattr(model.engine.weights.output, "workspace", None)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), disable=not show, transient=True,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(f"requantizing the draft's layers to {qtype.name}",
                            total=len(copied))
        layers = build_lowbit_layers(model.gguf, model.config, model.device, prec, qtype,
                                     copied, workspace=workspace,
                                     progress=lambda n: bar.advance(task, n))
    if model.device.type == "cpu":  # private weights: the pages the copy read go back too
        from .weights.loader import release_mapped_pages

        release_mapped_pages(model.gguf)
    draft = Model(model.path, model.gguf, model.config,
                  model.engine.self_draft(model.engine.skip, replace=layers, share_kv=True),
                  model.tokenizer, model.template)
    draft.plan = model.plan
    draft.owns_resources = False  # the target's stores, map and cap: closed with the target
    return draft


def _tokens(gf: GGUFFile) -> list[str]:
    return list(gf.metadata.get("tokenizer.ggml.tokens") or ())


def _check_draft(model_path: Path, gf: GGUFFile, draft: Path) -> None:
    """A speculative draft must share the model's vocabulary (DraftMismatch otherwise)."""
    from .speculative.rounds import check_vocab

    dgf = GGUFFile(draft)
    try:
        check_vocab(_tokens(gf), _tokens(dgf), str(model_path), str(draft))
    finally:
        dgf.close()


def _check_skip_layers(cfg: ModelConfig, k, what: str = "skip_layers") -> None:
    most = max(cfg.n_layers - 2, 0)  # the first and last layers are never skipped
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise BadArgument(f"{what}={k!r} is invalid: between 0 and {most} for a model of "
                          f"{cfg.n_layers} layers (never the first or the last)")


def _skip_layers(model: Model, k: int) -> None:
    """load(skip_layers=k): calibrate on the shipped text, then skip the k most redundant
    layers, the plan's streamed ones first among near-equals (layer_skip.choose)."""
    from .runtime import layer_skip

    sims = layer_skip.calibrate(model.engine, model.tokenize(layer_skip.calibration_text()))
    prefer = set(model.plan.streamed_layers) if model.plan is not None else set()
    model.engine.skip = layer_skip.choose(sims, k=k, prefer=prefer)
    model.layer_similarities = sims


def plan(path: str | os.PathLike[str] | None = None, device: str | torch.device = "auto",
         ctx: int | None = None, precision: str = "fast", ram_budget: str | int | None = None,
         vram_budget: str | int | None = None, io: str = "direct", gpu_slots: int = 2,
         measure: bool = True, hybrid: str | float = "auto", threads: int | None = None,
         vram_layers: int | None = None):
    """The tier plan (memory.Plan) that `load` would make with the same arguments, without
    loading the model: which layers stay in VRAM or RAM, which stream from pinned RAM or disk,
    and the reserve. The budgets are read from the machine now (free VRAM, MemAvailable).
    measure: also probe the links' bandwidths, for the predicted decode rate.
    `plan.table()` is what `slipstream info --plan` prints."""
    _, gf, cfg = _open(path, progress=False)
    dev = resolve_device(device)
    from .memory.budget import parse_size

    vram, outside = _allocator_budget(parse_size(vram_budget), dev)
    p = _plan(gf, cfg, dev, Precision.of(precision, dev), _context(cfg, ctx), ram_budget,
              vram, io, gpu_slots, vram_layers)
    p.outside_allocator = outside
    if measure:
        from .memory.setup import measure_bandwidths

        measure_bandwidths(gf, p, io, cfg, Precision.of(precision, dev))
        if p.streamed_layers:
            _plan_hybrid(gf, cfg, p, _hybrid_mode(hybrid, precision), threads)
    return p


def _open(path, progress: bool) -> tuple[Path, GGUFFile, ModelConfig]:
    model_path = _resolve(path, progress)
    gf = GGUFFile(model_path)
    return model_path, gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors),
                                                     source=model_path.name)


def _resolve(path, progress: bool) -> Path:
    """A model's file from what `-m` takes (pull.resolve): an existing file as it is; else a
    cached name, USER/REPO/FILE.gguf or a URL, pulled if the cache lacks it; None: the default
    model."""
    from .hub.pull import resolve

    if path is not None and Path(path).is_file():
        return Path(path)
    return resolve(None if path is None else str(path), quiet=not progress)


def _context(cfg: ModelConfig, ctx: int | None) -> int:
    n_ctx = min(cfg.context_length, DEFAULT_MAX_CTX) if ctx is None else int(ctx)
    if n_ctx <= 0:
        raise BadArgument(f"ctx={n_ctx} is invalid: the context must hold at least one token")
    return n_ctx


def _plan(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, precision: Precision, ctx: int,
          ram_budget, vram_budget: int | None, io: str, gpu_slots: int,
          vram_layers: int | None = None, stream_first: list[int] | None = None,
          stage=None):
    """The one planning path of `load` and `plan` (stage: a pipeline process's own)."""
    from .memory.budget import parse_size
    from .memory.setup import check_io, plan_for

    check_io(io, dev)
    if vram_layers is not None and (isinstance(vram_layers, bool)
                                    or not isinstance(vram_layers, int) or vram_layers < 0):
        raise BadArgument(f"vram_layers={vram_layers!r} is invalid: must be an integer >= 0 "
                          f"(the most layers held in VRAM)")
    return plan_for(gf, cfg, dev, precision, ctx, parse_size(ram_budget), vram_budget, io,
                    gpu_slots, prefill_chunk=PREFILL_CHUNK, graph_bucket=GRAPH_BUCKET,
                    vram_layers=vram_layers, stream_first=stream_first, stage=stage)


def _plain_plan(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, precision: Precision,
                ctx: int, ram_budget, vram_budget: int | None, io: str, gpu_slots: int,
                vram_layers: int | None):
    """The model's plan at these budgets without a draft (planned before the draft loads, so
    that an unset budget reads the same free VRAM), or None where that plan fails. The model
    planned beside the draft streams its streamed layers first (planner.plan_cuda), so
    that giving the draft up (Model.release_draft) brings back plain decode's own layout. On
    the H200 (70B at 24 GiB, 8B draft), promoting an even spread of the draft plan's layers
    instead left plain decode 7% under plain decode at the same budget without a draft, with
    one streamed layer more and the streamed ones spread otherwise."""
    try:
        return _plan(gf, cfg, dev, precision, ctx, ram_budget, vram_budget, io, gpu_slots,
                     vram_layers)
    except BudgetTooSmall:
        return None


def _release_gain(gf: GGUFFile, cfg: ModelConfig, plan, plain_plan, hybrid: str | float,
                  threads: int | None) -> float:
    """How much faster plain decode is predicted to run once the draft is given up: the
    no-draft plan's predicted tok/s over the loaded plan's, on the bandwidths measured at load
    (hybrid split as load makes it), in [1, 2]; 1 where either prediction is missing. The tree
    sizer gives the draft up against this bar (speculative.sizing.TreeSizer.plain_gain)."""
    if not plan.streamed_layers or not plan.bandwidth_gbps:
        return 1.0
    plain_plan.bandwidth_gbps.update(plan.bandwidth_gbps)
    if plain_plan.streamed_layers:
        _plan_hybrid(gf, cfg, plain_plan, hybrid, threads)
    with_draft, without = plan.predicted_tok_s, plain_plan.predicted_tok_s
    if not with_draft or not without:
        return 1.0
    return max(1.0, min(2.0, without / with_draft))


def _build(model_path: Path, gf: GGUFFile, cfg: ModelConfig, dev: torch.device, tokenizer,
           template, plan, n_ctx: int, precision: Precision, progress: bool, io: str,
           stream_delay, private_weights: bool | None = None, hybrid: str | float = "off",
           threads: int | None = None, pipeline=None) -> Model:
    """Load the planned model: streamed tiers first, then the resident weights, the store
    and the engine."""
    from .hybrid.policy import HybridSplit
    from .memory.setup import (disk_images, make_store, measure_bandwidths,
                               pin_streamed_layers)

    if plan.streamed_layers:
        measure_bandwidths(gf, plan, io, cfg, precision)
        _plan_hybrid(gf, cfg, plan, hybrid, threads)
    resident = {i for i, t in enumerate(plan.tiers) if t in ("ram", "vram")}
    # CUDA tiers B and C are built first, while the GPU holds nothing else, so the transient
    # GPU copy of the layer being built never sits on top of the resident model (on CPU:
    # the "packed" layers' images and the disk layers' image file).
    images, split = pin_streamed_layers(gf, cfg, dev, precision, plan,
                                        HybridSplit.of(plan, cfg, dev))
    disk = disk_images(gf, cfg, dev, precision, plan, progress)
    weights = _load_weights_with_progress(gf, cfg, dev, precision, progress, resident,
                                          plan.embed_on_host, private_weights, plan)
    if dev.type == "cuda":
        # Give load-time transients back, so the run's own peak starts from the steady state
        # (memory.vram reserves the larger of the two, not their sum).
        torch.cuda.empty_cache()
    store = make_store(gf, cfg, dev, precision, weights, plan, io, stream_delay, images,
                       disk, split)
    # one stage per planned stage (today one: the whole model on `dev`), all served by the store
    stages = [Stage.build(cfg, torch.device(st.device) if st.device != dev.type else dev,
                          st.layers, store, n_ctx, precision.kv_dtype, weights.rope_freqs)
              for st in plan.stages]
    if pipeline is not None:
        from .runtime.pipeline import PipelineEngine

        engine = PipelineEngine(cfg, weights, stages, precision.act_dtype,
                                prefill_chunk=plan.prefill_chunk or PREFILL_CHUNK,
                                layers=plan.stages[0].layers, pipeline=pipeline)
    else:
        engine = Engine(cfg, weights, stages, precision.act_dtype,
                        use_graphs=None if plan.graphs else False,
                        prefill_chunk=plan.prefill_chunk or PREFILL_CHUNK)
    model = Model(model_path, gf, cfg, engine, tokenizer, template)
    model.plan = plan
    return model


def _stage_devices(devices, vram_budget):
    """load(devices=...): the device the stages run on, its VRAM budget, and the devices one
    stage each. One process runs its stages on one device today: the hidden state's hand-over
    from GPU to GPU and a store per GPU are not built, so distinct devices are refused."""
    from .memory.budget import parse_size
    from .memory.devices import per_device_budgets, resolve_devices

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


def _stage_plans(cfg: ModelConfig, devices: list[torch.device]) -> list:
    """One StagePlan per device, over contiguous layer ranges: the embedding on the first, the
    head on the last."""
    from .memory.devices import stage_ranges
    from .memory.planner import StagePlan

    ranges = stage_ranges(cfg.n_layers, len(devices))
    last = len(devices) - 1
    return [StagePlan(dev.type, layers, holds_embedding=k == 0, holds_head=k == last)
            for k, (dev, layers) in enumerate(zip(devices, ranges))]


def _hybrid_mode(hybrid: str | float, precision: str) -> str | float:
    """load(hybrid=)'s value checked, with "auto" off at precision="exact" (see load)."""
    from .hybrid.plan import parse_hybrid

    mode = parse_hybrid(hybrid)
    return "off" if mode == "auto" and precision == "exact" else mode


def _plan_hybrid(gf: GGUFFile, cfg: ModelConfig, plan, hybrid: str | float,
                 threads: int | None) -> None:
    """plan.hybrid for a CUDA plan whose bandwidths are measured; the CPU's threads set."""
    if plan.device != "cuda" or hybrid == "off":
        return
    from .hybrid.plan import plan_hybrid

    plan.hybrid = plan_hybrid(gf, cfg, plan, hybrid, threads)
    if plan.hybrid is not None:
        torch.set_num_threads(plan.hybrid.threads)


def _load_weights_with_progress(gf, cfg, dev, precision: Precision, show: bool,
                                resident: set[int] | None = None, embed_on_host: bool = False,
                                private: bool | None = None, plan=None):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

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
                            holds_head=plan.stages[-1].holds_head if plan else True)
