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
    """Bytes of weights one decode token reads: every linear layer once, one embedding row."""
    from ..weights.linear import DenseLinear, QuantLinear

    def nbytes(lin) -> int:
        if isinstance(lin, QuantLinear):
            return lin.packed.nbytes
        if isinstance(lin, DenseLinear):
            return lin.weight.numel() * lin.weight.element_size()
        return 0

    w = engine.weights
    total = nbytes(w.output) + w.embed.raw.shape[1]
    for layer in w.layers:
        fused = [layer.attn_qkv, layer.ffn_gate_up]
        parts = [layer.attn_q, layer.attn_k, layer.attn_v] if layer.attn_qkv is None else []
        parts += [layer.ffn_gate, layer.ffn_up] if layer.ffn_gate_up is None else []
        total += sum(nbytes(x) for x in fused + parts + [layer.attn_output, layer.ffn_down])
    return total


def memory_read_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Read bandwidth of the memory the weights live in: a sum over a buffer larger than cache
    on CPU, a device-to-device copy (bytes read + written) on CUDA."""
    a = torch.ones(nbytes // 4, device=device)
    if device.type == "cuda":
        b = torch.empty_like(a)
        t = min(_timed_fn(device, lambda: b.copy_(a)) for _ in range(5))
        del a, b
        torch.cuda.empty_cache()
        return 2 * nbytes / t / 1e9
    t = min(_timed_fn(device, lambda: a.sum()) for _ in range(5))
    return nbytes / t / 1e9


def h2d_pinned_gbps(nbytes: int = 256 << 20, reps: int = 4) -> float:
    """Pinned host-to-device copy bandwidth (CUDA), the tier-B streaming link."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")

    def copies() -> None:
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)

    dev.copy_(host, non_blocking=True)  # warm-up
    t = _timed_fn(torch.device("cuda"), copies)
    host = dev = None
    torch.cuda.empty_cache()  # probe buffers must not stay reserved under a VRAM budget
    return reps * nbytes / t / 1e9


def span_read_gbps(path, spans: list[tuple[int, int]], io: str = "direct",
                   limit: int | None = None) -> tuple[float, str]:
    """GB/s of reading `spans` of a file in order, one read at a time (whole spans, until
    `limit` bytes), through the streaming reader: O_DIRECT bypasses the page cache, so it
    measures the disk even when the file was just written. Returns (GB/s, the read mode:
    "direct", or "buffered" where asked for or where the filesystem refused O_DIRECT)."""
    from ..memory.disk import AlignedBuffer, DirectReader

    reader = DirectReader(path, threads=1, io=io)
    buf = AlignedBuffer(max(e - s for s, e in spans) + 8192)
    try:
        total, t0 = 0, time.perf_counter()
        for s, e in spans:
            reader.read_span(buf, s, e).result()
            total += e - s
            if limit is not None and total >= limit:
                break
        return total / (time.perf_counter() - t0) / 1e9, reader.mode
    finally:
        reader.close()
        buf.close()


def disk_read_gbps(path, nbytes: int = 4 << 30, block: int = 256 << 20) -> tuple[float, str]:
    """O_DIRECT sequential read bandwidth over a file's first `nbytes`, in `block`-sized reads
    (each issued as the reader's 16 MiB preadv chunks, like dd on one thread)."""
    import os

    size = min(nbytes, os.path.getsize(path))
    return span_read_gbps(path, [(s, min(s + block, size)) for s in range(0, size, block)])


def _timed_fn(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _result(test: str, n: int, times: list[float]) -> BenchResult:
    rates = [n / t for t in times]
    std = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return BenchResult(test, n, statistics.mean(rates), std, times)
