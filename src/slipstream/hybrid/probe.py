"""What the CPU's share costs on this machine, probed before a split is planned (hybrid.plan):
the GB/s of the CPU kernel the shares run on (`cpu_packed_gbps`), alone or beside pinned copies
to the GPU (they share host memory), and its cost by pass width (`cpu_token_scaling`)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ..weights.cpu import kind_for
from ..weights.cpu.groups import INT4_GROUP
from ..weights.cpu.torch_kernels import pack_int4
from ..weights.cpu import vnni

TOKEN_WIDTHS = (1, 2, 4, 8)  # the pass widths the crossover probe times


@functools.lru_cache(maxsize=None)
def cpu_packed_gbps(threads: int, rows: int = 16384, cols: int = 8192, reps: int = 12,
                    beside_copy: bool = False, copy_bytes: int = 128 << 20,
                    kind: str | None = None) -> tuple[float, float | None]:
    """GB/s of hybrid's CPU kernel for Q4_K (_host_matmul) on one token against a weight larger
    than the caches (probe_rows), with `threads` threads: the rate the CPU's share runs at.
    beside_copy (CUDA): the kernel runs while pinned host-to-device copies do, as in hybrid decode, since both read
    host memory and slow each other down (on the H200 host the kernel alone read 76 GB/s and
    51 GB/s during decode, where the share was set from the 76). Returns the kernel's GB/s
    and, beside_copy, the copies' GB/s measured over the same time (else None), copying
    `copy_bytes` at a time into a device buffer of that size. kind: the CPU layout timed
    (None: kind_for's for Q4_K now). Measured once per process and setting."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one, weight_bytes = _host_matmul(rows, cols, 1, kind)
        for _ in range(2):
            one()
        if not beside_copy:
            t0 = time.perf_counter()
            for _ in range(reps):
                one()
            return weight_bytes * reps / (time.perf_counter() - t0) / 1e9, None
        return _beside_copy(one, weight_bytes, copy_bytes)
    finally:
        torch.set_num_threads(saved)


def _host_matmul(rows: int, cols: int, tokens: int, kind: str | None = None):
    """A call of the CPU kernel hybrid decode runs Q4_K on (kind, or kind_for's: q4vnni, or
    torch's int4 kernel) on `tokens` rows against a random (rows, cols) weight, and the
    weight's bytes in that layout."""
    x = torch.randn(tokens, cols, dtype=torch.bfloat16,
                    generator=torch.Generator().manual_seed(1))
    kind = kind or kind_for(GGMLQuantizationType.Q4_K)
    if kind == "q4vnni":
        linear = _q4vnni_weight(probe_rows(rows, cols), cols)
        return (lambda: linear.kernel(x)), linear.nbytes
    packed, scale_zeros = _int4_weight(rows, cols)

    def one() -> None:
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scale_zeros)

    return one, packed.numel() + scale_zeros.numel() * 2


# The q4vnni probe's weight is at least PROBE_CACHE_MULTIPLE times the host's last-level
# cache. The H100 and H200 hosts have a 300 MiB L3: at 16384 x 8192 (96 MiB of records) the
# H200 host's probe read 149.8 GB/s beside the copies and decode's share 74.5; at 4x that
# (402 MB) the probes still read 72-150 GB/s where decode's shares, 11 GB a token, ran at
# 62-84, and on the H100 a 95.1 GB/s probe set a 0.598 share that left the copies idle 20 ms
# of a 189 ms token. Its records are written directly, so a large one
# costs little (int4pack's, packed from codes, keeps its size: the default plan is left as
# measured).
PROBE_CACHE_MULTIPLE = 3
PROBE_MAX_BYTES = 2 << 30
PROBE_TILE = 64  # row blocks of random records the probe weight repeats


def last_level_cache_bytes() -> int:
    """The largest CPU cache this host reports (Linux sysfs), or 64 MiB where it says none."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best or 64 << 20


def probe_rows(rows: int, cols: int, bits_per_weight: float = 6.0) -> int:
    """The probe weight's rows: at least `rows`, and enough that a weight of `cols` columns
    at q4vnni's bits per weight is PROBE_CACHE_MULTIPLE times the last-level cache (at most
    PROBE_MAX_BYTES), in 64-row blocks."""
    want = min(PROBE_CACHE_MULTIPLE * last_level_cache_bytes(), PROBE_MAX_BYTES)
    need = int(want * 8 / bits_per_weight / cols)
    return -(-max(rows, need) // 64) * 64


@functools.lru_cache(maxsize=2)
def _q4vnni_weight(rows: int, cols: int):
    """A random weight in the q4vnni layout Q4_K takes (Q4_K's own scales: d and dmin 0.01,
    scales, mins and codes random), made in its records directly: packing random Q4_K bytes
    took 9 s for a quarter of this size on 2 cores. Random bytes are drawn for PROBE_TILE
    row blocks and repeated (a parallel copy): drawing all of a 900 MB probe weight (three
    300 MiB caches) took 6 s of a 70B's load on one core, and the kernel's time depends on
    the bytes it reads, not on their values."""
    gen = torch.Generator().manual_seed(0)
    blocks, groups = -(-rows // vnni.Q4V_ROWS), cols // INT4_GROUP
    tile_blocks = min(blocks, PROBE_TILE)
    tile = torch.randint(0, 256, (tile_blocks, groups, vnni.Q4V_KS_RECORD_BYTES),
                         dtype=torch.uint8, generator=gen)
    runs = tile.view(tile_blocks, groups // vnni.Q4V_KS_RUN, -1)  # each run: d and dmin first
    runs[..., :4 * vnni.Q4V_ROWS] = torch.full(
        (tile_blocks, groups // vnni.Q4V_KS_RUN, 2 * vnni.Q4V_ROWS), 0.01,
        dtype=torch.float16).view(torch.uint8)
    packed = tile.repeat(-(-blocks // tile_blocks), 1, 1)[:blocks]  # a contiguous prefix
    return vnni.Q4VnniLinear(packed, rows)


@functools.lru_cache(maxsize=2)
def _int4_weight(rows: int, cols: int):
    """A random int4pack weight and its scales (packed once: the probes share it)."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    scale_zeros = torch.full((cols // INT4_GROUP, rows, 2), 0.01, dtype=torch.bfloat16)
    return pack_int4(u), scale_zeros


@functools.lru_cache(maxsize=None)
def cpu_token_scaling(threads: int, rows: int = 16384, cols: int = 8192, reps: int = 4,
                      widths: tuple[int, ...] = TOKEN_WIDTHS, kind: str | None = None
                      ) -> dict[int, float]:
    """Hybrid's CPU kernel's time (_host_matmul) on m tokens over its time on one, for each m
    of `widths`, with `threads` threads: one token reads the weight at memory speed, several
    multiply it more times than the bytes cost (above a few tokens the CPU is FLOP-bound). Measured once
    per process and setting, each width on the same weight, best of `reps`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = {}
        for m in widths:
            one, _ = _host_matmul(rows, cols, m, kind)
            one()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                one()
                best = min(best, time.perf_counter() - t0)
            seconds[m] = best
        return {m: seconds[m] / seconds[widths[0]] for m in widths}
    finally:
        torch.set_num_threads(saved)


def _beside_copy(one, weight_bytes: int, copy_bytes: int,
                 total: int = 3 << 30) -> tuple[float, float]:
    """Run `one` (a CPU matvec over weight_bytes) back to back while pinned copies of
    copy_bytes, `total` bytes in all, run on a CUDA stream (about 55 ms at PCIe 5): both
    rates over that time. The copies cycle through a pinned buffer larger than the last-level
    cache (probe_rows' multiple, at most 1 GiB), as decode's copies read images never in it:
    one buffer copied again and again could be served partly from the cache."""
    chunks = max(1, min(PROBE_CACHE_MULTIPLE * last_level_cache_bytes(), 1 << 30)
                 // copy_bytes)
    host = torch.empty(chunks, copy_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev.copy_(host[0])  # warm the link
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record(stream)
        for k in range(copies := max(1, total // copy_bytes)):
            dev.copy_(host[k % chunks], non_blocking=True)
        end.record(stream)
    n = 0
    t0 = time.perf_counter()
    while not end.query() or n < 2:
        one()
        n += 1
    cpu_s = time.perf_counter() - t0
    end.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    return weight_bytes * n / cpu_s / 1e9, copy_bytes * copies / copy_s / 1e9


def clear_weights() -> None:
    """Drop the probes' weights (their results stay cached)."""
    _int4_weight.cache_clear()
    _q4vnni_weight.cache_clear()
