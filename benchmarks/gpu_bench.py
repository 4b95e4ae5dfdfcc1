"""GPU benchmark: synthesize anchor-shaped models, load them, measure pp512 and tg128.

    python bench/gpu_bench.py OUTDIR [--cases 8b-q4k,8b-q8_0,...] [--workdir /tmp/models]

Measures in the same run the device-to-device copy bandwidth (the HBM roofline) and the pinned
host-to-device bandwidth, and reports each case's decode rate against its roofline: the bytes of
weights one decode token reads, divided by the HBM bandwidth (resident), or the bytes streamed
per token over the links they cross (streamed). Cases with a disk tier also measure the
O_DIRECT sequential read bandwidth of the file they stream from, in the same run, and report
the GB/s each link achieved during decode. Slow cases decode fewer tokens (see decode_test).
Prints a table and writes OUTDIR/gpu-resident.json in the shape bench/results uses.

Each case runs in a process of its own, so `torch.cuda.max_memory_reserved` is that case's
alone (nothing cached from the case before) and a case that dies takes no other with it. Each
case also records the allocator's peaks after load, prefill and decode (`vram_peaks_gib`), to
tell which phase sets the peak and whether it is held memory or cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import slipstream  # noqa: E402
from slipstream.memory.probes import (  # noqa: E402
    disk_read_gbps,
    h2d_pinned_gbps,
    memory_read_gbps,
)
from slipstream.runtime.bench import (  # noqa: E402
    bench_decode,
    bench_prefill,
    weight_bytes_per_token,
)
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402

from memtrace import MemTrace  # noqa: E402  (bench/, next to this file)

CASES = {  # name: (shape, --quant, vram budget or None for resident, ram budget, --io)
    "8b-q4k": ("8b", "Q4_K", None, None, "direct"),
    "8b-q8_0": ("8b", "Q8_0", None, None, "direct"),
    "8b-q6_k": ("8b", "Q6_K", None, None, "direct"),
    "8b-f16": ("8b", "F16", None, None, "direct"),
    "70b-q4k": ("70b", "Q4_K", None, None, "direct"),
    "8b-q4k-vram4": ("8b", "Q4_K", "4GiB", None, "direct"),
    "70b-q4k-vram24": ("70b", "Q4_K", "24GiB", None, "direct"),
    # tier C: the layers that fit neither budget are read from disk every token
    "70b-q4k-vram24-ram12": ("70b", "Q4_K", "24GiB", "12GiB", "direct"),
    "70b-q4k-vram24-mmap": ("70b", "Q4_K", "24GiB", "12GiB", "mmap"),
    # a small disk tier (about 15 of 32 layers), through O_DIRECT and through KvikIO
    "8b-q4k-vram4-ram1": ("8b", "Q4_K", "4GiB", "1GiB", "direct"),
    "8b-q4k-vram4-ram1-kvikio": ("8b", "Q4_K", "4GiB", "1GiB", "kvikio"),
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


# decode tokens and repetitions (after one warm-up run) of the cases that read from disk
SLOW = {"direct": (8, 2), "kvikio": (8, 2), "mmap": (4, 1)}


def _streaming_figures(model, tg, h2d: float) -> dict:
    """Disk-tier figures: bytes per token on each link, GB/s achieved during decode, the
    O_DIRECT sequential read of the same file measured now, and a --stats breakdown of two
    decode tokens (CUDA events on, so measured apart from the timed runs)."""
    plan, store = model.plan, model.engine.layers
    disk_b = plan.bytes_per_token("disk")
    h2d_b = plan.bytes_per_token("pinned") + disk_b
    odirect, mode = disk_read_gbps(store.disk.path, 4 << 30)
    disk_achieved = disk_b * tg.tok_s / 1e9
    store.stats.reset()
    store.enable_timing()
    model.engine.reset()
    ids = torch.arange(2, device="cuda") + 5
    for i in range(2):
        model.engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    store.collect()
    store.enable_timing(False)
    s = store.stats
    per_tok = {k: round(v / 2 * 1e3, 1) for k, v in (
        ("compute_ms", s.compute_s), ("stall_ms", s.stall_s), ("disk_wait_ms", s.disk_wait_s),
        ("h2d_busy_ms", s.h2d_s), ("disk_busy_ms", s.disk_read_s))}
    out = {
        "io": plan.io,
        "io_note": store.note,
        # "direct" means the decode reads bypassed the page cache; "buffered" would mean the
        # filesystem refused O_DIRECT and the figures may come from RAM
        "disk_read_mode": store.staging.reader.mode if store.staging is not None else plan.io,
        "disk_bytes_per_token": disk_b,
        "h2d_bytes_per_token": h2d_b,
        "disk_gbps_achieved": round(disk_achieved, 2),
        "h2d_gbps_achieved": round(h2d_b * tg.tok_s / 1e9, 2),
        "odirect_seq_read_gbps": round(odirect, 2),
        "odirect_seq_read_mode": mode,
        "disk_fraction_of_odirect": round(disk_achieved / odirect, 3),
        "stats_per_token": per_tok,
        "h2d_link_busy_gbps": round(s.h2d_bytes / s.h2d_s / 1e9, 1) if s.h2d_s else None,
        "disk_link_busy_gbps": round(s.disk_bytes / s.disk_read_s / 1e9, 2)
        if s.disk_read_s else None,
    }
    # streamed roofline: the copy link carries pinned and disk layers, the disk its own; they
    # overlap, so the slower one bounds decode
    out["roofline_s_per_token"] = max(h2d_b / (h2d * 1e9), disk_b / (odirect * 1e9))
    return out


def run_case(name: str, workdir: Path, hbm: float, h2d: float) -> dict:
    shape, quant, budget, ram_budget, io = CASES[name]
    path = workdir / f"{shape}-{quant}.gguf"
    t0 = time.perf_counter()
    if not path.exists():  # cases of one shape and quant share the file
        write_synth(path, shape, quant)
        synth_s = time.perf_counter() - t0
        # flush the new file now: writeback of GiBs of dirty pages during the timed runs
        # slowed eager prefill by a third on the H200's host (decode, graph replays, not)
        os.sync()
    else:
        synth_s = 0.0
    size = path.stat().st_size
    start_reserved = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    trace = MemTrace() if os.environ.get("SLIPSTREAM_MEMTRACE") == "1" else None
    if trace is not None:
        trace.__enter__()
    t0 = time.perf_counter()
    model = slipstream.load(path, device="cuda", ctx=640, vram_budget=budget,
                            ram_budget=ram_budget, io=io, precision=PRECISION)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    peaks = {"load": _peaks()}
    plan = model.plan
    slow = SLOW.get(io) if plan.disk_layers else None
    pp = bench_prefill(model.engine, 512, reps=slow[1] if slow else 3)
    peaks["prefill"] = _peaks()
    tg = bench_decode(model.engine, 128 if budget is None else slow[0] if slow else 16,
                      reps=slow[1] if slow else 3)
    peaks["decode"] = _peaks()
    if trace is not None:
        trace.__exit__(None, None, None)
    extra = {}
    if budget is None:
        per_token = weight_bytes_per_token(model.engine)
        roofline = hbm * 1e9 / per_token
    elif plan.disk_layers:
        extra = _streaming_figures(model, tg, h2d)
        per_token = extra["h2d_bytes_per_token"]
        roofline = 1 / extra.pop("roofline_s_per_token")
    else:  # streamed: the PCIe copy of the pinned layers bounds decode
        per_token = plan.bytes_per_token("pinned")
        roofline = h2d * 1e9 / per_token
        extra = {"h2d_bytes_per_token": per_token,
                 "h2d_gbps_achieved": round(per_token * tg.tok_s / 1e9, 2)}
    case = {
        "name": name if budget else f"{name}-resident",
        "tiers": {t: model.plan.tiers.count(t) for t in set(model.plan.tiers)},
        "decode_test": tg.test,
        "precision": PRECISION,
        "fused_decode": os.environ.get("SLIPSTREAM_FUSED_DECODE", "1") == "1",
        "decode_tok_s": round(tg.tok_s, 2),
        "prefill512_tok_s": round(pp.tok_s, 1),
        "roofline_decode_tok_s": round(roofline, 2),
        "decode_fraction_of_roofline": round(tg.tok_s / roofline, 3),
        "weight_bytes_per_token": per_token,
        "vram_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        # what the driver counts on the device now (the CUDA context too): the budget's measure
        "vram_process_gib": round((lambda f, t: (t - f) / 2**30)(*torch.cuda.mem_get_info()), 2),
        # cumulative peaks (reserved, allocated) after each phase, and what the allocator held
        # before the load (0 in a process of its own)
        "vram_peaks_gib": peaks,
        "vram_reserved_before_load_gib": round(start_reserved / 2**30, 3),
        # the user's budget; the allocator's share is that less the CUDA context
        "vram_budget_gib": round((plan.budget + plan.outside_allocator) / 2**30, 2),
        "vram_context_gib": round(plan.outside_allocator / 2**30, 2),
        "vram_planned_gib": round((plan.fixed_bytes + sum(
            b for b, t in zip(plan.resident_bytes_per_layer, plan.tiers) if t == "vram")
            + (plan.staging_buffers * plan.slot_bytes if plan.streamed_layers else 0))
            / 2**30, 2),
        "vram_reserve_gib": {k: round(v / 2**30, 3) for k, v in plan.reserve.items()},
        "predicted_decode_tok_s": round(plan.predicted_tok_s, 2)
        if plan.predicted_tok_s else None,
        "graph_capture_s": round(model.engine.graph_capture_s, 2),
        "load_s": round(load_s, 1),
        "file_bytes": size,
        "synth_MBps": round(size / synth_s / 1e6, 0) if synth_s > 1 else None,
        "decode_runs_s": [round(x, 4) for x in tg.seconds],
        "prefill_runs_s": [round(x, 4) for x in pp.seconds],
        **extra,
    }
    if trace is not None:
        case["vram_peak_trace"] = trace.summary()
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
    return case


def _peaks() -> dict:
    torch.cuda.synchronize()
    return {"reserved": round(torch.cuda.max_memory_reserved() / 2**30, 3),
            "allocated": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def run_case_in_child(name: str, workdir: Path, hbm: float, h2d: float,
                      timeout_s: float, env: dict | None = None) -> dict:
    """run_case in a fresh process (see the module's docstring); its printed lines pass
    through, its case comes back through a JSON file."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, __file__, "--one", name, "--workdir", str(workdir),
           "--hbm", repr(hbm), "--h2d", repr(h2d), "--case-json", str(result)]
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, stdout=sys.stdout, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **(env or {})})
        if proc.returncode != 0 or not result.stat().st_size:
            tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            return {"name": name, "error": f"case process failed: {tail[0][:300]}"}
        return json.loads(result.read_text())
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"case process ran past {timeout_s:.0f} s"}
    finally:
        result.unlink(missing_ok=True)


def _speedup(cases: list[dict]) -> None:
    """Tiered over the mmap baseline with the same budgets, recorded on the mmap case."""
    by = {c["name"]: c for c in cases if "error" not in c}
    tiered, mmap = by.get("70b-q4k-vram24-ram12"), by.get("70b-q4k-vram24-mmap")
    if tiered and mmap and mmap["decode_tok_s"]:
        mmap["speedup_tiered_over_mmap_decode"] = round(
            tiered["decode_tok_s"] / mmap["decode_tok_s"], 2)
        mmap["speedup_tiered_over_mmap_prefill"] = round(
            tiered["prefill512_tok_s"] / mmap["prefill512_tok_s"], 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", nargs="?", default="/tmp/slipstream-out")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no case after this")
    ap.add_argument("--in-process", action="store_true", help="run every case in this process")
    ap.add_argument("--memtrace", default="", help="cases to run a second time with the "
                    "allocator's history on (slower), to say where their VRAM peak comes from")
    # the child side of run_case_in_child
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--hbm", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--h2d", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--case-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        case = run_case(a.one, Path(a.workdir), a.hbm, a.h2d)
        Path(a.case_json).write_text(json.dumps(case))
        return
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hbm = memory_read_gbps(torch.device("cuda"), 2 << 30)  # device copy, bytes read + written
    h2d = h2d_pinned_gbps(2 << 30)
    print(f"HBM copy {hbm:.0f} GB/s, pinned H2D {h2d:.1f} GB/s", flush=True)
    rev = source_revision()
    doc = {"device": torch.cuda.get_device_name(), "commit": rev["commit"], "tree": rev["tree"],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "hbm_gbps": round(hbm, 1), "h2d_gbps": round(h2d, 1),
           "cases": []}
    deadline = time.perf_counter() + a.budget_s
    for name in a.cases.split(","):
        if time.perf_counter() > deadline:
            doc["cases"].append({"name": name, "error": "skipped: out of the call's time"})
            continue
        if a.in_process:
            try:
                case = run_case(name, work, hbm, h2d)
            except Exception as e:  # record the failure and go on with the other cases
                case = {"name": name, "error": f"{type(e).__name__}: {e}"}
        else:
            case = run_case_in_child(name, work, hbm, h2d,
                                     max(60.0, min(deadline - time.perf_counter(), 1e6) + 600))
            if name in a.memtrace.split(",") and "error" not in case:
                diag = run_case_in_child(name, work, hbm, h2d, 600, {"SLIPSTREAM_MEMTRACE": "1"})
                case["vram_peak_trace"] = diag.get("vram_peak_trace", diag.get("error"))
                case["vram_gib_traced_run"] = diag.get("vram_gib")
        doc["cases"].append(case)
        print(json.dumps(case), flush=True)
        _speedup(doc["cases"])
        (out / "gpu-resident.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{'case':22} {'tg tok/s':>12} {'roofline':>9} {'frac':>6} {'pp512 tok/s':>12} "
          f"{'VRAM GiB':>9} {'capture s':>9}")
    for c in doc["cases"]:
        if "error" in c:
            print(f"{c['name']:22} ERROR {c['error'][:80]}")
            continue
        print(f"{c['name']:22} {c['decode_tok_s']:12.2f} {c['roofline_decode_tok_s']:9.2f} "
              f"{c['decode_fraction_of_roofline']:6.2f} {c['prefill512_tok_s']:12.1f} "
              f"{c['vram_gib']:9.2f} {c['graph_capture_s']:9.2f}")
        if "disk_gbps_achieved" in c:
            print(f"{'':22} disk {c['disk_gbps_achieved']:.2f} GB/s of O_DIRECT "
                  f"{c['odirect_seq_read_gbps']:.2f} ({c['disk_fraction_of_odirect']:.0%}), "
                  f"H2D {c['h2d_gbps_achieved']:.1f} GB/s"
                  + (f", {c['speedup_tiered_over_mmap_decode']}x tiered over mmap"
                     if "speedup_tiered_over_mmap_decode" in c else ""))


if __name__ == "__main__":
    main()
