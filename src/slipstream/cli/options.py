"""The options the commands share (the model and its placement, sampling, speculative
decoding), what they become in generate()'s arguments, and the parser's own manners: every
option's help ends with its default, argparse's errors are one line."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from rich.markup import escape

from .. import __version__
from .render import err

DEFAULT_PROMPT = "Once upon a time,"


def version() -> str:
    """The installed distribution's version, else the source tree's (a checkout on
    PYTHONPATH)."""
    # importlib.metadata adds about 15 ms to every start; only --version needs it
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("slipstream")
    except PackageNotFoundError:
        return __version__


class VersionAction(argparse.Action):
    """--version, computed only when asked for (reading the metadata costs a few ms)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print slipstream's version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"slipstream {version()}")
        parser.exit()


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it (options
    whose default is None say in words what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text or d is None or d is False
                or d is argparse.SUPPRESS or d == []):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's own errors (a value that is not a number, an unknown option) as one line and
    exit 1, like every other error; the usage is one --help away."""

    def error(self, message: str) -> NoReturn:
        err.print(f"[red]error:[/red] {escape(self.prog)}: {escape(message)} (see "
                  f"{escape(self.prog)} --help)", highlight=False, soft_wrap=True)
        sys.exit(1)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="MODEL", help="a GGUF file, USER/REPO/FILE.gguf "
                   "on the Hugging Face Hub, an http(s) URL, or a cached model's name (slipstream "
                   "list); pulled if the cache lacks it (default: the default model)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu or cuda[:N]")
    p.add_argument("-c", "--ctx", type=int, default=None, metavar="N", help="context size in "
                   "tokens, as llama.cpp's -c (default: the model's, at most 4096)")
    p.add_argument("--ram-budget", default=None, metavar="SIZE", help="RAM for layers, e.g. "
                   "12GiB: resident layers on CPU, pinned layers on CUDA (default: "
                   "MemAvailable less a margin); the rest streams from disk every token (a "
                   "mixture of experts: experts beyond it are read when routed to)")
    p.add_argument("--vram-budget", default=None, metavar="SIZE", help="VRAM the model may "
                   "hold, e.g. 24GiB (default: what is free)")
    p.add_argument("--gpus", default=None, metavar="LIST", help="one stage per GPU, e.g. 0,1; "
                   "a --vram-budget list (24GiB,12GiB) gives each its own (stages on distinct "
                   "GPUs are not built yet; default: one stage on --device)")
    p.add_argument("--devices", default=None, metavar="LIST", help="one stage per device, "
                   "each a contiguous range of layers with its own KV cache, e.g. cpu,cpu "
                   "(default: one stage on --device)")
    p.add_argument("--distributed", action="store_true", help="one stage per process, under "
                   "torchrun (torchrun --nproc-per-node 2 -m slipstream run --distributed ...): "
                   "each rank loads its range of layers, NCCL between GPUs, gloo on CPUs; rank "
                   "0 prints, the others compute their stage")
    p.add_argument("-ngl", "--vram-layers", type=int, default=None, metavar="N",
                   help="CUDA: hold at most N layers in VRAM whatever --vram-budget allows, as "
                   "llama.cpp's -ngl; the rest stream (default: as many as the budget holds)")
    p.add_argument("--gpu-slots", type=int, default=2, metavar="K", help="CUDA streaming: the "
                   "ring of GPU slots layers are copied into, each holding one layer (at "
                   "least 2)")
    p.add_argument("--precision", default="fast", choices=["fast", "exact"],
                   help="fast (default): int8 activations in the CUDA decode GEMVs and float16 "
                   "CPU weights; exact: float32 activations and CPU weights")
    p.add_argument("--io", default="direct", choices=["direct", "buffered", "mmap", "kvikio"],
                   help="how layers are read from disk: O_DIRECT (default), buffered, KvikIO "
                   "(CUDA, GPUDirect Storage), or the naive mmap baseline")
    p.add_argument("--skip-layers", type=int, default=0, metavar="K",
                   help="leave out the K layers whose output is most like their input (cosine "
                   "similarity on a built-in calibration text; streamed layers first among "
                   "near-equals): faster, less accurate (default 0)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads torch computes with (default: torch's choice, one per "
                   "core; with --hybrid, three quarters of the cores)")
    p.add_argument("--hybrid", default="auto", metavar="MODE", help="CUDA, layers streamed "
                   "from pinned RAM: the CPU computes part of each one's FFN while PCIe "
                   "brings the rest; auto (default: when the bandwidths measured at start-up "
                   "predict it 5%% faster), on, off, or the CPU's share in (0, 1]")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: the commands that generate (run, chat, bench, serve)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, metavar="MODEL", help="a smaller GGUF (a path or "
                   "anything -m takes) with the "
                   "model's vocabulary that guesses trees of tokens the model verifies in one "
                   "pass each (the output follows the same distribution as without it; "
                   "default: none, plain decoding)")
    g.add_argument("--draft-skip-layers", type=int, default=0, metavar="K", help="self-draft: "
                   "the model itself with K layers skipped guesses the tokens (no second file)")
    g.add_argument("--draft-lowbit", default=None, metavar="TYPE", help="self-draft: the "
                   "model with a copy of its streamed layers (every layer on a CPU) "
                   "requantized at load to TYPE (Q2_K, Q3_K, Q4_0, ...) and kept resident, "
                   "sharing the model's KV cache (no second file; default: none); on a CPU "
                   "take Q4_0, whose decode reads packed 4-bit codes (the K-quants compute "
                   "dense there)")
    g.add_argument("--spec-nodes", type=int, default=None, metavar="N", help="tokens in one "
                   "verify pass, the tree's root included (default: sized from the measured "
                   "costs every round)")
    g.add_argument("--spec-depth", type=int, default=None, metavar="D", help="drafted tokens "
                   "below the root, every round (default: chosen from the measured costs and "
                   "acceptance, plain steps included where trees do not pay)")


def spec_kwargs(a: argparse.Namespace) -> dict:
    """generate()'s tree size where --spec-nodes/--spec-depth fix it (None: automatic); the
    draft itself is the one load() attached to the model."""
    return {"spec_nodes": getattr(a, "spec_nodes", None),
            "spec_depth": getattr(a, "spec_depth", None)}


def add_sampling_args(p: argparse.ArgumentParser, n_default: int, n_zero: bool = False) -> None:
    """n_zero: -n 0 means a prefill alone (run); elsewhere it is refused."""
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=n_default, metavar="N",
                   help="tokens to generate at most; -1: until the end of text or until the "
                   "context is full" + ("; 0: prefill the prompt only and print its timing, as "
                                        "llama.cpp's -n 0" if n_zero else ""))
    g.add_argument("--temp", type=float, default=0.8, metavar="T",
                   help="temperature; 0 is greedy")
    g.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="keep only the K most likely tokens; 0 keeps all")
    g.add_argument("--top-p", type=float, default=0.95, metavar="P",
                   help="keep the most likely tokens up to this probability mass; 1 keeps all")
    g.add_argument("--min-p", type=float, default=0.05, metavar="P",
                   help="drop tokens less likely than P times the most likely one; 0 keeps all")
    g.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                   help="penalize the tokens of the last 64 (llama.cpp's repeat penalty); 1 "
                   "is off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtracted from a token's logit once per time it occurred (OpenAI's); "
                   "0 is off")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="subtracted from the logit of every token that occurred (OpenAI's); 0 "
                   "is off")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed, for reproducible sampling (default: a new one each run)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR; repeatable (default: none)")


def sampling_kwargs(a: argparse.Namespace, ctx: int) -> dict:
    """generate()'s sampling arguments; -n -1 asks for the whole context (generate stops where
    the prompt leaves no room)."""
    return dict(max_tokens=ctx if a.max_tokens == -1 else a.max_tokens, temperature=a.temp,
                top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
                frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
                seed=a.seed, stop=a.stop)

