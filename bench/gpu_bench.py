"""Resident GPU benchmark: synthesize anchor-shaped models, load them, measure pp512 and tg128.

    python bench/gpu_bench.py OUTDIR [--cases 8b-q4k,8b-q8_0,...] [--workdir /tmp/models]

Measures in the same run the device-to-device copy bandwidth (the HBM roofline) and the pinned
host-to-device bandwidth, and reports each case's decode rate against its roofline: the bytes of
weights one decode token reads, divided by the HBM bandwidth. Prints a table and writes
OUTDIR/gpu-resident.json in the shape bench/results uses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import slipstream  # noqa: E402
from slipstream.runtime.bench import (bench_decode, bench_prefill, h2d_pinned_gbps,  # noqa: E402
                                      memory_read_gbps, weight_bytes_per_token)
from slipstream.synth import write_synth  # noqa: E402

CASES = {  # name: (shape, --quant, vram budget or None for resident)
    "8b-q4k": ("8b", "Q4_K", None),
    "8b-q8_0": ("8b", "Q8_0", None),
    "8b-q6_k": ("8b", "Q6_K", None),
    "8b-f16": ("8b", "F16", None),
    "70b-q4k": ("70b", "Q4_K", None),
    "8b-q4k-vram4": ("8b", "Q4_K", "4GiB"),
    "70b-q4k-vram24": ("70b", "Q4_K", "24GiB"),
}
PRECISION = os.environ.get("SLIPSTREAM_PRECISION", "fast")  # "exact": fp32 decode GEMVs


def profile_decode(engine, tokens: int = 16) -> dict:
    """Kernel time per decode token, by kernel name, from the CUDA profiler (graph replays
    included): where a token's time goes beyond the weight streaming."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench_decode(engine, tokens, reps=1)  # warm-up + 1 run: 2 * tokens decode steps
    n = 2 * tokens
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            rows.append({"kernel": e.key[:90], "us_per_token": round(us / n, 2),
                         "calls_per_token": round(e.count / n, 2)})
    rows.sort(key=lambda r: -r["us_per_token"])
    total = sum(r["us_per_token"] for r in rows)
    calls = sum(r["calls_per_token"] for r in rows)
    return {"kernel_us_per_token": round(total, 1), "kernels_per_token": round(calls, 1),
            "top": rows[:14]}


def run_case(name: str, workdir: Path, hbm: float, h2d: float) -> dict:
    shape, quant, budget = CASES[name]
    path = workdir / f"{shape}-{quant}.gguf"
    t0 = time.perf_counter()
    if not path.exists():  # cases of one shape and quant share the file
        write_synth(path, shape, quant)
    synth_s = time.perf_counter() - t0
    size = path.stat().st_size
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = slipstream.load(path, device="cuda", ctx=640, vram_budget=budget,
                            precision=PRECISION)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    pp = bench_prefill(model.engine, 512, reps=3)
    tg = bench_decode(model.engine, 128 if budget is None else 16, reps=3)
    if budget is None:
        per_token = weight_bytes_per_token(model.engine)
        roofline = hbm * 1e9 / per_token
    else:  # streamed: the PCIe copy of the pinned layers bounds decode
        plan = model.plan
        per_token = plan.bytes_per_token("pinned")
        roofline = h2d * 1e9 / per_token
    case = {
        "name": name if budget else f"{name}-resident",
        "tiers": {t: model.plan.tiers.count(t) for t in set(model.plan.tiers)},
        "decode_test": tg.test,
        "precision": PRECISION,
        "fused_decode": os.environ.get("SLIPSTREAM_FUSED_DECODE", "1") == "1",
        "decode_tok_s": round(tg.tok_s, 2),
        "prefill512_tok_s": round(pp.tok_s, 1),
        "roofline_decode_tok_s": round(roofline, 1),
        "decode_fraction_of_roofline": round(tg.tok_s / roofline, 3),
        "weight_bytes_per_token": per_token,
        "vram_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "graph_capture_s": round(model.engine.graph_capture_s, 2),
        "load_s": round(load_s, 1),
        "file_bytes": size,
        "synth_MBps": round(size / synth_s / 1e6, 0) if synth_s > 1 else None,
        "decode_runs_s": [round(x, 4) for x in tg.seconds],
        "prefill_runs_s": [round(x, 4) for x in pp.seconds],
    }
    if budget is None and os.environ.get("SLIPSTREAM_PROFILE") == "1":
        try:
            case["profile"] = profile_decode(model.engine)
            p = case["profile"]
            print(f"{name}: {p['kernels_per_token']} kernels, {p['kernel_us_per_token']} us of "
                  f"kernels per token; top: " + "; ".join(
                      f"{r['kernel'][:40]} {r['us_per_token']}us x{r['calls_per_token']}"
                      for r in p["top"][:8]), flush=True)
        except Exception as e:  # profiling is diagnostics: never lose the case for it
            case["profile"] = {"error": f"{type(e).__name__}: {e}"}
    model.engine.layers.close()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no case after this")
    a = ap.parse_args()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hbm = memory_read_gbps(torch.device("cuda"), 2 << 30)  # device copy, bytes read + written
    h2d = h2d_pinned_gbps(2 << 30)
    print(f"HBM copy {hbm:.0f} GB/s, pinned H2D {h2d:.1f} GB/s", flush=True)
    commit = os.environ.get("SLIPSTREAM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    doc = {"device": torch.cuda.get_device_name(), "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "hbm_gbps": round(hbm, 1), "h2d_gbps": round(h2d, 1),
           "cases": []}
    deadline = time.perf_counter() + a.budget_s
    for name in a.cases.split(","):
        if time.perf_counter() > deadline:
            doc["cases"].append({"name": name, "error": "skipped: out of the call's time"})
            continue
        try:
            case = run_case(name, work, hbm, h2d)
        except Exception as e:  # record the failure and go on with the other cases
            case = {"name": f"{name}-resident", "error": f"{type(e).__name__}: {e}"}
        doc["cases"].append(case)
        print(json.dumps(case), flush=True)
        (out / "gpu-resident.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{'case':22} {'tg128 tok/s':>12} {'roofline':>9} {'frac':>6} {'pp512 tok/s':>12} "
          f"{'VRAM GiB':>9} {'capture s':>9}")
    for c in doc["cases"]:
        if "error" in c:
            print(f"{c['name']:22} ERROR {c['error'][:80]}")
            continue
        print(f"{c['name']:22} {c['decode_tok_s']:12.1f} {c['roofline_decode_tok_s']:9.1f} "
              f"{c['decode_fraction_of_roofline']:6.2f} {c['prefill512_tok_s']:12.1f} "
              f"{c['vram_gib']:9.2f} {c['graph_capture_s']:9.2f}")


if __name__ == "__main__":
    main()
