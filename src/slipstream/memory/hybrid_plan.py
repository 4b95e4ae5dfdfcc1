"""When and how much hybrid decode gives the CPU: the split of each pinned-tier layer's FFN
(weights.hybrid) chosen so that the CPU's share and the PCIe copy of the rest finish together,
from the CPU's packed-matvec GB/s and the pinned copy GB/s measured on this machine.

Per streamed layer of image bytes B with FFN bytes F, a CPU share s of the FFN's units takes
s F c / C + h seconds on the CPU's side (c: the CPU layout's bytes per GGUF byte, C its GB/s,
h the hand-over: two small copies, a host wait and the launches up to the next split layer)
while PCIe moves B - s F at P GB/s. Both finish together at s = (B / P - h) / (F / P + F c / C),
and decode is bound by the larger of the two. Tier C (disk) layers stay whole on the GPU: the CPU
would have to read them from disk too.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

# Tokens up to which a split layer's CPU share runs on the CPU (decode, small trees); larger
# passes (prefill, big speculation trees) are FLOP-bound on the CPU and copy whole layers.
HYBRID_MAX_TOKENS = 8
# Time per split layer and token on the CPU's side of the pipeline besides its matvecs: the
# normed input's copy down and the wait for it, the result's copy up, and the host launching
# the GPU work up to the next split layer, which the host cannot run ahead of while it waits.
# Measured on the H200 (bench/results/2026-12-01-s8-hybrid-bench-h200-call5): the 8B's split
# layers took about 3 ms each against 1.2 ms of CPU time, before the store cached each
# layer's views (about a millisecond of Python per layer); 1 ms is the estimate after.
HANDOVER_S = 1.0e-3
MODES = ("auto", "off", "on")


@dataclass
class HybridPlan:
    """The split of the plan's pinned layers between CPU and PCIe."""

    cpu_share: float  # of each split layer's FFN units, computed on the CPU
    keep: int  # FFN units each split layer keeps on the GPU (weights.hybrid.split_point)
    layers: list[int]  # the split layers (pinned tier, splittable FFN)
    cpu_gbps: float  # the CPU's packed-matvec rate measured at start-up
    pcie_gbps: float
    threads: int
    cpu_bytes_per_token: int  # packed bytes the CPU reads per decode token
    pcie_bytes_per_token: int  # bytes the split layers still copy per decode token
    predicted_tok_s: float | None = None
    plain_tok_s: float | None = None  # the same plan without the split
    note: str = ""
    extra_ram_bytes: int = 0  # the CPU's packed copies, next to the pinned images
    gguf_ffn_bytes: dict[int, int] = field(default_factory=dict)


def parse_hybrid(value: str | float | None) -> str | float:
    """--hybrid's value: auto, off, on, or a CPU share in (0, 1] (BadArgument otherwise)."""
    from ..errors import BadArgument

    if value is None:
        return "auto"
    if isinstance(value, str) and value in MODES:
        return value
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0.0 < share <= 1.0:  # NaN fails too
        raise BadArgument(f"--hybrid {value!r} is invalid: give auto, off, on, or the CPU's "
                          f"share of each streamed layer's FFN in (0, 1]")
    return share


def default_threads() -> int:
    """Three quarters of the cores: on the H200 host (16 cores) 12 threads ran the CPU's share
    at 49.9 GB/s beside a pinned copy at 53.3 GB/s, where 16 threads fell to 39.5 GB/s and
    starved nothing but themselves (issue 13's measurement); the rest feed the copy engine,
    the disk readers and the Python thread that drives the GPU."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (3 * (n or 4)) // 4)


@functools.lru_cache(maxsize=None)
def cpu_packed_gbps(threads: int, rows: int = 16384, cols: int = 8192, reps: int = 12) -> float:
    """GB/s of torch's int4 CPU kernel on one token against a 64 MiB weight (larger than the
    caches), with `threads` threads: the rate the CPU's share runs at. Measured once per
    process and thread count."""
    import torch

    from ..weights.cpu_packed import INT4_GROUP, _pack_int4

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        u = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
        packed = _pack_int4(u)
        scale_zeros = torch.full((cols // INT4_GROUP, rows, 2), 0.01, dtype=torch.bfloat16)
        x = torch.randn(1, cols, dtype=torch.bfloat16, generator=gen)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        for _ in range(2):
            mm(x, packed, INT4_GROUP, scale_zeros)
        t0 = time.perf_counter()
        for _ in range(reps):
            mm(x, packed, INT4_GROUP, scale_zeros)
        seconds = (time.perf_counter() - t0) / reps
        return (packed.numel() + scale_zeros.numel() * 2) / seconds / 1e9
    finally:
        torch.set_num_threads(saved)


def balanced_share(image_bytes: int, ffn_bytes: int, cpu_ratio: float, pcie_gbps: float,
                   cpu_gbps: float, handover_s: float = 0.0) -> float:
    """The CPU share of the FFN at which CPU and PCIe finish the split layers together (module
    doc), the CPU's side also paying `handover_s` (the layers' hand-overs); in [0, 1]."""
    if ffn_bytes <= 0 or cpu_gbps <= 0:
        return 0.0
    pcie, cpu = pcie_gbps * 1e9, cpu_gbps * 1e9
    share = (image_bytes / pcie - handover_s) / (ffn_bytes / pcie + ffn_bytes * cpu_ratio / cpu)
    return max(0.0, min(1.0, share))


def decode_seconds(image_bytes: list[int], ffn_bytes: list[int], share: float,
                   cpu_ratio: float, pcie_gbps: float, cpu_gbps: float) -> tuple[float, int, int]:
    """A decode token's time through the split layers (PCIe and CPU in parallel, plus the
    hand-over), and the bytes each side moves."""
    cpu_bytes = int(sum(share * f * cpu_ratio for f in ffn_bytes))
    pcie_bytes = int(sum(b - share * f for b, f in zip(image_bytes, ffn_bytes)))
    seconds = max(pcie_bytes / (pcie_gbps * 1e9), cpu_bytes / (cpu_gbps * 1e9))
    return seconds + (HANDOVER_S * len(image_bytes) if share > 0 else 0.0), cpu_bytes, pcie_bytes


def plan_hybrid(gf, cfg, plan, mode: str | float = "auto", threads: int | None = None,
                cpu_gbps: float | None = None) -> HybridPlan | None:
    """The split for `plan` (CUDA, bandwidths measured), or None when hybrid decode is off, has
    no pinned layer to split, or (mode "auto") would not be at least 5% faster than copying
    whole layers. mode: "auto", "on" (split at the balanced share whatever it predicts), "off",
    or a CPU share in (0, 1] (measurements). cpu_gbps: measured here when not given."""
    from gguf import GGMLQuantizationType

    from ..weights.cpu_packed import packed_nbytes
    from ..weights.hybrid import layer_splittable, split_point
    from ..weights.loader import TensorSource

    share_given = None
    if not isinstance(mode, str):
        share_given = float(mode)
        if not 0.0 < share_given <= 1.0:
            raise ValueError(f"a hybrid CPU share must be in (0, 1], not {share_given!r}")
    elif mode not in MODES:
        raise ValueError(f"hybrid must be one of {', '.join(MODES)} or a share, not {mode!r}")
    if mode == "off" or plan.device != "cuda":
        return None
    pcie = plan.bandwidth_gbps.get("pinned")
    src = TensorSource(gf)
    layers = [i for i, t in enumerate(plan.tiers)
              if t == "pinned" and layer_splittable(src, cfg, i)]
    if not layers or not pcie:
        return None
    threads = threads or default_threads()
    cpu = cpu_gbps or cpu_packed_gbps(threads)
    ffn, ratio_num, ratio_den = [], 0, 0
    for i in layers:
        f = 0
        for n in ("ffn_gate", "ffn_up", "ffn_down"):
            info = gf.tensors[f"blk.{i}.{n}.weight"]
            f += info.n_bytes
            q = GGMLQuantizationType(int(info.ggml_type))
            ratio_num += packed_nbytes(q, (int(info.shape[0]), int(info.shape[1]))) or 0
            ratio_den += info.n_bytes
        ffn.append(f)
    cpu_ratio = ratio_num / ratio_den  # the CPU layout's bytes per GGUF byte
    image = [plan.file_bytes_per_layer[i] for i in layers]
    share = share_given if share_given is not None else balanced_share(
        sum(image), sum(ffn), cpu_ratio, pcie, cpu, HANDOVER_S * len(layers))
    keep = split_point(cfg.ffn, share)
    keep = max(min(keep, cfg.ffn - 256), 256)  # each side at least one aligned block
    share = 1.0 - keep / cfg.ffn
    split_s, cpu_bytes, pcie_bytes = decode_seconds(image, ffn, share, cpu_ratio, pcie, cpu)
    plain = plan.predicted_tok_s
    predicted = None
    if plain:
        whole_s = sum(image) / (pcie * 1e9)
        predicted = 1.0 / (1.0 / plain - whole_s + split_s)
    hp = HybridPlan(share, keep, layers, cpu, pcie, threads, cpu_bytes, pcie_bytes,
                    predicted, plain, extra_ram_bytes=cpu_bytes,
                    gguf_ffn_bytes=dict(zip(layers, ffn)))
    if mode == "auto" and not (predicted and plain and predicted >= 1.05 * plain):
        return None
    return hp
