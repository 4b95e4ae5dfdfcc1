"""The public Python API: `slipstream.load(...)` returns a `Model`.

    model = slipstream.load()                      # the default model, pulled if missing
    for event in model.generate("Once upon a time", max_tokens=32, seed=0):
        print(event.text, end="", flush=True)

A Model holds one KV cache, so it runs one generation at a time; the server queues requests.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from . import native
from .errors import BadArgument, BudgetTooSmall, RecurrentState, oom_summary
from .memory.budget import fmt_bytes, parse_size
from .memory.devices import resolve_device, stage_ranges
from .memory.planner import Plan, StagePlan
from .memory.setup import measure_bandwidths
from .memory.vram_cap import VramCap
from .modelfile.chat_template import ChatTemplate
from .modelfile.config import ModelConfig
from .modelfile.gguf_file import GGUFFile
from .modelfile.tokenizer import Tokenizer
from .precision import Precision
from .runtime import layer_skip
from .runtime.build import (allocator_budget, build_engine, check_skip_layers, context_size,
                            device_for_auto, hybrid_mode, measured, open_model, plain_plan,
                            plan_model, resolve_path, stage_devices, stage_plans,
                            start_reading, tokenizer_beside, with_hybrid)
from .runtime.engine import Engine
from .runtime.generate import Generation, GenerationStats, autoregressive, generate
from .load_clock import LoadClock
from .runtime.placement import Placement
from .runtime.recurrent import speculation_refused
from .runtime.sampler import Sampler, SamplingParams
from .speculative import drafts
from .speculative.drafts import Draft, SelfDraft
from .speculative.lowbit import parse_lowbit_type
from .speculative.rounds import check_vocab
from .speculative.self_draft import (lowbit_draft_engine, self_draft_vram, size_lowbit,
                                     skip_draft_engine)
from .speculative.state import DraftRelease, Speculation

__all__ = ["Model", "Placement", "SelfDraft", "load", "plan"]


class Model:
    """A loaded model: its file, config, plan (memory.Plan: where each layer lives), engine,
    tokenizer and chat template, and the draft load() attached, if any."""

    def __init__(self, path: Path, gguf: GGUFFile, config: ModelConfig, engine: Engine,
                 tokenizer: Tokenizer, template: ChatTemplate, plan: Plan | None = None,
                 owns_resources: bool = True):
        self.path = path
        self.gguf = gguf
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.plan = plan
        self.draft: Model | None = None  # load(draft=...): speculative decoding's draft
        # load(skip_layers=K), SelfDraft(skip_layers=K): each layer's calibrated input/output
        # cosine similarity
        self.layer_similarities: list[float] | None = None
        # speculative decoding across generations: tree sizers, the draft's release
        self.speculation = Speculation()
        self.pipeline_stages: list[dict] | None = None  # distributed: every rank's stage
        # load(): seconds per phase of the load (slipstream.load_clock), in the order they ran
        self.load_phases: dict[str, float] = {}
        self.owns_resources = owns_resources  # False for a self-draft, which borrows the target's
        self._vram_cap = None  # memory.vram_cap.VramCap while the model holds a VRAM budget
        self.closed = False

    def serve(self) -> None:
        """A distributed pipeline's ranks after the first: compute this rank's stage of every
        pass rank 0 runs, until rank 0 closes its model (runtime.pipeline)."""
        serve = getattr(self.engine, "serve", None)
        if serve is None:
            raise BadArgument("serve() is for a model loaded with Placement(distributed=True)")
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
        experts = getattr(self.engine.weights, "experts", None)  # cold experts' file
        if experts is not None:
            experts.close()
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
                 spec_ahead: int | None = None) -> Generation:
        """A Generation for a prompt in a fresh context: iterate it for GenerationEvents
        (.id, .text, .finish_reason); its `.stats` (GenerationStats: tokens, prefill and decode
        rates, finish reason, peak memory, and `.speculation`'s figures) are complete once it
        has ended or been closed.

        draft: decode speculatively with this Model (same vocabulary) guessing trees that the
        model verifies in one pass each; the tokens follow the same distribution as plain
        decoding (speculative.rounds). None: the draft `load(draft=...)` loaded, if any;
        False: plain decoding. spec_nodes: the trees' node budget (the root included); None
        sizes each tree from the measured pass and draft costs and the acceptance so far
        (speculative.sizing), learned across this model's generations; spec_depth fixes the
        depth likewise (None: chosen, 0 included, i.e. a plain step). spec_ahead: draft levels
        grown past each verified tree, so that the next one may be grown already (None: none;
        speculative.rounds)."""
        ids = (self.tokenize(prompt_or_ids) if isinstance(prompt_or_ids, str)
               else list(prompt_or_ids))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, seed=seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        stats = GenerationStats()
        sampler = Sampler(params, device=self.engine.device)
        events = generate(self.engine, self.tokenizer, ids, sampler, max_tokens, stops,
                          stats=stats,
                          source=self._source(draft, spec_nodes, spec_depth, spec_ahead))
        return Generation(events, stats)

    def _source(self, draft: "Model | bool | None", nodes: int | None, depth: int | None,
                ahead: int | None = None):
        """The token source generate() decodes with: plain, or speculative with a draft."""
        if draft is None or draft is True:
            draft = self.draft
        if draft is None or draft is False:
            return autoregressive
        if self.engine.cfg.recurrent_layers:
            raise RecurrentState(speculation_refused(self.engine.cfg))
        loaded = draft is self.draft
        if not loaded:  # load(draft=...) checked its own
            check_vocab(drafts.tokens_of(self.gguf), drafts.tokens_of(draft.gguf),
                        str(self.path), str(draft.path))
        # the loaded draft, found not to pay, is given up mid-generation and its memory goes
        # to the model; a draft passed in for one generation belongs to the caller
        return self.speculation.source(self.engine, draft.engine, loaded, self.release_draft,
                                       nodes, depth, ahead)

    def release_draft(self) -> list[int]:
        """Close the loaded draft and give the memory it held to the model: streamed layers
        that now fit (the pinned tier on CUDA) become resident. Called by speculative decoding
        when its sizer finds the draft never pays; later generations decode plainly. Returns
        the layers made resident (also in `speculation.released`)."""
        draft, self.draft = self.draft, None
        if draft is None:
            return []
        t0 = time.perf_counter()
        draft.close()
        promoted, self.plan = drafts.release_memory(
            self.engine, self.plan, self.speculation.plain_streamed, self._vram_cap)
        self.speculation.released = DraftRelease(draft.path.name, promoted,
                                                 time.perf_counter() - t0)
        return promoted

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of the conversation rendered through the model's chat template."""
        return self.prompt_ids(self.template.render(list(messages), add_generation_prompt=True))

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a prompt the chat template rendered (the server renders elsewhere)."""
        ids = self.tokenize(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        # Templates that write the BOS text themselves would otherwise get it twice.
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def chat(self, messages: Sequence[dict], **kwargs) -> Generation:
        return self.generate(self.chat_ids(messages), **kwargs)

    # --- what load() does once the model is built -------------------------------------------

    def _similarities(self) -> list[float]:
        """Each layer's input/output cosine similarity on the shipped calibration text
        (runtime.layer_skip), measured once."""
        if self.layer_similarities is None:
            self.layer_similarities = layer_skip.calibrate(
                self.engine, self.tokenize(layer_skip.calibration_text()))
        return self.layer_similarities

    def _skip_layers(self, k: int) -> None:
        """load(skip_layers=k): skip the k most redundant layers, the plan's streamed ones
        first among near-equals (layer_skip.choose)."""
        sims = layer_skip.calibrate(self.engine,
                                    self.tokenize(layer_skip.calibration_text()))
        prefer = set(self.plan.streamed_layers) if self.plan is not None else set()
        self.engine.skip = layer_skip.choose(sims, k=k, prefer=prefer,
                                             keep=self.engine.cfg.kv_sources())
        self.layer_similarities = sims

    def _self_draft(self, spec: SelfDraft, prec: Precision, qtype, copied: list[int],
                    progress: bool) -> "Model":
        """The self-draft `spec` names, borrowing this model's stores, map and cap (closed
        with it)."""
        if spec.lowbit is not None:
            engine = lowbit_draft_engine(self.engine, self.gguf, self.config, prec, qtype,
                                         copied, progress)
        else:
            streamed = set(self.plan.streamed_layers) if self.plan is not None else set()
            engine = skip_draft_engine(self.engine, streamed, spec.skip_layers,
                                       self._similarities)
        return Model(self.path, self.gguf, self.config, engine, self.tokenizer, self.template,
                     plan=self.plan, owns_resources=False)


def load(path: str | os.PathLike[str] | None = None, *, device: str | torch.device |
         Sequence[str | torch.device] = "auto", ctx: int | None = None,
         precision: str = "fast", placement: Placement | None = None,
         draft: Draft | None = None, skip_layers: int = 0, progress: bool = False) -> Model:
    """Open a GGUF model: `path` (and a draft file) take what `slipstream -m` takes, a file, a
    cached model's name (`slipstream list`), USER/REPO/FILE.gguf or a URL, pulled if the cache
    lacks it; None is the default model, pulled if missing.

    device: "auto" (the GPU if there is one, unless the model runs on the CPU only there: a
    family or mixture of experts whose CUDA path is not built, a format without a GPU kernel;
    then the CPU, with a SlipstreamWarning saying why), "cpu", "cuda" or "cuda:N"; a list, e.g.
    ["cpu", "cpu"], runs the model as one stage per entry, each a contiguous range of layers
    with its own KV cache (the embedding on the first, the head on the last). Stages on
    distinct devices (GPU to GPU) are not built yet and are refused; a CUDA index the machine
    lacks raises DeviceNotFound.

    ctx: the KV cache's tokens (default the model's context, at most 4096).

    precision: "fast" (the default) trades a little accuracy for speed. On CPU it keeps the
    weights as float16 (logits within ~1e-3 of float32), and where every layer is resident,
    decode also gets packed int4/int8 copies (weights.cpu: a quarter of float16's bytes
    per token, bfloat16 activations; logits within ~2e-2, +0.004% perplexity on the default
    model) while prefill keeps the float16 weights. On CUDA, where weights always stay in
    their GGUF formats, decode GEMVs take int8 activations (per block of 32, as llama.cpp's
    q8_1) and each group's scale and min are folded into one f16 plane. "exact" keeps float32
    CPU weights and float32 GPU activations: the reference the GPU is tested against token
    for token.

    placement: the budgets, tiers and links the model is placed with (Placement: VRAM and RAM
    budgets, layers in VRAM, GPU slots, the reader, hybrid decode's CPU share, private
    weights, one stage per process); None: Placement()'s defaults, what the machine has free.

    draft: speculative decoding's draft, which `generate` and `chat` then decode with. A GGUF
    with the same vocabulary (DraftMismatch, before anything loads, if it differs) is loaded
    as `model.draft` on the same device with the same ctx and precision, placed first, wholly
    resident, out of the same budgets (BudgetTooSmall if it does not fit whole); the model
    gets what remains, and `model.plan` shows the draft's share. A SelfDraft(skip_layers=K)
    or SelfDraft(lowbit="Q4_0") makes one of the model's own weights instead (SelfDraft).

    skip_layers: leave out the K layers whose output is most like their input (cosine
    similarity on a calibration text shipped with the package, runtime.layer_skip), preferring
    streamed layers among near-equals; they are neither streamed nor computed. Costs
    accuracy: measure it with `slipstream perplexity --skip-layers K`. model.skipped_layers
    and model.layer_similarities report the choice.

    progress: show the pull's and the load's progress bars on stderr.
    """
    place = placement if placement is not None else Placement()
    drafts.check_draft_arg(draft)
    self_draft = draft if isinstance(draft, SelfDraft) else None
    draft_file = None if self_draft is not None else draft
    staged = not isinstance(device, (str, torch.device))
    hybrid = hybrid_mode(place.hybrid, precision)
    vram_budget, stage_devs, pipeline = place.vram_budget, None, None
    if place.distributed:
        if staged or skip_layers or self_draft is not None:
            raise BadArgument("Placement(distributed=True) runs one stage per process; a "
                              "device list, layer skip and the self-drafts do not combine with "
                              "it yet (a draft file does: rank 0 holds it)")
        from .runtime.pipeline import join  # torch.distributed: only a pipeline needs it

        pipeline = join(device)
        device = pipeline.device
        if not pipeline.first:
            draft_file = None  # rank 0 holds the draft and grows the trees; the others verify
    if staged:  # checked before the file is opened: a wrong index fails at once
        device, vram_budget, stage_devs = stage_devices(device, vram_budget)
    clock = LoadClock()
    with clock.phase("open"):
        model_path, gf, cfg = open_model(path, progress)
    if cfg.recurrent_layers and (draft is not None or place.distributed):
        raise RecurrentState(speculation_refused(cfg) if draft is not None else
                             f"Placement(distributed=True) is not available for "
                             f"{cfg.architecture}: its linear-attention layers' states are "
                             f"not carried between the pipeline's processes yet")
    dev = resolve_device(device)
    if str(device) == "auto":
        dev = device_for_auto(gf, cfg, dev)
    clock.device = dev
    with clock.phase("tokenizer"):
        if not staged and pipeline is None:
            start_reading(gf, dev, place.ram_budget, place.private_weights)  # beside it
        tokenizing = tokenizer_beside(gf, dev)
        template = ChatTemplate.from_metadata(gf.metadata)
    n_ctx = context_size(cfg, ctx)
    check_skip_layers(cfg, skip_layers)  # before the load, which may take minutes
    lowbit_type = None
    if self_draft is not None and self_draft.lowbit is not None:
        lowbit_type = parse_lowbit_type(self_draft.lowbit)
    elif self_draft is not None:
        check_skip_layers(cfg, self_draft.skip_layers, what="SelfDraft skip_layers")
    if draft_file is not None:
        draft_file = resolve_path(draft_file, progress)
        drafts.check_draft(model_path, gf, draft_file)
    prec = Precision.of(precision, dev, unscaled_attention=cfg.attention_scale >= 1.0)
    if prec.cpu_packed_decode:
        native.build_in_background()  # a first build (~2 s) runs beside the load, not at decode
    io, slots, most = place.io, place.gpu_slots, place.vram_layers
    vram, ram = parse_size(vram_budget), parse_size(place.ram_budget)
    vram, outside = allocator_budget(vram, dev)
    if self_draft is not None and dev.type == "cuda" and vram is None:
        vram = torch.cuda.mem_get_info(dev)[0]  # the draft's share comes out of a known budget
    plain = None
    if (draft_file is not None or self_draft is not None) and dev.type == "cuda" \
            and pipeline is None:
        plain = plain_plan(gf, cfg, dev, prec, n_ctx, ram, vram, io, slots, most)
    plain_streamed = plain.streamed_layers if plain is not None else None
    draft_model, held, named, copied = None, 0, None, []
    if draft_file is not None:  # placed first: the model gets what the draft leaves
        draft_model, held = drafts.place_draft(load, draft_file, dev, n_ctx, precision, ram,
                                               vram, io)
        vram, ram = drafts.remaining(vram, ram, held, dev, f"the draft {draft_file.name}",
                                     draft_model)
        named = draft_file.name
    elif lowbit_type is not None:
        copied, held = size_lowbit(gf, cfg, dev, prec, n_ctx, ram, vram, io, slots, most,
                                   lowbit_type, plain_streamed)
        vram, ram = drafts.remaining(vram, ram, held, dev,
                                     f"the {lowbit_type.name} copy of {len(copied)} layers")
        named = self_draft.describe(len(copied))
    elif self_draft is not None:  # on CUDA: its graphs, and a VRAM token table if it streams
        held = self_draft_vram(gf, bool(plain_streamed)) if dev.type == "cuda" else 0
        vram, ram = drafts.remaining(vram, ram, held, dev, "the layer-skip self-draft")
        named = self_draft.describe()
    stage = None
    if pipeline is not None:
        stage = StagePlan(dev.type, stage_ranges(cfg.n_layers, pipeline.world)[pipeline.rank],
                          holds_embedding=pipeline.first, holds_head=pipeline.last)
    try:
        with clock.phase("plan"):
            plan = plan_model(gf, cfg, dev, prec, n_ctx, ram, vram, io, slots, most,
                              stream_first=plain_streamed, stage=stage)
    except BaseException:
        if draft_model is not None:
            draft_model.close()
        raise
    plan = dataclasses.replace(
        plan, outside_allocator=outside, draft=None if named is None else (named, held),
        stages=stage_plans(cfg, stage_devs) if stage_devs is not None else plan.stages)
    cap = VramCap(dev, vram) if dev.type == "cuda" else None
    try:
        with clock.phase("link probes and split"):
            plan = measured(gf, cfg, plan, io, prec, hybrid, place.threads)
        engine = build_engine(gf, cfg, dev, plan, n_ctx, prec, progress, io,
                              place.private_weights, pipeline, place.threads is None, clock)
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
    with clock.phase("tokenizer, beside the load"):
        tokenizer = tokenizing.result()
    model = Model(model_path, gf, cfg, engine, tokenizer, template, plan)
    if pipeline is not None:
        from .runtime.pipeline import stage_rows  # torch.distributed, as join above

        model.pipeline_stages = stage_rows(pipeline, plan)  # every rank's, for rank 0's table
    if cap is not None:
        cap.attach(model)
        model._vram_cap = cap
    model.draft = draft_model
    model.speculation.plain_streamed = plain_streamed
    if plain is not None:
        model.speculation.release_gain = drafts.release_gain(gf, cfg, plan, plain, hybrid,
                                                             place.threads)
    try:
        with clock.phase("draft and layer skip"):
            if skip_layers:
                model._skip_layers(skip_layers)
            if self_draft is not None:
                if cap is not None:
                    cap.grow(held)  # the draft's share, taken out of the model's budget above
                model.draft = model._self_draft(self_draft, prec, lowbit_type, copied,
                                                progress)
            if model.draft is not None:
                drafts.warm_up(model.engine, model.draft.engine, self_draft is not None)
    except BaseException:
        model.close()
        raise
    model.load_phases = clock.rounded()
    return model


def plan(path: str | os.PathLike[str] | None = None, *, device: str | torch.device = "auto",
         ctx: int | None = None, precision: str = "fast", placement: Placement | None = None,
         measure: bool = True) -> Plan:
    """The tier plan (memory.Plan) that `load` would make with the same arguments, without
    loading the model: which layers stay in VRAM or RAM, which stream from pinned RAM or disk,
    and the reserve. The budgets are read from the machine now (free VRAM, MemAvailable).
    measure: also probe the links' bandwidths, for the predicted decode rate.
    `plan.table()` is what `slipstream info --plan` prints."""
    place = placement if placement is not None else Placement()
    _, gf, cfg = open_model(path, progress=False)
    dev = resolve_device(device)
    if str(device) == "auto":
        dev = device_for_auto(gf, cfg, dev)
    prec = Precision.of(precision, dev, unscaled_attention=cfg.attention_scale >= 1.0)
    vram, outside = allocator_budget(parse_size(place.vram_budget), dev)
    p = plan_model(gf, cfg, dev, prec, context_size(cfg, ctx), place.ram_budget, vram,
                   place.io, place.gpu_slots, place.vram_layers)
    p = dataclasses.replace(p, outside_allocator=outside)
    if measure:
        measure_bandwidths(gf, p, place.io, cfg, prec)
        if p.streamed_layers:
            p = with_hybrid(gf, cfg, p, hybrid_mode(place.hybrid, precision), place.threads)
    return p
