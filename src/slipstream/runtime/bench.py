"""llama-bench style measurements: pp (a prompt in one batch) and tg (tokens generated one at a
time from an empty context), on random token ids, repeated and averaged.

On CUDA, time is taken with CUDA events around the whole run, and decode steps are fed from a
device tensor so the host never waits inside the timed loop. Warm-up runs the exact timed
workload once, so Triton compilation and CUDA-graph capture stay out of the figures (the engine
reports capture time separately in `graph_capture_s`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .engine import Engine


@dataclass
class BenchResult:
    test: str  # "pp512" or "tg128"
    tokens: int
    tok_s: float
    tok_s_std: float
    seconds: list[float]

    def as_dict(self) -> dict:
        return asdict(self)


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


def weight_bytes_per_token(engine: Engine) -> int:
    """Bytes of weights one decode token reads: every linear layer once (of the layers not
    skipped), one embedding row."""
    from ..weights.linear import DenseLinear, QuantLinear

    def nbytes(lin) -> int:
        if isinstance(lin, QuantLinear):
            return lin.packed.nbytes
        if isinstance(lin, DenseLinear):
            return lin.weight.numel() * lin.weight.element_size()
        return 0

    w = engine.weights
    total = nbytes(w.output) + w.embed.raw.shape[1]
    for i, layer in enumerate(w.layers):
        if i in engine.skip:
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
