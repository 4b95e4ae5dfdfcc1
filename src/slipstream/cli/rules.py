"""Every argument's own errors, checked before anything loads (a load may take minutes): each
raises BadArgument naming the flag, the value and what it must be, which main() prints as one
line."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from ..errors import BadArgument, ModelNotFound
from ..hub import store
from ..hub.pull import resolve
from ..hub.refs import parse_ref
from .options import DEFAULT_PROMPT

SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
N_RULE = ">= 1, or -1 (until the end of text or the context)"
N_RULE_RUN = ">= 0 (0: prefill only), or -1 (until the end of text or the context)"
# (attribute, flag, check, rule); an attribute a command does not have is skipped
RULES = [
    ("max_tokens", "-n", lambda v: v == -1 or v >= 1, N_RULE),
    ("temp", "--temp", lambda v: v >= 0, ">= 0 (0 is greedy)"),
    ("top_k", "--top-k", lambda v: v >= 0, ">= 0 (0 keeps all)"),
    ("top_p", "--top-p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", "--min-p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("repeat_penalty", "--repeat-penalty", lambda v: v > 0, "> 0 (1 is off)"),
    ("frequency_penalty", "--frequency-penalty", lambda v: True, ""),
    ("presence_penalty", "--presence-penalty", lambda v: True, ""),
    ("seed", "--seed", lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1],
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
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_args(a: argparse.Namespace) -> None:
    """Every argument's own errors, before anything loads (a load may take minutes): raises
    BadArgument naming the flag, the value and what it must be."""
    place_positionals(a)
    check_draft_args(a)
    for attr, flag, ok, rule in RULES:
        value = getattr(a, attr, None)
        if value is None:
            continue
        if attr == "max_tokens" and getattr(a, "command", None) == "run":
            ok, rule = (lambda v: v >= -1), N_RULE_RUN  # run's -n 0: the prefill alone
        if isinstance(value, float) and not math.isfinite(value):
            raise BadArgument(f"{flag} {value} is invalid: must be a finite number")
        if not ok(value):
            raise BadArgument(f"{flag} {value} is invalid: must be {rule}")
    if getattr(a, "hybrid", None) not in (None, "auto", "off", "on"):
        # the hybrid planner sits beside the CUDA store and its probes: imported only for a
        # share, so that a plain command starts without the engine
        from ..hybrid.plan import parse_hybrid

        parse_hybrid(a.hybrid)
    device = getattr(a, "device", None)
    if device is not None and not DEVICE.fullmatch(device):
        raise BadArgument(f"--device {device!r} is not supported: use auto, cpu, cuda or "
                          f"cuda:N")
    budgets = [(f, v) for f, v in (("--ram-budget", getattr(a, "ram_budget", None)),
                                   ("--vram-budget", getattr(a, "vram_budget", None)),
                                   ("--max-body", getattr(a, "max_body", None)))
               if v is not None]
    if budgets:
        from ..memory.budget import parse_size  # imports torch: only when a budget is given

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
        a.prompt = read_prompt(a.prompt, a.prompt_file)
    model = getattr(a, "model", None)
    if model is not None:
        # a path, a cached name, a Hub file or a URL, pulled if need be: last, since a pull
        # may take minutes; a missing file is refused here, before the seconds of imports
        a.model = str(resolve(model))


def names_a_model(word: str) -> bool:
    """Whether `run`'s lone positional names a model rather than being the prompt: an existing
    file, a name ending in .gguf (a missing one is then refused as a missing model, not sent to
    the model as a prompt), a URL or USER/REPO/FILE.gguf, or a cached model's name. Nothing
    here touches the network."""
    if word.lower().endswith(".gguf") or parse_ref(word) is not None:
        return True
    try:
        if Path(word).expanduser().is_file():
            return True
    except OSError:  # a prompt too long to be a path (ENAMETOOLONG)
        return False
    try:
        return store.find(word) is not None
    except ModelNotFound:  # several cached models match: it names a model, ambiguously
        return True


def place_positionals(a: argparse.Namespace) -> None:
    """`run [MODEL] [PROMPT]`, as `ollama run MODEL PROMPT` and llama.cpp users type it: two
    positionals are the model and the prompt; one is the model if it names one
    (names_a_model), else the prompt, so `run "hello"` prompts the default model. A model or
    prompt given twice (a positional and -m, or -p/-f) is refused."""
    if not hasattr(a, "pos_model"):
        return
    words = [w for w in (a.pos_model, a.pos_prompt) if w is not None]
    model = prompt = None
    if len(words) == 2:
        model, prompt = words
    elif words:
        model, prompt = (words[0], None) if names_a_model(words[0]) else (None, words[0])
    if model is not None:
        if a.model is not None:
            raise BadArgument(f"the model is given twice: -m {a.model!r} and {model!r}; give "
                              f"one")
        a.model = model
    if prompt is not None:
        given = "-p" if a.prompt is not None else "-f" if a.prompt_file is not None else None
        if given is not None:
            raise BadArgument(f"the prompt is given twice: {given} and {prompt!r}; give one")
        a.prompt = prompt


def check_draft_args(a: argparse.Namespace) -> None:
    """The draft flags' own errors, before anything loads (a load may take minutes)."""
    draft, skip = getattr(a, "draft", None), getattr(a, "draft_skip_layers", 0)
    lowbit = getattr(a, "draft_lowbit", None)
    given = [flag for flag, on in (("--draft", draft is not None), ("--draft-skip-layers", skip),
                                   ("--draft-lowbit", lowbit is not None)) if on]
    if len(given) > 1:
        raise BadArgument(f"{' and '.join(given)} are {len(given)} kinds of draft; give one")
    if lowbit is not None:
        from ..speculative.lowbit import parse_lowbit_type  # imports torch: only for this flag

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


def read_prompt(prompt: str | None, path: str | None) -> str:
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
