"""The CLI's one door to the Python API: the model a command's arguments name, the tier plan
`info --plan` shows, and the stats a generation returns. Every call into `slipstream.api` is
here.

The API (and torch under it) is imported by the functions that need it, so that `--help`,
argument errors and `info` start without it."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BadArgument
from ..hub.pull import resolve
from .control import follow_rank0
from .notices import warn_before_load
from .render import print_load_notes

if TYPE_CHECKING:
    from ..api import Model
    from ..memory.planner import Plan


def draft_kwargs(a: argparse.Namespace) -> dict:
    """load()'s draft arguments; none at all without a draft flag, so commands without them
    load as before."""
    if getattr(a, "draft", None) is not None:
        return {"draft": a.draft}
    from ..speculative.drafts import SelfDraft  # imports torch: only a self-draft needs it

    if getattr(a, "draft_skip_layers", 0):
        return {"draft": SelfDraft(skip_layers=a.draft_skip_layers)}
    if getattr(a, "draft_lowbit", None) is not None:
        return {"draft": SelfDraft(lowbit=a.draft_lowbit)}
    return {}


def devices_arg(a: argparse.Namespace) -> list[str] | None:
    """--gpus 0,1 (cuda:0, cuda:1) or --devices cpu,cpu: one stage per entry; None: one."""
    gpus, devices = getattr(a, "gpus", None), getattr(a, "devices", None)
    if gpus is not None and devices is not None:
        raise BadArgument("--gpus and --devices both name the stages' devices: give one")
    if gpus is not None:
        return [f"cuda:{g.strip()}" for g in gpus.split(",")]
    return [d.strip() for d in devices.split(",")] if devices is not None else None


def import_engine():
    """slipstream.api, imported (with torch under it) without the cyclic garbage collector's
    full passes, and what the imports made exempted from later ones (gc.freeze): torch and
    the engine make ~170k objects kept for the process's life, and each full pass walks every
    tracked object to find nothing among them. On a 2-core machine one such pass fell inside
    the engine's import (40-120 ms, 0.2 s under load) and two more inside torch's."""
    gc.disable()
    try:
        import torch  # noqa: F401 (heavy: imported once a command loads a model; first, so
        # that `python -X importtime` shows its import apart from the engine's)

        from .. import api  # the engine
    finally:
        gc.freeze()
        gc.enable()
    return api


def load_model(a: argparse.Namespace, private_weights: bool | None = None) -> Model:
    """The model the arguments name (check_args has passed them); sets a.load_s, the load's
    seconds (the imports before it not included). private_weights: a server's weights, which
    must outlive their file being truncated or rewritten (SIGBUS), in private memory, on CUDA
    too (a streamed plan's embedding)."""
    api = import_engine()
    import torch  # imported by now

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    a.model = str(resolve(a.model, quiet=not sys.stderr.isatty()))  # None: the default model
    warn_before_load(a, Path(a.model))
    t0 = time.perf_counter()
    placement = api.Placement(
        ram_budget=a.ram_budget, vram_budget=a.vram_budget, io=a.io, gpu_slots=a.gpu_slots,
        private_weights=private_weights, hybrid=a.hybrid, threads=a.threads,
        vram_layers=a.vram_layers, distributed=a.distributed)
    model = api.load(a.model, device=devices_arg(a) or a.device, ctx=a.ctx,
                     progress=sys.stderr.isatty(), precision=a.precision,
                     skip_layers=a.skip_layers, **draft_kwargs(a), placement=placement)
    a.load_s = time.perf_counter() - t0
    if a.distributed:
        follow_rank0(model)  # the ranks after the first leave here, when rank 0 is done
    print_load_notes(model, getattr(a, "stats", False))
    return model


def plan(path: Path, a: argparse.Namespace) -> Plan:
    """The tier plan the arguments' budgets give the model at `path`, without loading it."""
    api = import_engine()

    warn_before_load(a, path)
    placement = api.Placement(ram_budget=a.ram_budget, vram_budget=a.vram_budget, io=a.io,
                              gpu_slots=a.gpu_slots, hybrid=a.hybrid, threads=a.threads,
                              vram_layers=a.vram_layers)
    return api.plan(path, device=a.device, ctx=a.ctx, precision=a.precision,
                    placement=placement)
