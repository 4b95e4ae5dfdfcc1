"""Every `SLIPSTREAM_*` environment variable, in one registry.

Each variable is read when it is asked for (`envs.get("SLIPSTREAM_CACHE")`), not at import, so
a test or a caller may set one after slipstream is imported. A bad value raises `BadArgument`
naming the variable and the values it takes. `docs/env-vars.md` is generated from this table:

    python -m slipstream.envs > docs/env-vars.md

Kinds:
- setting: a knob a user may turn in normal use;
- fallback: turns a fast path off where it misbehaves on some machine (same results, slower);
- opt-in: a path that is off by default until a GPU host has run it: a faster one until it is
  measured against the default (same results either way; the GPU tests check its bits), or a
  device for models that otherwise run on the CPU, until its GPU tests have passed;
- debug: for developers comparing paths or timing builds; not for normal use.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import BadArgument


def _flag(value: str) -> bool:
    if value in ("0", "1"):
        return value == "1"
    raise ValueError("0 or 1")


def _image_mode(value: str) -> str | bool:
    if value == "auto":
        return value
    return _flag(value)


def _seconds(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:  # also NaN
        raise ValueError("a number of seconds >= 0")
    return seconds


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise ValueError("a number of seconds > 0")
    return seconds


def _ahead_stage(value: str) -> str:
    if value in ("off", "input", "attention"):
        return value
    raise ValueError("off, input or attention")


def _text(value: str) -> str:
    return value


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # None: unset means "not given" (the reader falls back on its own)
    kind: str  # "setting", "fallback" or "debug"
    meaning: str
    parse: Callable[[str], Any] = _text
    accepts: str = "text"


REGISTRY: dict[str, EnvVar] = {}


def _register(*items: EnvVar) -> None:
    for item in items:
        REGISTRY[item.name] = item


_register(
    EnvVar("SLIPSTREAM_CACHE", None, "setting",
           "Folder of the model cache (`pull`, `list`, `rm`, `-m NAME`); default "
           "`~/.cache/slipstream`.", accepts="a folder path"),
    EnvVar("SLIPSTREAM_NATIVE_DIR", None, "setting",
           "Folder where the native CPU library is compiled and cached; default "
           "`~/.cache/slipstream/native`.", accepts="a folder path"),
    EnvVar("SLIPSTREAM_IO_TIMEOUT_S", "60", "setting",
           "Seconds a disk read may take before it is reported as a stalled disk rather than "
           "waited on (a 0.5 GB layer reads in 0.2 s at 2.3 GB/s).",
           _positive_seconds, "seconds > 0"),
    EnvVar("SLIPSTREAM_DIST_TIMEOUT", "60", "setting",
           "Seconds a `--distributed` rank waits on a peer before it reports it broken.",
           _positive_seconds, "seconds > 0"),
    EnvVar("SLIPSTREAM_CHECK_WEIGHTS", "1", "setting",
           "0: load a file whose tensors fail the load-time checks (a non-finite or absurd "
           "block scale, norm or bias; a renamed head or bias) with a warning instead of "
           "refusing it.", _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_GIL_SWITCH_S", "0.0001", "setting",
           "Python's GIL switch interval while hybrid decode's CPU worker runs (0 leaves it "
           "alone). The worker needs the GIL between native calls while the main thread "
           "enqueues CUDA work.", _seconds, "seconds >= 0"),
    EnvVar("SLIPSTREAM_API_KEY", None, "setting",
           "The key `slipstream serve` requires as `Authorization: Bearer KEY` (`--api-key` "
           "overrides it); unset: no key. Safer than the flag, which `ps` shows.",
           accepts="a key (any text)"),
    EnvVar("SLIPSTREAM_EXPERT_AHEAD", "off", "setting",
           "Where a mixture of experts with experts on disk (a CPU RAM budget below the "
           "model) guesses the next layer's experts, to read the cold ones ahead on a "
           "background thread: attention (after each layer's attention), input (at each "
           "layer's input) or off (cold experts read on the critical path). Same results "
           "either way; off by default: on random-weight files the guess found 18-46% of the "
           "cold experts, decode gained up to 1.14x with the file's pages dropped and lost "
           "to 0.86x with them cached (docs/benchmarks.md, expert-ahead).",
           _ahead_stage, "off, input or attention"),
    EnvVar("SLIPSTREAM_COMMIT", None, "debug",
           "Commit recorded in benchmark results where the tree is no git checkout (the GPU "
           "machine's copy).", accepts="a commit hash"),
    EnvVar("SLIPSTREAM_STALL_DUMP_S", "0", "debug",
           "Seconds after which a CPU share of hybrid decode still running has every thread's "
           "Python stack dumped to stderr (faulthandler's own thread, which needs no GIL: it "
           "shows a stall's cycle); 0: off.", _seconds, "seconds >= 0"),
    EnvVar("SLIPSTREAM_NATIVE", "1", "fallback",
           "0: never build or load the native CPU library; decode takes torch's ops (same "
           "math, slower).", _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_NATIVE_DEFINES", "", "debug",
           "Extra `-DNAME[=VALUE]` words for the native library's build (the matvec's prefetch "
           "distances), part of its cache key. For timing builds; the defaults are measured.",
           accepts="whitespace-separated -DNAME or -DNAME=VALUE"),
    EnvVar("SLIPSTREAM_Q4VNNI", "1", "fallback",
           "0: the CPU's quantized weights use torch's kernels (int4 for the 4-bit formats and "
           "Q8_0, int8 for Q6_K) instead of the native VNNI layouts (MXFP4, IQ4_NL and IQ4_XS, "
           "which no torch kernel reads, keep cb4; the i-quant grid formats IQ1_S to IQ3_S keep "
           "iq).",
           _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_PACKED_PREFILL", "1", "fallback",
           "0: a CPU prefill (more than 8 rows) multiplies dense float32 copies of the weights "
           "instead of the packed native decode copies (q4vnni, q8vnni, q6vnni: exact weights, "
           "16-bit activations, about twice the speed on 2 AVX-512 cores), in resident and "
           "streamed layers alike (streamed layers then rebuild dense weights from the GGUF "
           "file per prefill pass instead of computing on their packed images). A mixture of "
           "experts' routed experts take their packed kernels either way.",
           _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_CPU_IMAGE", "auto", "setting",
           "Whether a resident CPU model reads its packed decode copies from an image file "
           "cached beside the model (`MODEL.slipstream-cpu-resident.*.img`, written at the "
           "first load) instead of packing them at every load: auto for files of 256 MiB and "
           "more (a smaller one packs faster than its image is written), 1 always, 0 never.",
           _image_mode, "auto, 0 or 1"),
    EnvVar("SLIPSTREAM_FUSED_DECODE", "1", "debug",
           "0: CUDA decode uses torch's ops for RoPE, the cache write and attention instead of "
           "the fused Triton kernels, to compare the two.", _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_LAYER_GRAPHS", "0", "opt-in",
           "1: a streamed model's resident and split layers decode through CUDA graphs of "
           "their own, which cuts the host's enqueue time per layer.", _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_HOST_SIGNAL", "0", "opt-in",
           "1: hybrid decode's CPU share starts on a flag a GPU kernel raises in pinned "
           "memory, with no Python between the input landing and the share's result.",
           _flag, "0 or 1"),
    EnvVar("SLIPSTREAM_CUDA_MOE", "0", "opt-in",
           "1: a mixture of experts (Qwen3-MoE, Mixtral, gpt-oss) may run on CUDA, every "
           "expert in VRAM, or split with the CPU where the VRAM budget holds the dense part "
           "but not every expert; off until that path has run on a GPU (its kernels are "
           "tested in Triton's interpreter), so such a model needs --device cpu.", _flag,
           "0 or 1"),
    EnvVar("SLIPSTREAM_PINNED_EMBED", "0", "opt-in",
           "1: a streamed model's embedding table is pinned and read by the GPU, so a decode "
           "step's lookup needs no host sync (0.4-0.9 GiB of pinned RAM beside the budget).",
           _flag, "0 or 1"),
)


def get(name: str) -> Any:
    """The parsed value of `name`: the environment's, else the registry's default (None for a
    variable with no default that is unset). A value the variable does not take raises
    BadArgument with what it does take."""
    var = REGISTRY[name]  # KeyError: a name nobody registered is a bug, not a user error
    raw = os.environ.get(name)
    if raw is None or (raw == "" and var.default is None):
        return None if var.default is None else var.parse(var.default)
    try:
        return var.parse(raw)
    except ValueError:
        raise BadArgument(f"{name}={raw!r} is invalid: set it to {var.accepts}, or unset it "
                          f"(default {var.default!r})") from None


def is_set(name: str) -> bool:
    if name not in REGISTRY:
        raise KeyError(name)
    return os.environ.get(name) not in (None, "")


def markdown() -> str:
    """docs/env-vars.md: one table row a variable, grouped by kind."""
    lines = ["# Environment variables", "",
             "Generated from `src/slipstream/envs.py` by `python -m slipstream.envs`; edit the "
             "registry, not this file.", ""]
    titles = {"setting": "Settings", "fallback": "Fallbacks (same results, slower)",
              "opt-in": "Opt-in paths (off until a GPU host has measured or run them)",
              "debug": "Debug and benchmarking (not for normal use)"}
    for kind, title in titles.items():
        rows = [v for v in REGISTRY.values() if v.kind == kind]
        if not rows:
            continue
        lines += [f"## {title}", "", "| variable | default | takes | meaning |", "|---|---|---|---|"]
        for v in sorted(rows, key=lambda v: v.name):
            default = "unset" if v.default is None else f"`{v.default}`" if v.default else "empty"
            lines.append(f"| `{v.name}` | {default} | {v.accepts} | {v.meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
