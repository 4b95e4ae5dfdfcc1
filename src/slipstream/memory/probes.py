"""Bandwidth probes: what the links weights cross do on this machine now.

The planner predicts a streamed model's speed from these (memory.setup.measure_bandwidths), and
the benchmarks report achieved rates against them. Memory read (a sum on CPU, a device copy on
CUDA), pinned host-to-device copies, and sequential reads of file spans through the streaming
reader (O_DIRECT, so a file just written is read from the disk, not the page cache).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

from ..model.layer_spec import head_tensor_name
from ..model.llama import block_forward
from ..model.rope import RopeTable
from ..model.step import append_step
from ..weights.cpu import PackedDecodeLinear, kind_for, pack_linear
from ..weights.cpu_image import cpu_image_of, decode_layer
from ..weights.linear import GEMV_MAX_ROWS, DenseLinear
from ..weights.loader import LayerBuilder, TensorSource, layer_span, raw_tensor
from .disk import AlignedBuffer, DirectReader
from .store import steady_heap


def steal_seconds(stat: str = "/proc/stat") -> float | None:
    """All cores' steal time so far: what the hypervisor ran elsewhere while this machine's
    vCPUs wanted to run (the first line of /proc/stat, in USER_HZ ticks of 1/100 s), or None
    where there is no such file."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
        return int(fields[8]) / 100.0
    except (OSError, IndexError, ValueError):
        return None


class StealMeter:
    """Cores the hypervisor took from this machine over a span of wall time: `with
    StealMeter() as m: ...`, then m.cores (None where steal time is not reported)."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        self.cores: float | None = None

    def __enter__(self) -> "StealMeter":
        self._start = (steal_seconds(self.stat), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        steal, t = steal_seconds(self.stat), time.perf_counter()
        if steal is not None and self._start[0] is not None and t > self._start[1]:
            self.cores = max(steal - self._start[0], 0.0) / (t - self._start[1])


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


# --- what a CPU decode step costs ------------------------------------------------------------
# A CPU decode token's layers are made from the bytes read for them (at "exact" each streamed
# layer is rebuilt, dequantized into dense weights; at "fast" it is views into its packed
# image), then every layer and the head compute as matvecs, whose speed per byte is far from
# the memory's (a decode step through a float16 layer ran at 3.5 GB/s where a float32 sum
# reads 15 GB/s, on the 2-core CI machine). So the plan's CPU prediction needs those rates,
# measured here on one real layer the way the store and the engine use it.

PROBE_CTX = 64  # KV slots of the probe's decode step: a short context, as at a run's start


def cpu_decode_rates(gf, cfg, precision, layer: int, resident_bytes: int, head_bytes: int,
                     time_budget_s: float = 0.5, max_reps: int = 25) -> dict[str, float]:
    """GB/s of one CPU decode step's parts, measured on layer `layer` of `gf` the way the disk
    store and the engine treat a streamed layer: made from its bytes in RAM, then run through
    one decode step at once.

    "rebuild": the bytes a streamed layer moves per token turned into the layer, per second:
      at precision.cpu_packed_decode its packed image (weights.cpu_image) made into views
      (DiskLayerStore's decode layers), else its GGUF span built into the dense layer
      (DiskLayerStore's rebuild, on the heap it keeps steady: store.steady_heap);
    "compute": the bytes the planner counts a layer's decode by (its image's at precision.
      cpu_packed_decode, else its resident RAM bytes, `resident_bytes`: setup.
      layer_resident_bytes, the plan's per-layer sizes, Plan.cpu_token_seconds) through one
      decoder block's decode step per second
      (block_forward at a short context: the matvecs, norms, RoPE, attention and residuals,
      whatever kernels the layer uses), timed right after the layer is made, as a streamed
      layer runs; a resident layer, out of cache after a whole token of other layers, costs
      about the same;
    "gemv": the head's decode bytes (`head_bytes`: setup.head_decode_bytes, as the planner
      counts them) per second through one matvec: the head itself, packed, at
      precision.cpu_packed_decode; else the layer's ffn_down at precision.weight_dtype (whose
      bytes are counted here, not `head_bytes`).

    A build and its step run once to warm up (first-call paths), then again while
    `time_budget_s` lasts (at most `max_reps` times); the medians count, so that a burst of
    load from elsewhere on a shared machine moves none of them much. A layer too slow to
    repeat within the budget counts its first run."""
    # a mixture of experts has no packed layer image (weights.cpu_image holds the dense FFN):
    # its layer is built as a resident one is
    if precision.cpu_packed_decode and not cfg.n_experts:
        data, layout = cpu_image_of(gf, cfg, precision, layer)
        moved = layout.nbytes

        def make():
            return decode_layer(layout, data)
    else:
        start, end = layer_span(gf, layer)
        data = _file_bytes(gf.path, start, end)
        moved = end - start
        steady_heap(moved)
        builder = LayerBuilder(cfg, torch.device("cpu"), precision)
        src = TensorSource(gf, buffer=data, base=start)

        def make():
            return builder.build(src, layer)
    held: list = [None]

    def build_and_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        weights = make()
        t1 = time.perf_counter()
        step = _decode_step(cfg.layer(layer), weights)  # (its own shapes: Gemma 4)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        # the engine holds the layer it ran last until the next one is built: so here
        held[0] = weights
        return t1 - t0, t3 - t2

    builds, steps = zip(*_repeat(build_and_step, time_budget_s, max_reps))
    if precision.cpu_packed_decode:
        head, x = _packed_head(gf, cfg), torch.randn(1, cfg.hidden)
    else:
        head, x = held[0].ffn_down, torch.randn(1, cfg.layer(layer).ffn)

    def gemv() -> tuple[float]:
        t0 = time.perf_counter()
        head(x)
        return (time.perf_counter() - t0,)

    (gemvs,) = zip(*_repeat(gemv, time_budget_s, max_reps))
    if not precision.cpu_packed_decode:
        head_bytes = (cfg.hidden * cfg.layer(layer).ffn
                      * torch.finfo(precision.weight_dtype).bits // 8)
    return {"rebuild": moved / _median(builds) / 1e9,
            "compute": (moved if precision.cpu_packed_decode else resident_bytes)
            / _median(steps) / 1e9,
            "gemv": head_bytes / _median(gemvs) / 1e9}


def _packed_head(gf, cfg):
    """The head's decode linear as a resident model's is (its packed copy; the dense weight
    where no layout reads its format, weights.loader.LayerBuilder._packed_decode)."""
    name = head_tensor_name(gf.tensors)
    qtype, shape = gf.tensors[name].ggml_type, (cfg.vocab_size, cfg.hidden)
    if kind_for(qtype) is None:
        return DenseLinear(TensorSource(gf).dense(name, shape, torch.float16,
                                                  torch.device("cpu")))
    return PackedDecodeLinear.decode_only(pack_linear(raw_tensor(gf, name, shape), qtype, shape),
                                          GEMV_MAX_ROWS)


def _file_bytes(path, start: int, end: int) -> torch.Tensor:
    """File bytes [start, end) as a uint8 tensor in RAM (through the page cache: the rebuild
    is timed, not the read)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=end - start, offset=start))


def _decode_step(cfg, weights) -> Callable[[], object]:
    """One decode token through the layer, as the engine runs it: at position PROBE_CTX - 1,
    with a KV cache of PROBE_CTX slots (the rewrites of the same slot change nothing timed)."""
    cpu = torch.device("cpu")
    # RoPE frequency factors (Llama 3) change the angles, not the work: left out
    rope = RopeTable(cfg, PROBE_CTX, cpu)
    k_cache = torch.zeros(cfg.n_kv_heads, PROBE_CTX, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    step = append_step(PROBE_CTX - 1, 1, cpu)
    cos_sin = rope.angles(step.positions)
    x = torch.randn(1, cfg.hidden)
    return lambda: block_forward(cfg, weights, x, cos_sin, step, k_cache, v_cache, rope)


def _repeat(fn: Callable[[], tuple[float, ...]], budget_s: float,
            max_reps: int) -> list[tuple[float, ...]]:
    """fn()'s timings: one warm-up run, then runs while `budget_s` lasts (at most `max_reps`);
    the warm-up's own where it alone took longer than the budget (a second run would double
    a probe that is already slow)."""
    t0 = time.perf_counter()
    first = fn()
    if time.perf_counter() - t0 > budget_s:
        return [first]
    runs: list[tuple[float, ...]] = []
    deadline = time.perf_counter() + budget_s
    while len(runs) < max_reps and (not runs or time.perf_counter() < deadline):
        runs.append(fn())
    return runs


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]
