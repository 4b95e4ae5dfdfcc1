"""GPU throughput of the headline cases, with llama.cpp on the same file in the same run.

    python benchmarks/throughput.py [--case 70b-q4k-vram24-hybrid,...] [--llamacpp BUILD]
        [--results DIR] [--workdir DIR] [--repeats 3] [--tokens 16]

Cases (the synthetic anchor-shaped Llama files, `benchmarks/common.py:synth_model`):

    8b-q4k-resident, 70b-q4k-resident   every layer in VRAM (also 8b-q8_0/-q6_k/-f16-resident)
    70b-q4k-vram24-layers               24 GiB of VRAM, the rest whole layers over PCIe
    70b-q4k-vram24-hybrid               24 GiB, the CPU computing part of each pinned layer's FFN
    8b-q4k-vram4-layers / -hybrid       the same at 4 GiB on the 8B
    70b-q4k-vram24-ram12 / -mmap        24 GiB VRAM + 12 GiB pinned, the rest read from disk
                                        every token (O_DIRECT), and the naive mmap baseline
    qwen3-32b-q4k, gemma3-27b-q4k       Qwen3-32B- and Gemma-3-27B-shaped files, every layer in VRAM
    qwen3-32b-q4k-vram12, gemma3-27b-q4k-vram12   the same at 12 GiB (hybrid auto); llama.cpp
                                        at the most layers whose weights, KV cache and compute
                                        buffer fit 12 GiB (`llamacpp_layers_within`)

Mixtures of experts at a VRAM budget (MOE_CASES; SLIPSTREAM_CUDA_MOE=1), each with uniform and
with skewed routing (--routing; the job CASE-uniform, CASE-skewed), its experts split between
VRAM slots and the CPU: gptoss-120b-24l-vram8, gptoss-120b-24l-vram24, qwen3moe-30b-q4k-vram4,
glm45air-28l-q4k-vram24, mixtral-8x7b-q4k-vram12. llama.cpp runs its best configuration at
the same VRAM: -ngl 99 with --n-cpu-moe N (the fewest layers' experts on the CPU that fit the
budget, `llamacpp_moe_configs`) and with -ot exps=CPU, threads swept (--moe-threads); its best
decode and its best pp512 are reported with their configurations.

Every case: decode tok/s (resident: tg128 through CUDA events, as `slipstream bench`; streamed:
the median of --repeats runs of --tokens greedy steps after a short prompt and a warm-up, host
clock around synchronised steps), prefill pp512, and the ratio to a roofline measured in this
run: the device-to-device copy rate over the bytes a resident token reads, the pinned
host-to-device rate over the bytes streamed per token, or, hybrid, the larger of the CPU's and
PCIe's times for their shares at the rates the load measured. Streamed cases add the store's
CUDA events per token (what `slipstream run --stats` shows). --llamacpp BUILD runs llama-bench
on the same file in the same run with as many layers on the GPU as the case's VRAM holds
(-ngl 46 for the 70B at 24 GiB, 16 for the 8B at 4 GiB, 99 resident), 16 threads, tg and pp512.

--load-reps N times the load apart (dense cases): N more processes after the case's own, each
opening the model with the page cache and slipstream's image cache warm (the case's own process
wrote the images), timing the load, its phases (`model.load_phases`) and the first token of a
one-token prompt; with --llamacpp, llama.cpp's load, context and first token at the same -ngl and
context, N times in one process after an untimed load (benchmarks/device/llama_load.sh). The
ratio compares the loads up to a ready context (slipstream's load allocates its KV cache too).

Each case runs in a process of its own (its VRAM peak is its own; a case that dies takes no
other with it). Prints a table; writes RESULTS/DATE-<case>-<device>.json per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

# name: (shape, quant, VRAM budget (None: resident), RAM budget, io, hybrid, llama.cpp -ngl
# (None: as many layers as the budget holds), architecture)
CASES = {
    "8b-q4k-resident": ("8b", "Q4_K", None, None, "direct", "off", 99),
    "8b-q8_0-resident": ("8b", "Q8_0", None, None, "direct", "off", 99),
    "8b-q6_k-resident": ("8b", "Q6_K", None, None, "direct", "off", 99),
    "8b-f16-resident": ("8b", "F16", None, None, "direct", "off", 99),
    "70b-q4k-resident": ("70b", "Q4_K", None, None, "direct", "off", 99),
    "8b-q4k-vram4-layers": ("8b", "Q4_K", "4GiB", None, "direct", "off", 16),
    "8b-q4k-vram4-hybrid": ("8b", "Q4_K", "4GiB", None, "direct", "auto", 16),
    "70b-q4k-vram24-layers": ("70b", "Q4_K", "24GiB", None, "direct", "off", 46),
    "70b-q4k-vram24-hybrid": ("70b", "Q4_K", "24GiB", None, "direct", "auto", 46),
    "70b-q4k-vram24-ram12": ("70b", "Q4_K", "24GiB", "12GiB", "direct", "off", 46),
    "70b-q4k-vram24-mmap": ("70b", "Q4_K", "24GiB", "12GiB", "mmap", "off", 46),
    # the 70B's layers at a quarter of the file and the budget, for load checks in a short call
    "70b-20l-q4k-vram6-hybrid": ("70b", "Q4_K", "6GiB", None, "direct", "auto", None, "llama",
                                 20),
    "qwen3-32b-q4k": ("32b", "Q4_K", None, None, "direct", "off", 99, "qwen3"),
    "gemma3-27b-q4k": ("27b", "Q4_K", None, None, "direct", "off", 99, "gemma3"),
    "qwen3-32b-q4k-vram12": ("32b", "Q4_K", "12GiB", None, "direct", "auto", None, "qwen3"),
    "gemma3-27b-q4k-vram12": ("27b", "Q4_K", "12GiB", None, "direct", "auto", None, "gemma3"),
}
# Mixtures of experts: name -> (shape, quant, architecture, layers (None: the shape's), VRAM
# budget). The device host has 128 GiB of RAM, and the file (in /dev/shm) and slipstream's RAM
# copy of the experts outside VRAM must fit it together: gpt-oss-120b's 36 layers are 61 GB in
# MXFP4 and GLM-4.5-Air's 46 are 59 GB in Q4_K, so both engines run the same shape with 24
# (41 GB) and 28 (36 GB) layers, which the case names say.
MOE_CASES = {
    "gptoss-120b-24l-vram8": ("120b-a5b", "MXFP4", "gpt-oss", 24, "8GiB"),
    "gptoss-120b-24l-vram24": ("120b-a5b", "MXFP4", "gpt-oss", 24, "24GiB"),
    "qwen3moe-30b-q4k-vram4": ("30b-a3b", "Q4_K", "qwen3moe", None, "4GiB"),
    "glm45air-28l-q4k-vram24": ("106b-a12b", "Q4_K", "glm4moe", 28, "24GiB"),
    "mixtral-8x7b-q4k-vram12": ("8x7b", "Q4_K", "mixtral", None, "12GiB"),
}
# --expert-skew of each routing: random weights route almost uniformly; at 1 each layer's
# expert popularity falls off as a Zipf-like law (slipstream.synth_experts.skewed_router)
ROUTINGS = {"uniform": 0.0, "skewed": 1.0}
# llama.cpp's compute buffers and CUDA context beside the weights and KV cache of -ngl layers:
# what its log reported for a 70B at 24 GiB was about 1.2 GiB; kept with a margin
LLAMACPP_OVERHEAD = 1.5 * 2**30


def case(name: str) -> tuple:
    """CASES[name] less its layer count (case_file's), its architecture filled in (llama
    where it names none)."""
    c = CASES[name][:8]
    return c if len(c) == 8 else (*c, "llama")


def case_file(name: str, workdir: Path, write: bool = True) -> Path:
    """The case's synthetic file (written first where missing, `write`): its shape with the
    case's layer count where it names one."""
    shape, quant, *_, arch = case(name)
    layers = CASES[name][8] if len(CASES[name]) > 8 else None
    make = common.synth_model if write else common.synth_path
    return make(shape, quant, workdir, arch, layers)


def llamacpp_layers_within(path: Path, budget: str, ctx: int = 2048) -> int:
    """The most layers llama.cpp's -ngl can put on the GPU within `budget` (bytes of VRAM as
    "12GiB"): each layer's tensors and its KV cache at `ctx` (f16), less LLAMACPP_OVERHEAD; the
    head and embedding stay on the host below -ngl = layers + 1."""
    from slipstream.model.layer_spec import kv_cache_bytes
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.memory.budget import parse_size

    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    per_layer = max(sum(t.n_bytes for n, t in gf.tensors.items() if n.startswith(f"blk.{i}."))
                    for i in range(cfg.n_layers)) + kv_cache_bytes(cfg, 1, ctx, 2)
    gf.close()
    return max(0, int((parse_size(budget) - LLAMACPP_OVERHEAD) // per_layer))
HEADLINE = "8b-q4k-resident,70b-q4k-vram24-layers,70b-q4k-vram24-hybrid"


def moe_job(name: str) -> tuple[str, str] | None:
    """(case, routing) of a mixture-of-experts job CASE-ROUTING; None for another name."""
    case, _, routing = name.rpartition("-")
    return (case, routing) if case in MOE_CASES and routing in ROUTINGS else None


def moe_path(case: str, routing: str, workdir: Path, write: bool = True) -> Path:
    """The job's synthetic file, written first where missing (`write`)."""
    shape, quant, arch, layers, _ = MOE_CASES[case]
    make = common.synth_model if write else common.synth_path
    return make(shape, quant, workdir, arch, layers, ROUTINGS[routing])


def llamacpp_moe_configs(path: Path, budget: str, ctx: int = 2048) -> list[tuple[str, list[str]]]:
    """llama.cpp's offloading configurations of a mixture of experts within `budget`: every
    layer on the GPU (-ngl 99) with the experts of the first N layers on the CPU (--n-cpu-moe,
    N the fewest whose VRAM fits: the file's weights less the token embedding, which stays on
    the host, less those experts, plus the KV cache at `ctx` and LLAMACPP_OVERHEAD), and with
    every layer's experts on the CPU (-ot exps=CPU, the same as N = all layers)."""
    from slipstream.memory.budget import parse_size
    from slipstream.model.layer_spec import kv_cache_bytes
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile

    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    experts = [sum(t.n_bytes for n, t in gf.tensors.items()
                   if n.startswith(f"blk.{i}.") and "_exps." in n) for i in range(cfg.n_layers)]
    rest = sum(t.n_bytes for n, t in gf.tensors.items()
               if n != "token_embd.weight" and "_exps." not in n)
    fixed = rest + kv_cache_bytes(cfg, cfg.n_layers, ctx, 2) + LLAMACPP_OVERHEAD
    gf.close()
    configs = [("-ot exps=CPU", ["-ngl", "99", "-ot", "exps=CPU"])]
    cap = parse_size(budget)
    n = next((n for n in range(cfg.n_layers + 1) if fixed + sum(experts[n:]) <= cap), None)
    if n is not None and n < cfg.n_layers:
        configs.insert(0, (f"--n-cpu-moe {n}", ["-ngl", "99", "--n-cpu-moe", str(n)]))
    return configs


def load_model(path: Path, budget: str | None, ram_budget: str | None, io: str, hybrid: str,
               ctx: int):
    """The one place this tool opens a model."""
    import slipstream

    return slipstream.load(path, device="cuda", ctx=ctx, placement=slipstream.Placement(
        vram_budget=budget, ram_budget=ram_budget, io=io, hybrid=hybrid))


def decode_rate(engine, tokens: int) -> float:
    """Greedy-shaped decode steps after an 8-token prompt and 3 warm-up steps (the copy ring in
    its steady state), host clock around synchronised steps: every streamed step ends in a
    device wait anyway."""
    import torch

    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(tokens + 3, device="cuda") + 100
    for i in range(3):
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(tokens):
        engine.decode(ids[3 + i:4 + i])
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def breakdown(model, tokens: int) -> dict:
    """The store's CUDA events per decode token, measured apart from the timed runs."""
    import torch

    engine, store = model.engine, model.engine.layers
    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(tokens, device="cuda") + 100
    store.stats.reset()
    store.enable_timing()
    for i in range(tokens):
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    store.collect()
    store.enable_timing(False)
    s, n = store.stats, tokens
    return {"compute_ms": round(s.compute_s / n * 1e3, 2),
            "stall_ms": round(s.stall_s / n * 1e3, 2),
            "h2d_busy_ms": round(s.h2d_s / n * 1e3, 2),
            "h2d_gb_per_token": round(s.h2d_bytes / n / 1e9, 3),
            "pcie_gbps": round(s.h2d_bytes / s.h2d_s / 1e9, 1) if s.h2d_s else None,
            "cpu_ms": round(s.cpu_s / n * 1e3, 2),
            "cpu_gb_per_token": round(s.cpu_bytes / n / 1e9, 3),
            "cpu_gbps": round(s.cpu_bytes / s.cpu_s / 1e9, 1) if s.cpu_s else None,
            "disk_gb_per_token": round(s.disk_bytes / n / 1e9, 3),
            "disk_gbps": round(s.disk_bytes / s.disk_read_s / 1e9, 2)
            if s.disk_read_s else None}


def streamed_roofline(plan, h2d_gbps: float, disk_gbps: float | None) -> float | None:
    """tok/s the links allow: whole layers, the pinned copies (and the disk reads, which overlap
    them) at the rates measured in this run; hybrid, the slower of the CPU's share and PCIe's."""
    h = plan.hybrid
    if h is not None:
        seconds = max(h.pcie_bytes_per_token / (h.pcie_gbps * 1e9),
                      h.cpu_bytes_per_token / (h.cpu_gbps * 1e9))
    else:
        disk_b = plan.bytes_per_token("disk")
        seconds = (plan.bytes_per_token("pinned") + disk_b) / (h2d_gbps * 1e9)
        if disk_b and disk_gbps:
            seconds = max(seconds, disk_b / (disk_gbps * 1e9))
    return 1 / seconds if seconds else None


def run_moe_case(name: str, case: str, routing: str, a: argparse.Namespace) -> dict:
    """One mixture-of-experts job in this process: load at the budget (the experts split
    between VRAM slots and the CPU), pp512, decode, the share of routed pairs served from VRAM
    during the timed decode, the VRAM as the driver counts it, and a roofline: the GPU reading
    the dense part and its share of the routed experts at the device's copy rate beside the
    CPU reading the rest at its memory rate, the slower of the two per token."""
    os.environ["SLIPSTREAM_CUDA_MOE"] = "1"  # the opt-in of CUDA mixtures of experts
    import torch

    from slipstream.memory.probes import memory_read_gbps
    from slipstream.runtime.bench import bench_prefill, weight_bytes_per_token

    budget = MOE_CASES[case][4]
    path = moe_path(case, routing, a.workdir)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = load_model(path, budget, None, "direct", "auto", a.ctx)
    torch.cuda.synchronize()
    cfg, plan, engine = model.config, model.plan, model.engine
    row: dict = {"name": name, "case": case, "routing": routing,
                 "expert_skew": ROUTINGS[routing], "model": path.name, "layers": cfg.n_layers,
                 "vram_budget": budget, "load_s": round(time.perf_counter() - t0, 1),
                 "load_phases": model.load_phases,
                 "vram_expert_slots": plan.vram_expert_slots}
    row["prefill512_tok_s"] = round(bench_prefill(engine, 512, reps=2).tok_s, 1)
    stats = engine.layers.stats
    stats.reset()
    runs = [round(decode_rate(engine, a.tokens), 3) for _ in range(max(1, a.repeats))]
    row["decode_test"] = f"decode{a.tokens}"
    row["decode_tok_s"], row["decode_tok_s_runs"] = round(statistics.median(runs), 3), runs
    hit = stats.expert_vram_rate
    # no pair counted: no layer split, every expert in VRAM
    row["expert_vram_hit_rate"] = round(hit, 4) if hit is not None else 1.0
    row["expert_syncs_per_token"] = round(stats.expert_syncs / (a.tokens * len(runs)), 1)
    row["expert_swaps"] = stats.expert_swaps
    hbm = memory_read_gbps(torch.device("cuda"), 2 << 30)
    cpu = memory_read_gbps(torch.device("cpu"), 1 << 30)
    # a token's bytes: its routed experts' (in the file's formats; not GLM-4.5's prediction
    # layer past n_layers, which is not run) and the rest's
    routed = sum(t.n_bytes * cfg.n_experts_used // cfg.n_experts
                 for n, t in model.gguf.tensors.items()
                 if "_exps." in n and int(n.split(".")[1]) < cfg.n_layers)
    dense = weight_bytes_per_token(engine, model.gguf) - routed
    gpu_s = (dense + routed * row["expert_vram_hit_rate"]) / (hbm * 1e9)
    cpu_s = routed * (1 - row["expert_vram_hit_rate"]) / (cpu * 1e9)
    row.update(hbm_gbps=round(hbm, 1), cpu_gbps=round(cpu, 1),
               routed_gb_per_token=round(routed / 1e9, 3),
               roofline_tok_s=round(1 / max(gpu_s, cpu_s), 2))
    row["ratio_to_roofline"] = round(row["decode_tok_s"] / row["roofline_tok_s"], 3)
    free, total = torch.cuda.mem_get_info()
    row["vram_gib"] = round((total - free) / 2**30, 2)  # as the driver counts it
    row["vram_allocator_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    model.close()
    return row


def run_case(name: str, workdir: Path, a: argparse.Namespace) -> dict:
    """One case in this process: load, prefill, decode, roofline, VRAM."""
    import torch

    from slipstream.memory.probes import disk_read_gbps, h2d_pinned_gbps, memory_read_gbps
    from slipstream.runtime.bench import bench_decode, bench_prefill, weight_bytes_per_token

    shape, quant, budget, ram_budget, io, hybrid, _, arch = case(name)
    path = case_file(name, workdir)
    # the pinned-copy roofline is probed before the load: its 2 GiB buffer would not fit beside
    # the weights under a small budget's cap (12 GiB), and is freed before the peak is counted
    h2d = h2d_pinned_gbps(2 << 30) if budget is not None else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load_model(path, budget, ram_budget, io, hybrid, a.ctx)
    torch.cuda.synchronize()
    row: dict = {"name": name, "model": path.name, "vram_budget": budget,
                 "ram_budget": ram_budget, "io": io, "hybrid": hybrid,
                 "load_s": round(time.perf_counter() - t0, 1), "load_phases": model.load_phases}
    plan, engine = model.plan, model.engine
    row["tiers"] = {t: plan.tiers.count(t) for t in sorted(set(plan.tiers))}
    row["predicted_tok_s"] = round(plan.predicted_tok_s, 3) if plan.predicted_tok_s else None
    slow = bool(plan.disk_layers)
    pp = bench_prefill(engine, 512, reps=2 if slow else 3)
    row["prefill512_tok_s"] = round(pp.tok_s, 1)
    if budget is None:
        tg = bench_decode(engine, 128, reps=3)
        row["decode_test"], row["decode_tok_s"] = tg.test, round(tg.tok_s, 2)
        hbm = memory_read_gbps(torch.device("cuda"), 2 << 30)  # bytes read + written
        row["hbm_gbps"] = round(hbm, 1)
        row["roofline_tok_s"] = round(hbm * 1e9 / weight_bytes_per_token(engine), 2)
    else:
        tokens = max(4, a.tokens // 2) if slow else a.tokens
        runs = [round(decode_rate(engine, tokens), 3) for _ in range(max(1, a.repeats))]
        row["decode_test"] = f"decode{tokens}"
        row["decode_tok_s"], row["decode_tok_s_runs"] = round(statistics.median(runs), 3), runs
        disk = disk_read_gbps(engine.layers.disk.path, 4 << 30)[0] if slow else None
        row["h2d_gbps"], row["disk_gbps"] = round(h2d, 1), disk and round(disk, 2)
        roof = streamed_roofline(plan, h2d, disk)
        row["roofline_tok_s"] = round(roof, 3) if roof else None
        h = plan.hybrid
        if h is not None:
            row.update(cpu_share=round(h.cpu_share, 4), split_layers=len(h.layers),
                       threads=h.threads, cpu_gbps_probe=round(h.cpu_gbps, 1),
                       pcie_gbps_beside_cpu=round(h.pcie_gbps, 1))
        row["breakdown"] = breakdown(model, 2 if slow else max(4, a.tokens // 2))
    if row.get("roofline_tok_s"):
        row["ratio_to_roofline"] = round(row["decode_tok_s"] / row["roofline_tok_s"], 3)
    row["vram_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    free, total = torch.cuda.mem_get_info()
    row["vram_process_gib"] = round((total - free) / 2**30, 2)  # as the driver counts it
    row["graph_capture_s"] = round(getattr(engine, "graph_capture_s", 0.0) or 0.0, 2)
    model.close()
    return row


def load_only(name: str, workdir: Path, a: argparse.Namespace) -> dict:
    """One warm load of the case's model in this process: its seconds, its phases, and the
    first token of a one-token prompt after it."""
    import torch

    shape, quant, budget, ram_budget, io, hybrid, _, arch = case(name)
    path = case_file(name, workdir, write=False)
    t0 = time.perf_counter()
    model = load_model(path, budget, ram_budget, io, hybrid, a.ctx)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    row = {"load_s": round(load_s, 3), "load_phases": model.load_phases}
    if a.first_token:
        t0 = time.perf_counter()
        model.engine.reset()
        model.engine.forward([1])
        torch.cuda.synchronize()
        row["first_token_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    model.close()
    return row


def load_runs(name: str, a: argparse.Namespace) -> dict:
    """--load-reps warm loads, each in a process of its own: the runs and their median."""
    runs = [run_in_child(name, a, load=True) for _ in range(a.load_reps)]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"load_error": runs[-1]["error"]}
    mid = sorted(ok, key=lambda r: r["load_s"])[len(ok) // 2]
    return {"load_warm_s": mid["load_s"], "load_warm_s_runs": [r["load_s"] for r in ok],
            "load_phases_warm": mid["load_phases"],
            "first_token_ms_warm": mid.get("first_token_ms")}


def with_llamacpp_load(row: dict, build: str, a: argparse.Namespace) -> None:
    """llama.cpp's load, context and first token at the case's -ngl and context, --load-reps
    times in one process (llama_load.sh), beside slipstream's warm load."""
    shape, quant, budget, *_, ngl, arch = case(row["name"])
    path = case_file(row["name"], a.workdir, write=False)
    if ngl is None:
        ngl = llamacpp_layers_within(path, budget)
    script = Path(__file__).parent / "device" / "llama_load.sh"
    b = Path(build)
    env = {**os.environ, "LLAMA_BUILD": str(b if b.is_dir() else b.parent.parent)}
    proc = subprocess.run(["bash", str(script), str(path), str(ngl), str(a.ctx),
                           str(a.load_reps)], capture_output=True, text=True, env=env,
                          timeout=a.case_timeout)
    if proc.returncode != 0:
        row["llamacpp_load_error"] = (proc.stderr.strip() or f"exit {proc.returncode}")[-300:]
        return
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ready = [lo + c for lo, c in zip(res["load_ms"], res["context_ms"])]
    row["llamacpp_load"] = res
    row["llamacpp_load_ms"] = round(statistics.median(ready), 1)
    row["llamacpp_first_token_ms"] = round(statistics.median(res["first_token_ms"]), 1)
    if row.get("load_warm_s"):
        row["load_ratio_to_llamacpp"] = round(row["load_warm_s"] * 1e3 / row["llamacpp_load_ms"], 3)


def run_in_child(name: str, a: argparse.Namespace, load: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, __file__, "--one", name, "--case-json", str(result),
           "--workdir", str(a.workdir), "--tokens", str(a.tokens), "--repeats", str(a.repeats),
           "--ctx", str(a.ctx), *(["--load-only"] if load else []),
           *([] if a.first_token else ["--no-first-token"])]
    try:
        proc = subprocess.run(cmd, timeout=a.case_timeout, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not result.stat().st_size:
            tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            sys.stderr.write(proc.stderr[-3000:])
            return {"name": name, "error": f"case process failed: {tail[0][:300]}"}
        return json.loads(result.read_text())
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"case process ran past {a.case_timeout:.0f} s"}
    finally:
        result.unlink(missing_ok=True)


def with_llamacpp_moe(row: dict, build: str, a: argparse.Namespace) -> None:
    """llama.cpp's best decode and best pp512 over its configurations at the case's VRAM
    (llamacpp_moe_configs) and thread counts (--moe-threads), on the same file."""
    path = moe_path(row["case"], row["routing"], a.workdir)
    runs = []
    for label, args in llamacpp_moe_configs(path, MOE_CASES[row["case"]][4], a.ctx):
        res = common.llama_bench(build, path, [*args, "-p", "512", "-n", str(a.tokens * 2),
                                               "-r", "2", "-fa", "1", "-t", a.moe_threads],
                                 timeout=600)
        runs.append({"config": label, **res})
    row["llamacpp_runs"] = runs
    ok = [r for r in runs if "error" not in r]
    if not ok:
        row["error"] = f"llama.cpp: {runs[-1].get('error', 'no run')[:300]}"
        return
    tg = max(ok, key=lambda r: r.get("tg_tok_s") or 0)
    pp = max(ok, key=lambda r: r.get("pp512_tok_s") or 0)
    row["llamacpp_config"] = f"{tg['config']} -t {tg.get('tg_threads')}"
    row["llamacpp_decode_tok_s"] = tg.get("tg_tok_s")
    row["llamacpp_prefill512_tok_s"] = pp.get("pp512_tok_s")
    row["llamacpp_prefill_config"] = pp["config"]
    if row["llamacpp_decode_tok_s"] and row.get("decode_tok_s"):
        row["ratio_to_llamacpp"] = round(row["decode_tok_s"] / row["llamacpp_decode_tok_s"], 3)
    if row["llamacpp_prefill512_tok_s"] and row.get("prefill512_tok_s"):
        row["prefill_ratio_to_llamacpp"] = round(
            row["prefill512_tok_s"] / row["llamacpp_prefill512_tok_s"], 3)


def with_llamacpp(row: dict, build: str, workdir: Path) -> None:
    shape, quant, budget, *_, ngl, arch = case(row["name"])
    path = case_file(row["name"], workdir)
    if ngl is None:
        ngl = llamacpp_layers_within(path, budget)
    tg = "128" if ngl == 99 else "16"
    row["llamacpp_ngl"] = ngl
    res = common.llama_bench(build, path,
                             ["-ngl", str(ngl), "-p", "512", "-n", tg, "-r", "2", "-fa", "1",
                              "-t", str(min(16, os.cpu_count() or 16))])
    row["llamacpp"] = res
    row["llamacpp_decode_tok_s"] = res.get("tg_tok_s")
    if res.get("tg_tok_s") and row.get("decode_tok_s"):
        row["ratio_to_llamacpp"] = round(row["decode_tok_s"] / res["tg_tok_s"], 3)
    if res.get("pp512_tok_s") and row.get("prefill512_tok_s"):
        row["prefill_ratio_to_llamacpp"] = round(row["prefill512_tok_s"] / res["pp512_tok_s"], 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default=HEADLINE,
                    help=f"comma-separated, of: {', '.join([*CASES, *MOE_CASES])} (default: "
                         f"{HEADLINE})")
    ap.add_argument("--routing", default="uniform,skewed",
                    help="mixtures of experts: the routings to run each case with (default: both)")
    ap.add_argument("--moe-threads", default="8,16",
                    help="mixtures of experts: llama.cpp's thread counts swept (-t)")
    ap.add_argument("--keep-files", action="store_true",
                    help="keep each mixture of experts' file after its job (by default removed: "
                         "two routings of a 40 GB file do not fit /dev/shm together)")
    ap.add_argument("--llamacpp", metavar="BUILD",
                    help="llama.cpp's build folder (or llama-bench): run it on each case's file")
    ap.add_argument("--results", default=str(common.RESULTS), help="where the JSON goes")
    ap.add_argument("--workdir", default=str(common.MODELS), help="the synthetic model files")
    ap.add_argument("--tokens", type=int, default=16, help="streamed cases: steps a timed run")
    ap.add_argument("--repeats", type=int, default=3, help="streamed cases: timed runs")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--case-timeout", type=float, default=900)
    ap.add_argument("--load-reps", type=int, default=0,
                    help="dense cases: warm loads timed apart, each in its own process, and "
                         "llama.cpp's with --llamacpp (default 0: none)")
    ap.add_argument("--loads-only", action="store_true",
                    help="dense cases: only the loads (a cold one, then --load-reps warm ones), "
                         "no decode nor prefill")
    ap.add_argument("--no-first-token", dest="first_token", action="store_false",
                    help="--load-reps: time the loads alone (no kernel compiled in the process)")
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--case-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.workdir = Path(a.workdir)
    if a.one:
        job = moe_job(a.one)
        if a.load_only:
            row = load_only(a.one, a.workdir, a)
        else:
            row = run_moe_case(a.one, *job, a) if job else run_case(a.one, a.workdir, a)
        Path(a.case_json).write_text(json.dumps(row))
        return 0
    names = [c for c in a.case.split(",") if c]
    unknown = [c for c in names if c not in CASES and c not in MOE_CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: "
                 f"{', '.join([*CASES, *MOE_CASES])}")
    routings = [r for r in a.routing.split(",") if r]
    if not set(routings) <= set(ROUTINGS):
        ap.error(f"--routing takes {', '.join(ROUTINGS)}, not {a.routing}")
    jobs = [job for n in names
            for job in ([f"{n}-{r}" for r in routings] if n in MOE_CASES else [n])]
    head = common.provenance("cuda")
    rows = []
    for name in jobs:
        moe = moe_job(name)
        if a.loads_only and not moe:
            case_file(name, a.workdir)  # written here: the cold load below times no synth
            cold = run_in_child(name, a, load=True)
            row = {"name": name, **cold}
        else:
            row = run_in_child(name, a)
        if a.loads_only and not moe and "error" not in row:
            row.update(load_runs(name, a))
            if a.llamacpp:
                with_llamacpp_load(row, a.llamacpp, a)
            rows.append(row)
            path = common.write_result(name + "-load", {**head, **row}, a.results)
            print(json.dumps({"case": name, "file": str(path)}), flush=True)
            continue
        if a.llamacpp and "error" not in row:
            if moe:
                with_llamacpp_moe(row, a.llamacpp, a)
            else:
                with_llamacpp(row, a.llamacpp, a.workdir)
        if a.load_reps and not moe and "error" not in row:
            row.update(load_runs(name, a))
            if a.llamacpp:
                with_llamacpp_load(row, a.llamacpp, a)
        if moe and not a.keep_files:
            moe_path(*moe, a.workdir, write=False).unlink(missing_ok=True)
        rows.append(row)
        path = common.write_result(name, {**head, **row}, a.results)
        print(json.dumps({"case": name, "file": str(path)}), flush=True)
    for r in rows:
        r["llamacpp_tg"] = (r.get("llamacpp") or {}).get("tg_tok_s", r.get("llamacpp_decode_tok_s"))
        r["llamacpp_pp"] = (r.get("llamacpp") or {}).get("pp512_tok_s",
                                                         r.get("llamacpp_prefill512_tok_s"))
        r.setdefault("vram_process_gib", r.get("vram_gib") if moe_job(r["name"]) else None)
    print(common.table(rows, [
        ("name", "case", ""), ("decode_tok_s", "tok/s", ".3f"), ("roofline_tok_s", "roofline", ".3f"),
        ("ratio_to_roofline", "of roof", ".3f"), ("prefill512_tok_s", "pp512", ".1f"),
        ("llamacpp_tg", "llama tg", ".2f"), ("llamacpp_pp", "llama pp", ".1f"),
        ("cpu_share", "share", ".2f"), ("expert_vram_hit_rate", "VRAM hits", ".2f"),
        ("vram_process_gib", "VRAM GiB", ".2f"), ("error", "error", "")]))
    if any("load_warm_s" in r for r in rows):
        print(common.table([r for r in rows if "load_warm_s" in r], [
            ("name", "case", ""), ("load_s", "cold load s", ".1f"),
            ("load_warm_s", "warm load s", ".2f"), ("first_token_ms_warm", "1st token ms", ".0f"),
            ("llamacpp_load_ms", "llama load ms", ".0f"),
            ("llamacpp_first_token_ms", "llama 1st ms", ".0f"),
            ("load_ratio_to_llamacpp", "ratio", ".2f")]))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
