"""Warnings about arguments that are valid but will not do what their user expects, one line
each on stderr, given before the model loads (a load may take minutes, and a context far beyond
the model's may not fit at all):

- a context larger than the one the model was trained on: its KV cache is preallocated whole
  (a Llama 3 8B at --ctx 100000 on a CPU: 2 x 32 layers x 8 KV heads x 128 x 4 bytes per token,
  12.2 GiB), and past the trained length the model's output degrades;
- GPU options on a run that computes on the CPU (no CUDA, or --device cpu): llama.cpp users
  type `-ngl 99` out of habit, and the CPU store has no VRAM tier to apply it to.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from .render import err

GPU_SLOTS_DEFAULT = 2  # options.add_model_args' --gpu-slots default


def warn(text: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(text)}", highlight=False, soft_wrap=True)


def on_cpu_only(a: argparse.Namespace) -> bool:
    """Whether every stage the arguments name computes on the CPU."""
    import torch  # callers have loaded it: they are about to load a model

    if getattr(a, "gpus", None) is not None:
        return False
    devices = getattr(a, "devices", None)
    names = [d.strip() for d in devices.split(",")] if devices is not None else [a.device]
    return all(d == "cpu" or (d == "auto" and not torch.cuda.is_available()) for d in names)


def gpu_flags_given(a: argparse.Namespace) -> list[str]:
    """The GPU-only options the arguments set, as the user typed them."""
    given = []
    if getattr(a, "vram_layers", None) is not None:
        given.append(f"-ngl {a.vram_layers}")
    if getattr(a, "vram_budget", None) is not None:
        given.append(f"--vram-budget {a.vram_budget}")
    if getattr(a, "gpu_slots", GPU_SLOTS_DEFAULT) != GPU_SLOTS_DEFAULT:
        given.append(f"--gpu-slots {a.gpu_slots}")
    if getattr(a, "hybrid", "auto") != "auto":
        given.append(f"--hybrid {a.hybrid}")
    return given


def gpu_flags_warning(a: argparse.Namespace) -> str | None:
    given = gpu_flags_given(a)
    if not given or not on_cpu_only(a):
        return None
    import torch  # callers have loaded it: they are about to load a model

    why = ("--device cpu" if torch.cuda.is_available() else "no CUDA GPU is available here")
    return (f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: the model "
            f"runs on the CPU ({why})")


def kv_bytes_per_elem(a: argparse.Namespace) -> int:
    """The KV cache's element size on the device the arguments name (precision.Precision:
    float32 on a CPU, float16 on CUDA)."""
    return 4 if on_cpu_only(a) else 2


def ctx_warning(path: Path, ctx: int | None, bytes_per_elem: int) -> str | None:
    """The warning for a --ctx beyond the model's training context, naming both and the KV
    cache's size; None where it is within it."""
    if ctx is None:
        return None
    # numpy and gguf: loaded by now for the model itself
    from ..memory.budget import fmt_bytes
    from ..model.layer_spec import kv_cache_bytes
    from ..modelfile.config import ModelConfig
    from ..modelfile.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    try:
        cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    except BaseException:
        gf.close()
        raise
    gf.keep()  # for the load that follows (runtime.build.open_model): not parsed twice
    if ctx <= cfg.context_length:
        return None
    kv = kv_cache_bytes(cfg, cfg.n_layers, ctx, bytes_per_elem)
    return (f"--ctx {ctx} is beyond the {cfg.context_length} tokens {path.name} was trained "
            f"on: its KV cache takes {fmt_bytes(kv)}, and past {cfg.context_length} tokens "
            f"the output degrades")


def warn_before_load(a: argparse.Namespace, path: Path) -> None:
    """The warnings the arguments deserve, before the model at `path` loads."""
    for text in (gpu_flags_warning(a), ctx_warning(path, a.ctx, kv_bytes_per_elem(a))):
        if text is not None:
            warn(text)
