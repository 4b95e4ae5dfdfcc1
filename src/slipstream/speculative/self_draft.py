"""The self-drafts (drafts.SelfDraft): a draft engine made of the model's own weights, with
layers left out or replaced by a low-bit copy, which shares the model's KV cache."""

from __future__ import annotations

from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ..errors import BadArgument, BudgetTooSmall
from ..memory.budget import fmt_bytes
from ..memory.setup import layer_resident_bytes
from ..memory.vram import alloc_bytes, layer_vram_bytes
from ..model.layer_spec import EMBEDDING
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..precision import Precision
from ..runtime import layer_skip
from ..runtime.build import plan_model
from ..runtime.engine import Engine
from ..weights.file_bytes import release_mapped_pages
from .drafts import DRAFT_GRAPH_HEADROOM
from .lowbit import RetypedFile, build_lowbit_layers


def skip_draft_engine(engine: Engine, streamed: set[int], k: int,
                      similarities: Callable[[], list[float]]) -> Engine:
    """The layer-skip self-draft: the engine's weights and stores with k layers left out,
    every `streamed` one first (its store streams them in the target's order only, and a draft
    must run from what is resident), the rest the most redundant by `similarities()`
    (layer_skip.calibrate's)."""
    if len(streamed) > k:
        raise BadArgument(f"SelfDraft(skip_layers={k}) leaves streamed layers in the "
                          f"self-draft: the plan streams {len(streamed)} layers and a "
                          f"self-draft runs from resident layers only; skip at least "
                          f"{len(streamed)}, raise the budget, or give a draft file")
    # the streamed layers are taken whatever their similarity; the rest by calibration
    masked = [-1.0 if i in streamed else s for i, s in enumerate(similarities())]
    rest = (layer_skip.choose(masked, k=k - len(streamed), keep=engine.cfg.kv_sources())
            if k > len(streamed) else frozenset())
    return engine.self_draft(frozenset(streamed) | rest | engine.skip, share_kv=True)


def self_draft_vram(gf: GGUFFile, streamed: bool) -> int:
    """VRAM a self-draft on CUDA takes beyond any layers of its own: its graphs' headroom, and
    where the model streams (its token table then stays on the host, which no captured graph
    can read: Engine.self_draft) a copy of the token table."""
    table = alloc_bytes(gf.tensors[EMBEDDING].n_bytes) if streamed else 0
    return DRAFT_GRAPH_HEADROOM + table


def size_lowbit(gf: GGUFFile, cfg: ModelConfig, dev: torch.device, prec: Precision,
                ctx: int, ram, vram, io: str, gpu_slots: int, vram_layers,
                qtype, plain_streamed: list[int] | None) -> tuple[list[int], int]:
    """The layers a low-bit copy holds and the bytes it takes: on the CPU every layer (each is
    read from RAM every token); on CUDA the layers the model streams once the copy's bytes
    have left its budget, found by planning again until the streamed set is covered (each
    round streams at least the last one's layers: the planner streams `plain_streamed`
    first)."""
    if dev.type != "cuda":
        copied = list(range(cfg.n_layers))
        view = RetypedFile(gf, qtype, copied)
        return copied, sum(layer_resident_bytes(view, i, prec) for i in copied)
    copied: set[int] = set(plain_streamed or ())
    while True:
        view = RetypedFile(gf, qtype, copied)
        held = sum(layer_vram_bytes(view, cfg, i, prec.fuse_scales) for i in copied) + \
            self_draft_vram(gf, bool(copied))
        if vram - held <= 0:
            raise BudgetTooSmall(f"a {qtype.name} copy of the {len(copied)} layers the model "
                                 f"would stream takes {fmt_bytes(held)}, all of the VRAM "
                                 f"budget ({fmt_bytes(vram)}); raise --vram-budget or choose "
                                 f"a smaller type")
        streamed = set(plan_model(gf, cfg, dev, prec, ctx, ram, vram - held, io, gpu_slots,
                                  vram_layers, stream_first=plain_streamed).streamed_layers)
        if streamed <= copied:
            return sorted(copied), held
        copied |= streamed


def lowbit_draft_engine(engine: Engine, gf: GGUFFile, cfg: ModelConfig, prec: Precision,
                        qtype, copied: list[int], show: bool) -> Engine:
    """The low-bit self-draft (speculative.lowbit): the copy of `copied` built on the engine's
    device (sharing its CUDA workspace), the engine's other layers, and its KV cache."""
    workspace = getattr(engine.weights.output, "workspace", None)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), disable=not show, transient=True,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(f"requantizing the draft's layers to {qtype.name}",
                            total=len(copied))
        layers = build_lowbit_layers(gf, cfg, engine.device, prec, qtype, copied,
                                     workspace=workspace,
                                     progress=lambda n: bar.advance(task, n))
    if engine.device.type == "cpu":  # private weights: the pages the copy read go back too
        release_mapped_pages(gf)
    return engine.self_draft(engine.skip, replace=layers, share_kv=True)
