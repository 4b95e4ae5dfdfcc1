"""llama-bench style measurements: pp (a prompt in one batch) and tg (tokens generated one at a
time from an empty context), on random token ids, repeated and averaged."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

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


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def bench_prefill(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.cfg.vocab_size, (n_tokens,), generator=gen)
    engine.reset()
    engine.forward(ids[: min(n_tokens, 16)])  # warm-up: first-call allocations, thread pools
    times = []
    for _ in range(reps):
        engine.reset()
        _sync(engine)
        t0 = time.perf_counter()
        engine.forward(ids)
        _sync(engine)
        times.append(time.perf_counter() - t0)
    return _result(f"pp{n_tokens}", n_tokens, times)


def bench_decode(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.cfg.vocab_size, (n_tokens,), generator=gen)
    engine.reset()
    for i in range(4):  # warm-up
        engine.forward(ids[i: i + 1])
    times = []
    for _ in range(reps):
        engine.reset()
        _sync(engine)
        t0 = time.perf_counter()
        for i in range(n_tokens):
            engine.forward(ids[i: i + 1])
        _sync(engine)
        times.append(time.perf_counter() - t0)
    return _result(f"tg{n_tokens}", n_tokens, times)


def _result(test: str, n: int, times: list[float]) -> BenchResult:
    rates = [n / t for t in times]
    std = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return BenchResult(test, n, statistics.mean(rates), std, times)
