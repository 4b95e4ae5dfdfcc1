"""llama-bench style measurements: pp (a prompt in one batch) and tg (tokens generated one at a
time from an empty context), on random token ids, repeated and averaged.

With a draft, tg decodes speculatively instead (bench_speculative): greedy tokens after a short
prompt of real text, since how many tokens a target pass yields depends on how well the draft
guesses them, which random ids would not show.

On CUDA, time is taken with CUDA events around the whole run, and decode steps are fed from a
device tensor so the host never waits inside the timed loop. Warm-up runs the exact timed
workload once, so Triton compilation and CUDA-graph capture stay out of the figures (the engine
reports capture time separately in `graph_capture_s`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from ..modelfile.gguf_file import GGUFFile
from ..weights.cpu import PackedDecodeLinear
from ..weights.linear import DenseLinear, QuantLinear
from .engine import Engine
from .generate import GenerationStats, TokenSource
from .layer_skip import calibration_text
from .sampler import Sampler, SamplingParams

SPEC_PROMPT_TOKENS = 32  # the speculative tg's prompt: the start of the calibration text
SPEC_ROOM = 64  # context left after a speculative tg: a default tree's verify pass fits


@dataclass
class BenchResult:
    test: str  # "pp512" or "tg128"
    tokens: int
    tok_s: float
    tok_s_std: float
    seconds: list[float]
    # speculative tg only (means over the runs): tokens one target pass yielded, target passes
    # per run, and the seconds per run spent growing trees with the draft and verifying them
    tokens_per_pass: float | None = None
    target_passes: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None

    def as_dict(self) -> dict:
        # a plain run's record keeps its keys: the speculative ones only where they apply
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def speculative(self) -> bool:
        return self.tokens_per_pass is not None


def _timed(engine: Engine, fn: Callable[[], None]) -> float:
    if engine.device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(engine.device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _ids(engine: Engine, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.cfg.vocab_size, (n,), generator=gen).to(engine.device)


def bench_prefill(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    ids = _ids(engine, n_tokens, seed)

    def run() -> None:
        engine.reset()
        engine.forward(ids)

    run()  # warm-up: kernel compilation, workspaces, thread pools
    times = [_timed(engine, run) for _ in range(reps)]
    return _result(f"pp{n_tokens}", n_tokens, times)


def bench_decode(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    ids = _ids(engine, n_tokens, seed)

    def run() -> None:
        engine.reset()
        for i in range(n_tokens):
            engine.decode(ids[i: i + 1])

    run()  # warm-up, including graph capture for every bucket the run touches
    times = [_timed(engine, run) for _ in range(reps)]
    return _result(f"tg{n_tokens}", n_tokens, times)


def spec_prompt(tokenize: Callable[[str], list[int]], n: int = SPEC_PROMPT_TOKENS) -> list[int]:
    """The first n tokens of the calibration text shipped with the package (plain prose)."""
    return tokenize(calibration_text())[:n]


def bench_speculative(engine: Engine, source: TokenSource, prompt: list[int], n_tokens: int,
                      reps: int = 3) -> BenchResult:
    """tg through a speculative token source: n_tokens greedy tokens after `prompt`, timed
    from the token the prefill draws (both models' prefills stay out, as tg has none) to the
    last one. Greedy, so every run decodes the same tokens with the same trees."""
    sampler = Sampler(SamplingParams(temperature=0.0), device=engine.device)

    def run() -> tuple[float, dict]:
        stats = GenerationStats()
        tokens = source(engine, prompt, sampler, n_tokens + 1, stats)
        next(tokens)  # the prefills
        seconds = _timed(engine, lambda: _drain(tokens))
        return seconds, stats.extra  # the source wrote its figures when it ran out

    run()  # warm-up: as bench_decode's, and the draft's too
    runs = [run() for _ in range(reps)]
    res = _result(f"tg{n_tokens}", n_tokens, [t for t, _ in runs])
    extras = [x for _, x in runs]

    def mean(key: str) -> float:
        return statistics.mean(float(x[key]) for x in extras)

    res.tokens_per_pass = mean("spec_tokens_per_pass")
    res.target_passes = mean("spec_target_passes")
    res.draft_s = mean("spec_draft_s")
    res.verify_s = mean("spec_verify_s")
    return res


def _drain(tokens: Iterator[torch.Tensor]) -> None:
    for _ in tokens:
        pass


def weight_bytes_per_token(engine: Engine, gguf: GGUFFile | None = None) -> int:
    """Bytes of weights one decode token reads: every linear layer once (of the layers not
    skipped), one embedding row. A streamed layer has no resident weights to measure: its
    tensors' bytes in `gguf` count (left out without it)."""
    def nbytes(lin) -> int:
        if isinstance(lin, PackedDecodeLinear):  # CPU decode reads the packed copy
            lin = lin.packed
        if isinstance(lin, QuantLinear):
            return lin.packed.nbytes
        if isinstance(lin, DenseLinear):
            return lin.weight.numel() * lin.weight.element_size()
        return int(getattr(lin, "nbytes", 0) or 0)  # the CPU's packed layouts

    w = engine.weights
    total = nbytes(w.output) + w.embed.raw.shape[1]
    for i, layer in enumerate(w.layers):
        if i in engine.skip:
            continue
        if layer is None:  # streamed: its layer's GGUF bytes cross the bus every token
            prefix = f"blk.{i}."
            total += sum(t.n_bytes for name, t in (gguf.tensors.items() if gguf else ())
                         if name.startswith(prefix))
            continue
        fused = [layer.attn_qkv, layer.ffn_gate_up]
        parts = [layer.attn_q, layer.attn_k, layer.attn_v] if layer.attn_qkv is None else []
        parts += [layer.ffn_gate, layer.ffn_up] if layer.ffn_gate_up is None else []
        total += sum(nbytes(x) for x in fused + parts + [layer.attn_output, layer.ffn_down])
    return total


def _result(test: str, n: int, times: list[float]) -> BenchResult:
    rates = [n / t for t in times]
    std = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return BenchResult(test, n, statistics.mean(rates), std, times)
