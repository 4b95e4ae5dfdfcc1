"""When and how much hybrid decode gives the CPU: the split of each pinned-tier layer's FFN
(hybrid.split) chosen so that the CPU's share and the PCIe copy of the rest finish together,
from the CPU's packed-matvec GB/s and the pinned copy GB/s measured on this machine, running
together (they share host memory; hybrid.probe).

Per streamed layer of image bytes B with FFN bytes F, a CPU share s of the FFN's units takes
s F c / C + f seconds on the CPU's side (c: the CPU layout's bytes per GGUF byte, C its GB/s
in decode, the probe's rate derated by DECODE_CPU_EFFICIENCY, f its fixed cost per layer)
while PCIe moves B - s F at P GB/s. Both finish together at
s = (B / P - f - h - g R / n) / (F / P + F c / C), where h is the hand-over per layer (the
split layer's attention, the input's copy down and the result's sum) and g the GPU's compute of
each of the R layers that do not split, over the n split ones: all of it lies on the chain, in
series with the CPU's shares, while the copy link goes on bringing the next layers, so the link
is given the bytes to fill it. Decode is bound by the larger of the two. Small layers
(an 8B's) have too little to share for f and h: auto then stays off. Tier C (disk) layers stay
whole on the GPU: the CPU would have to read them from disk too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
from gguf import GGMLQuantizationType

from ..errors import BadArgument
from ..memory.probes import StealMeter
from ..weights.cpu import kind_for, packed_nbytes
from ..weights.loader import TensorSource
from .probe import clear_weights, cpu_packed_gbps, cpu_token_scaling
from .split import layer_splittable, split_point

# The most tokens a split layer's CPU share may take (decode, small trees): the host buffers'
# size. Below it the plan's crossover (HybridPlan.max_tokens) is measured: passes above that
# are FLOP-bound on the CPU and copy whole layers. On the H200 a 70B pass of 8 tokens took
# 0.83 s split and 0.32 s whole.
HYBRID_MAX_TOKENS = 8
# Time per split layer and token besides the bytes each side moves. A decode token is a chain:
# every layer in order, each split layer's GPU part, then its CPU share, then the hand-back,
# while the copies of the streamed layers run beside the whole chain. Measured with --trace on
# an H100 (the 70B at 24 GiB, 36 split layers between 44 resident ones, 188.9 ms a token):
# - HANDOVER_S: a split layer's GPU part on the chain: its attention, the normed input's copy
#   down and the worker seeing it (0.153 ms from the layer's GPU start to the CPU starting),
#   and after the share the wait kernel seeing the flag and adding the result (about 0: the
#   GPU's own share of the FFN is done long before).
# - GPU_LAYER_S: a layer the GPU computes whole (0.328 ms a resident 70B layer, 0.30 an 8B
#   one: streamed plans run without CUDA graphs). 44 of them took 14.5 ms of the token.
# - CPU_FIXED_S: the CPU's cost per share besides its bytes (the Python and torch calls around
#   the two native matvecs: about 20 us on 2 cores here, more with 15 threads' fork-joins).
CPU_FIXED_S = 0.1e-3
HANDOVER_S = 0.16e-3
GPU_LAYER_S = 0.33e-3
LAYER_COST_S = CPU_FIXED_S + HANDOVER_S  # what the chain pays per split layer, any share
# Auto splits only where each layer's CPU share would take at least this long, by the probe's
# rate. The H200's 8B at 4 GiB split 11 layers at a 20% share (0.4 ms of CPU work a layer by
# the probe) and decoded at 20.1 tok/s against 29.3 whole, when the host still waited for each
# share. Forced on an H100 (the 8B at 4 GiB, 18 layers at a 0.64 share, float32 records:
# 0.83 ms a layer by the probe, 1.34 ms measured in the trace with 8.7 of 15 threads' cores
# busy) the split decoded at 34.05, then 24.9-29.2 in four repeats, at a 0.5 share 33.87,
# against 24.10 whole; auto at this threshold took the split and its balance kept 14 of 18
# layers on the CPU: 31.08. With Q4_K's own scales the same share is 0.64 ms by the probe.
MIN_CPU_LAYER_S = 0.5e-3
# Decode's CPU shares against the probe (cpu_packed_gbps beside a copy): on a 16-core H100
# host, with the threads taking chunks, the probe read 93.0 GB/s and decode's shares 80.6
# (85.9 once the balance had settled): a share from the probe's rate was 0.69 where the chain
# and the copies meet at about 0.63.
DECODE_CPU_EFFICIENCY = 0.87
MODES = ("auto", "off", "on")


@dataclass
class HybridPlan:
    """The split of the plan's pinned layers between CPU and PCIe."""

    cpu_share: float  # of each split layer's FFN units, computed on the CPU
    keep: int  # FFN units each split layer keeps on the GPU (hybrid.split.split_point)
    layers: list[int]  # the split layers (pinned tier, splittable FFN)
    cpu_gbps: float  # the CPU's packed-matvec rate measured at start-up
    pcie_gbps: float
    threads: int
    cpu_bytes_per_token: int  # packed bytes the CPU reads per decode token
    pcie_bytes_per_token: int  # bytes the split layers still copy per decode token
    predicted_tok_s: float | None = None
    plain_tok_s: float | None = None  # the same plan without the split
    note: str = ""
    # passes of up to this many tokens split (decode, small trees; from the CPU kernel's
    # measured cost by width, hybrid_max_tokens); larger ones copy whole layers
    max_tokens: int = 1
    extra_ram_bytes: int = 0  # the CPU's packed copies, next to the pinned images
    gguf_ffn_bytes: dict[int, int] = field(default_factory=dict)
    # mode "auto": decode keeps the split balanced as the CPU's measured rate changes
    # (hybrid.balance); a share or "on" given by the user stays as given
    rebalance: bool = False
    # cores the hypervisor took from the machine while the CPU's rate was probed (None: not
    # probed here, or not reported): on an H100 host with 1.1 cores stolen hybrid decode ran
    # at 3.9 tok/s against 5.2 predicted, the shares with about 6 of 15 threads' cores busy
    cores_stolen: float | None = None


def parse_hybrid(value: str | float | None) -> str | float:
    """--hybrid's value: auto, off, on, or a CPU share in (0, 1] (BadArgument otherwise)."""
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
    """All cores but one (15 of a 16-core GPU host's): the one left drives the GPU and the
    copy engine's submissions. Measured on the 70B at 24 GiB with hybrid on, each count's
    decode the mean of a sweep up and down on one load of an H200 host: 8 / 10 / 12 / 13 / 14 /
    15 / 16 threads, 4.42 / 4.45 / 4.86 / 4.95 / 4.94 / 5.12 / 4.75 tok/s; all 16 starve the
    pinned copy (the CPU's kernel beside it fell to 39.5 GB/s, from 49.9 at 12). With q4vnni
    on another H200 host: 14 / 15 / 16 threads 4.444 / 4.440 / 3.991, 14 and 15 level within
    their runs, 16 a tenth behind again."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (n or 4) - 1)


def hybrid_max_tokens(image_bytes: list[int], ffn_bytes: list[int], share: float,
                      cpu_ratio: float, pcie_gbps: float, cpu_gbps: float,
                      scaling: dict[int, float], other_s: float = 0.0) -> int:
    """The widest pass (of `scaling`'s widths, in order) whose split is still faster than
    copying the split layers whole: the CPU's side of an m-token pass at its measured cost
    by width, PCIe's the same bytes as for one token. At least 1 (decode), as a split plan
    exists for decode."""
    whole_s = sum(image_bytes) / (pcie_gbps * 1e9)
    best = 1
    for m in sorted(scaling):
        split_s, _, _ = decode_seconds(image_bytes, ffn_bytes, share, cpu_ratio, pcie_gbps,
                                       cpu_gbps / scaling[m], other_s)
        if split_s >= whole_s:
            break
        best = m
    return best


def balanced_share(image_bytes: int, ffn_bytes: int, cpu_ratio: float, pcie_gbps: float,
                   cpu_gbps: float, handover_s: float = 0.0) -> float:
    """The CPU share of the FFN at which CPU and PCIe finish the split layers together (module
    doc), the CPU's side also paying `handover_s` (the chain's time besides the shares' bytes:
    the fixed costs and hand-overs of the split layers, the GPU's compute of the others); in
    [0, 1]."""
    if ffn_bytes <= 0 or cpu_gbps <= 0:
        return 0.0
    pcie, cpu = pcie_gbps * 1e9, cpu_gbps * 1e9
    share = (image_bytes / pcie - handover_s) / (ffn_bytes / pcie + ffn_bytes * cpu_ratio / cpu)
    return max(0.0, min(1.0, share))


def decode_seconds(image_bytes: list[int], ffn_bytes: list[int], share: float,
                   cpu_ratio: float, pcie_gbps: float, cpu_gbps: float,
                   other_s: float = 0.0) -> tuple[float, int, int]:
    """A decode token's time through the split layers (PCIe, in parallel with the chain: the
    CPU's shares with their fixed cost per layer and the hand-over, and `other_s`, the GPU's
    compute of the layers that do not split; module doc), and the bytes each side moves."""
    cpu_bytes = int(sum(share * f * cpu_ratio for f in ffn_bytes))
    pcie_bytes = int(sum(b - share * f for b, f in zip(image_bytes, ffn_bytes)))
    if share <= 0:
        return pcie_bytes / (pcie_gbps * 1e9), cpu_bytes, pcie_bytes
    n = len(image_bytes)
    cpu_path = cpu_bytes / (cpu_gbps * 1e9) + LAYER_COST_S * n + other_s
    return max(pcie_bytes / (pcie_gbps * 1e9), cpu_path), cpu_bytes, pcie_bytes


def split_prediction(plain_tok_s: float | None, image_bytes: list[int], split_s: float,
                     pcie_gbps: float) -> float | None:
    """Decode tok/s with the split: the plain plan's token time with the split layers' whole
    copies replaced by the split's time through them (decode_seconds)."""
    if not plain_tok_s:
        return None
    whole_s = sum(image_bytes) / (pcie_gbps * 1e9)
    return 1.0 / (1.0 / plain_tok_s - whole_s + split_s)


def chain_others_s(plan, split_layers) -> float:
    """The GPU's compute, per decode token, of the plan's layers that do not split: it lies on
    the chain with the CPU's shares (module doc)."""
    return GPU_LAYER_S * (len(plan.tiers) - len(split_layers))


def after_promotion(plan, promoted) -> "HybridPlan | None":
    """plan.hybrid once `promoted` layers (made resident when a draft was given up) no longer
    split: the layers left, their bytes per token and packed RAM, and the prediction made again
    from the plan's tiers as they are now (plan.tiers must already say "vram" for them). None
    where no split layer is left."""
    h = plan.hybrid
    if h is None:
        return None
    gone = set(promoted)
    layers = [i for i in h.layers if i not in gone]
    if not layers:
        return None
    ffn = [h.gguf_ffn_bytes[i] for i in layers]
    total_ffn = sum(h.gguf_ffn_bytes[i] for i in h.layers)
    # the CPU layout's bytes per GGUF byte, as plan_hybrid measured it
    cpu_ratio = h.cpu_bytes_per_token / (h.cpu_share * total_ffn) if h.cpu_share else 0.0
    image = [plan.file_bytes_per_layer[i] for i in layers]
    split_s, cpu_bytes, pcie_bytes = decode_seconds(image, ffn, h.cpu_share, cpu_ratio,
                                                    h.pcie_gbps, h.cpu_gbps,
                                                    chain_others_s(plan, layers))
    plain = plan.whole_layers_tok_s  # at today's tiers
    return replace(
        h, layers=layers, cpu_bytes_per_token=cpu_bytes, pcie_bytes_per_token=pcie_bytes,
        predicted_tok_s=split_prediction(plain, image, split_s,
                                         plan.bandwidth_gbps.get("pinned", h.pcie_gbps)),
        plain_tok_s=plain,
        extra_ram_bytes=int(h.extra_ram_bytes * sum(ffn) / total_ffn) if total_ffn else 0,
        gguf_ffn_bytes={i: h.gguf_ffn_bytes[i] for i in layers})


def plan_hybrid(gf, cfg, plan, mode: str | float = "auto", threads: int | None = None,
                cpu_gbps: float | None = None, token_scaling: dict[int, float] | None = None
                ) -> HybridPlan | None:
    """The split for `plan` (CUDA, bandwidths measured), or None when hybrid decode is off, has
    no pinned layer to split, or (mode "auto") would not be at least 5% faster than copying
    whole layers or gives each layer's CPU less work than its fixed costs. mode: "auto", "on"
    (split at the balanced share whatever it predicts), "off", or a CPU share in (0, 1]
    (measurements). cpu_gbps, token_scaling (cpu_token_scaling: the
    CPU kernel's cost by pass width, which sets the widest split pass): measured here when
    not given."""
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
    kind = kind_for(GGMLQuantizationType.Q4_K)  # the probes' layout (their results are cached)
    cores_stolen = None  # measured only around a probe run here
    if cpu_gbps is None:
        # both links as they run together: the share from rates measured alone gave the
        # CPU too much (see cpu_packed_gbps)
        # the copy's device buffer within the budget, as measure_bandwidths' probes
        copy_bytes = max(min(128 << 20, (plan.budget or 1 << 33) // 8), 8 << 20)
        with StealMeter() as steal:
            cpu_gbps, beside = cpu_packed_gbps(threads, beside_copy=torch.cuda.is_available(),
                                               copy_bytes=copy_bytes, kind=kind)
        cores_stolen = steal.cores
        pcie = min(pcie, beside or pcie)
        # the probe's matvec over one large weight reads faster than decode's shares, 38
        # weights a third its size each, one after another with the GPU's work between them
        cpu_gbps *= DECODE_CPU_EFFICIENCY
    cpu = cpu_gbps
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
    others_s = chain_others_s(plan, layers)
    share = share_given if share_given is not None else balanced_share(
        sum(image), sum(ffn), cpu_ratio, pcie, cpu, LAYER_COST_S * len(layers) + others_s)
    keep = split_point(cfg.ffn, share)
    keep = max(min(keep, cfg.ffn - 256), 256)  # each side at least one aligned block
    share = 1.0 - keep / cfg.ffn
    split_s, cpu_bytes, pcie_bytes = decode_seconds(image, ffn, share, cpu_ratio, pcie, cpu,
                                                    others_s)
    plain = plan.predicted_tok_s
    # the plain plan's prediction copies whole layers at the rate measured alone
    predicted = split_prediction(plain, image, split_s, plan.bandwidth_gbps["pinned"])
    # auto also wants each split layer's CPU work to be at least MIN_CPU_LAYER_S: for small
    # layers the fixed costs every share pays decide (see MIN_CPU_LAYER_S for what was measured)
    cpu_layer_s = cpu_bytes / len(layers) / (cpu * 1e9)
    amortized = cpu_layer_s >= MIN_CPU_LAYER_S
    split = mode != "auto" or bool(predicted and plain and predicted >= 1.05 * plain
                                   and amortized)
    if split and token_scaling is None:  # the widths are timed only for a split made
        token_scaling = cpu_token_scaling(threads, kind=kind)
    clear_weights()  # the probes' weights (their results stay cached)
    if not split:
        return None
    widest = hybrid_max_tokens(image, ffn, share, cpu_ratio, pcie, cpu, token_scaling,
                               others_s)
    return HybridPlan(share, keep, layers, cpu, pcie, threads, cpu_bytes, pcie_bytes,
                      predicted, plain, max_tokens=min(widest, HYBRID_MAX_TOKENS),
                      extra_ram_bytes=cpu_bytes,
                      gguf_ffn_bytes=dict(zip(layers, ffn)),
                      rebalance=mode == "auto", cores_stolen=cores_stolen)
