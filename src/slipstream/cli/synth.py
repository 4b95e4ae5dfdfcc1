"""`slipstream synth`: write a random-weight GGUF of any supported family for testing."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from ..model.families import ARCHITECTURES, VARIANTS
from .render import err


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    sy = command("synth", "write a random-weight GGUF of a supported family for testing")
    sy.add_argument("--shape", required=True,
                    choices=["tiny", "1b", "8b", "27b", "32b", "70b", "30b-a3b", "235b-a22b",
                             "35b-a3b", "8x7b", "20b-a4b", "120b-a5b", "106b-a12b"],
                    help="the model's shape (27b: Gemma-3-27B's, 32b: Qwen3-32B's; the "
                         "mixtures of experts 30b-a3b and 235b-a22b: Qwen3-MoE's, 35b-a3b: "
                         "Qwen3.5-35B-A3B's, 8x7b: Mixtral's, 20b-a4b and 120b-a5b: "
                         "gpt-oss-20b's and -120b's, 106b-a12b: GLM-4.5-Air's)")
    sy.add_argument("--quant", default="Q4_K",
                    choices=["Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "F16", "Q4_0", "Q5_K", "IQ4_NL",
                             "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                             "IQ1_S", "IQ1_M"],
                    help="the weights' type")
    sy.add_argument("--layers", type=int, default=None, help="override the layer count "
                    "(default: the shape's)")
    sy.add_argument("--arch", default="llama", choices=sorted({*ARCHITECTURES, *VARIANTS}),
                    help="the architecture (its family's layer and metadata); mixtral: a "
                         "llama file with experts")
    sy.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    sy.add_argument("--expert-skew", type=float, default=0.0, metavar="S",
                    help="a mixture of experts' routing skewed as real routing is: each "
                         "layer's router rows scaled by rank^-S, so a few experts take most "
                         "tokens (default 0: random weights' near-uniform routing)")
    sy.add_argument("--fused-experts", action="store_true",
                    help="a mixture of experts' gate and up projections as one tensor, "
                         "ffn_gate_up_exps, as newer llama.cpp conversions write them (the "
                         "same weights as without it)")
    sy.add_argument("-o", "--output", required=True, help="the GGUF to write")
    sy.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..synth import write_synth  # numpy, gguf and torch

    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(f"writing {Path(a.output).name}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        path = write_synth(a.output, a.shape, a.quant, n_layers=a.layers, seed=a.seed,
                           arch=a.arch, progress=progress, expert_skew=a.expert_skew,
                           fused_experts=a.fused_experts)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    err.print(f"wrote {path} ({size / 2**30:.2f} GiB in {dt:.1f} s, {size / dt / 1e6:.0f} MB/s)")
    return 0
