"""A loaded model's speculative draft: what it is (a file, or a self-draft of the model's own
weights), its placement out of the model's budgets, its warm-up, and its release.

A draft is placed before the model: a draft file is loaded first, wholly resident, and the
model is planned in what it leaves; a self-draft's share (its graphs, a low-bit copy) is
taken out of the budget likewise. Where the draft is found not to pay (speculative.sizing),
it is released and its memory goes to the model's streamed layers.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import BadArgument, BudgetTooSmall
from ..hybrid.plan import after_promotion
from ..memory.budget import fmt_bytes
from ..memory.cuda_context import outside_allocator_bytes
from ..memory.planner import Plan
from ..model import tree_step
from ..modelfile.gguf_file import GGUFFile
from ..modelfile.config import ModelConfig
from ..runtime.build import with_hybrid
from ..runtime.engine import Engine
from ..runtime.graphs import STEP_WIDTHS
from ..runtime.placement import Placement
from .lowbit import parse_lowbit_type
from .rounds import CUDA_LEVEL_WIDTH, check_vocab

# VRAM a CUDA draft keeps beyond what it holds after its first graphs: the graphs of later
# context spans and level widths are captured as decoding reaches them, and the model planned
# after the draft would otherwise leave them no room (on the H200 they fell back to eager)
DRAFT_GRAPH_HEADROOM = 128 << 20

# Tree passes a CUDA target runs once at load when it has a draft, so that no pass the sizer
# times compiles kernels: one per accumulator width of kernels.qgemm's wide kernel (its M_PAD:
# 16, 32, 64, 128 rows), which passes of 5 to 128 nodes reach, and the wider dequantize +
# cuBLAS path at 256 and 512 (the sizer's widest, tried once early for its pass line; a short
# prompt's prefill never runs that path). Compiling inside timed passes cost: on the H200 the
# first 256-node rounds of the 70B took 1.5 s a pass against 0.44 s once compiled, and a sizer
# that timed them gave the draft up; a first default-spec generation did the same (passes
# 0.31 s against 0.07 s in the next run); on the H100 the 70B's first 16-node round took
# 1.73 s against 0.54 s for the 32-node one after it.
TARGET_WARM_WIDTHS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class SelfDraft:
    """A draft made of the model's own weights, holding no file of its own (load(draft=...)).

    skip_layers=K: the same weights with K layers left out (every streamed layer first, so
    that the draft runs from resident layers alone, then the most redundant by layer_skip's
    calibration). It writes into the model's KV cache (as the low-bit draft does: it then
    reads the model's exact keys and values of the accepted prefix, which took the default
    model's Q8_0 from 4.70 to 5.53 tokens per pass with 4 layers skipped, 64-node trees) and
    holds no memory of its own.

    lowbit="Q4_0" (or "Q2_K", "Q3_K", ...): the model with a low-bit copy of the layers whose
    reading bounds it: on CUDA the layers the plan streams, on the CPU every layer. The copy
    is requantized at load (speculative.lowbit), placed first out of the budget (the model
    streams what the rest leaves), and the draft shares the model's embedding, head, norms,
    resident layers and KV cache (SubSpec).

    Give one of the two."""

    skip_layers: int = 0
    lowbit: str | None = None

    def __post_init__(self) -> None:
        if self.lowbit is not None and self.skip_layers:
            raise BadArgument("SelfDraft(skip_layers=..., lowbit=...) names two drafts: give "
                              "one")
        if self.lowbit is None and not self.skip_layers:
            raise BadArgument("SelfDraft() names no draft: give skip_layers=K or lowbit=TYPE")
        if self.lowbit is not None:
            parse_lowbit_type(self.lowbit)  # BadArgument naming the types there are

    def describe(self, copied: int = 0) -> str:
        """The draft as the plan table names it."""
        if self.lowbit is not None:
            return f"self: {parse_lowbit_type(self.lowbit).name} copy, {copied} layers"
        return f"self: {self.skip_layers} layers skipped"


Draft = str | os.PathLike | SelfDraft  # what load(draft=...) takes


def tokens_of(gf: GGUFFile) -> list[str]:
    return list(gf.metadata.get("tokenizer.ggml.tokens") or ())


def check_draft(model_path: Path, gf: GGUFFile, draft: Path) -> None:
    """A speculative draft must share the model's vocabulary (DraftMismatch otherwise)."""
    dgf = GGUFFile(draft)
    try:
        check_vocab(tokens_of(gf), tokens_of(dgf), str(model_path), str(draft))
    finally:
        dgf.close()


def place_draft(load: Callable, path: Path, dev: torch.device, ctx: int, precision: str,
                ram: int | None, vram: int | None, io: str):
    """Load a draft file first (`load`: the public load), out of the budgets, wholly
    resident (a draft that streamed would cost a pass of its own per tree level). Returns it and the bytes it holds: VRAM the CUDA allocator reserved for it,
    or the RAM its plan keeps on CPU."""
    if dev.type == "cuda":
        # blocks cached from earlier work would hide the draft's share (the allocator would
        # hand them out again): start from what live tensors hold
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    if vram is not None and dev.type == "cuda":  # the draft's load counts the context again
        vram += outside_allocator_bytes(dev)
    d = load(path, device=dev, ctx=ctx, precision=precision,
             placement=Placement(ram_budget=ram, vram_budget=vram, io=io))
    if d.plan is not None and d.plan.streamed_layers:
        n, total = len(d.plan.streamed_layers), d.config.n_layers
        d.close()
        raise BudgetTooSmall(f"the draft {path.name} does not fit the budget whole ({n} of "
                             f"its {total} layers would stream, and a draft must be resident); "
                             f"raise --vram-budget/--ram-budget or use a smaller draft")
    if dev.type == "cuda":
        warm_draft(d.engine)  # its graphs' memory is the draft's too: count it now
        held = torch.cuda.memory_reserved(dev) - before + DRAFT_GRAPH_HEADROOM
    else:
        held = sum(d.plan.resident_bytes_per_layer) + d.plan.fixed_bytes
    return d, held


def remaining(vram: int | None, ram: int | None, held: int, dev: torch.device, what: str,
              draft_model=None) -> tuple[int | None, int | None]:
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


def run_tree_steps(engine: Engine, widths: list[int]) -> None:
    """A decode step, then one tree of each width of siblings below it; the cache is left
    empty."""
    engine.reset()
    engine.decode(torch.zeros(1, dtype=torch.long, device=engine.device))
    for width in widths:
        step = tree_step([-1] * width, 1, 1, engine.device)
        engine.forward([0] * width, all_logits=True, step=step)
        engine.truncate(1)
    engine.reset()


def warm_draft(engine: Engine) -> None:
    """Capture a draft's decode graph and its tree-level graphs (runtime.graphs), whose memory
    pools are then allocated before the model's budget is set from what the draft left."""
    if not engine.use_graphs:
        return
    run_tree_steps(engine, [w for w in STEP_WIDTHS if w <= CUDA_LEVEL_WIDTH])


def warm_target(engine: Engine) -> None:
    """Compile the target's tree-pass kernels before the first generation (see
    TARGET_WARM_WIDTHS), then hand the passes' cached blocks back. A budget too tight for a
    pass's logits leaves the rest to compile on first use (the layers have streamed by then)."""
    try:
        run_tree_steps(engine, [w for w in TARGET_WARM_WIDTHS if w < engine.ctx])
    except torch.cuda.OutOfMemoryError:
        engine.reset()
    torch.cuda.empty_cache()


def warm_cpu(engine: Engine) -> None:
    """One decode step, then an empty cache: a CPU layer's packed decode copy is made at its
    first call of few rows (weights.cpu.PackedDecodeLinear), which would otherwise fall
    in the first plain step that speculative decoding times. The tree sizer took that step
    (packing every layer) as what a plain step costs, found trees far cheaper, and never
    stepped plainly again: the default model's Q8_0 with its Q4_0 as draft decoded at 11 tok/s
    against 89.5 plain on a 2-core machine."""
    engine.reset()
    engine.decode(torch.zeros(1, dtype=torch.long, device=engine.device))
    engine.reset()


def warm_up(target: Engine, draft: Engine, self_draft: bool) -> None:
    """What a model with a draft runs once at load (warm_draft, warm_target, warm_cpu)."""
    if target.device.type == "cuda":
        if self_draft:
            warm_draft(draft)  # its graphs' pools, inside its share
        warm_target(target)
    else:
        warm_cpu(target)
        warm_cpu(draft)


def release_memory(engine: Engine, plan: Plan | None, plain_streamed: list[int] | None,
                   vram_cap) -> tuple[list[int], Plan | None]:
    """After a draft was closed: its memory to the model, as streamed layers that now fit
    made resident (the pinned tier on CUDA). Returns those layers and the model's plan with
    them resident."""
    held = plan.draft[1] if plan is not None and plan.draft else 0
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    if plain_streamed is not None and plan is not None:
        # the plan without the draft: what it holds fits the budget by that plan's own
        # reserve, which the draft's share no longer takes (nor the cap its headroom)
        keep_streaming = set(plain_streamed)
        only = [i for i in plan.streamed_layers if i not in keep_streaming]
        room = None
        if vram_cap is not None:
            vram_cap.grow(DRAFT_GRAPH_HEADROOM)
    else:
        only = None
        room = max(held - DRAFT_GRAPH_HEADROOM, 0)  # the headroom stays with the process
    promoted: list[int] = []
    stores = {id(st.store): st.store for st in engine.stages}
    cap = plan.vram_layers if plan is not None else None
    most = None if cap is None else max(cap - plan.tiers.count("vram"), 0)
    for store in stores.values():
        promoted += store.promote(room, most, only)
    if plan is None:
        return promoted, None
    tiers = list(plan.tiers)
    for i in promoted:
        tiers[i] = "vram"
    plan = dataclasses.replace(plan, tiers=tiers, draft=None)
    if promoted and plan.hybrid is not None:
        plan = dataclasses.replace(plan, hybrid=after_promotion(plan, promoted))
    return promoted, plan


def release_gain(gf: GGUFFile, cfg: ModelConfig, plan: Plan, plain_plan: Plan,
                 hybrid: str | float, threads: int | None) -> float:
    """How much faster plain decode is predicted to run once the draft is given up: the
    no-draft plan's predicted tok/s over the loaded plan's, on the bandwidths measured at load
    (hybrid split as load makes it), in [1, 2]; 1 where either prediction is missing. The tree
    sizer gives the draft up against this bar (speculative.sizing.TreeSizer.plain_gain)."""
    if not plan.streamed_layers or not plan.bandwidth_gbps:
        return 1.0
    plain_plan.bandwidth_gbps.update(plan.bandwidth_gbps)
    if plain_plan.streamed_layers:
        plain_plan = with_hybrid(gf, cfg, plain_plan, hybrid, threads)
    with_draft, without = plan.predicted_tok_s, plain_plan.predicted_tok_s
    if not with_draft or not without:
        return 1.0
    return max(1.0, min(2.0, without / with_draft))


def check_draft_arg(draft) -> None:
    """load()'s draft= is a file (as `-m` takes it) or a SelfDraft."""
    if draft is not None and not isinstance(draft, (str, os.PathLike, SelfDraft)):
        raise BadArgument(f"draft={draft!r} is invalid: give a GGUF (a path, a cached name, "
                          f"USER/REPO/FILE.gguf or a URL) or a SelfDraft(...)")
