"""Time the Triton kernels on the GPU: fused GEMV (m = 1, 8), prefill matmul (m = 512), HBM copy.

    python benchmarks/kernels.py [OUT_DIR] [--quick] [--sweep] [--compile-only --part I/N]
        [--results DIR] [--moe]

Writes RESULTS/DATE-kernels-<device>.json (each row's GB/s against the device-to-device copy
rate measured in the same run); the sweeps write OUT_DIR/sweep.json.

--quick: Q4_K, Q6_K, Q8_0 and F16 only, on the 8B and 70B shapes, at m = 1, 8 and 512.

GEMV times are CUDA-graph replays of back-to-back launches over enough copies of the weight to
exceed the L2 (60 MB on an H200), so they are HBM-bound, launch gaps are squeezed out, and a
decode step captured in a graph would see the same. "GB/s" is the GGUF size of the weight over the
time (what a resident decode has to stream); "of HBM" divides by the device-to-device copy rate
measured in the same run (bytes read + written). Weights are random bytes: throughput does not
depend on the values (NaN scales included), only on sizes.

--moe times a mixture of experts' routed GEMVs instead (Qwen3-30B-A3B's and Mixtral 8x7B's
projections, one decode token's top_k experts per launch, ids read on the device), into
RESULTS/DATE-kernels-moe-<device>.json.

--sweep times a grid of tile configs on the large 8B shapes (written to sweep.json) to choose
gemv_config's table; --sweep-q8 the int8-activation kernel's (gemv_q8_config), and with
--families on the Qwen3-32B and Gemma-3-27B shapes. --compile-only/--part run every launch once without timing, in parallel
processes, so Triton's disk cache is warm before the timed (single-process) run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import common  # this checkout's src/ first on sys.path
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

FORMATS = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
           T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# (name, N, K)
SHAPES_8B = [("8B.q/o 4096x4096", 4096, 4096), ("8B.kv 1024x4096", 1024, 4096),
             ("8B.gate/up 14336x4096", 14336, 4096), ("8B.down 4096x14336", 4096, 14336)]
VOCAB_8B = ("8B.vocab 128256x4096", 128256, 4096)
SHAPES_70B = [("70B.q/o 8192x8192", 8192, 8192), ("70B.kv 1024x8192", 1024, 8192),
              ("70B.gate/up 28672x8192", 28672, 8192), ("70B.down 8192x28672", 8192, 28672)]
# the dense families' widest files, fused as the engine packs them (q|k|v, gate|up)
SHAPES_QWEN3_32B = [("32B.qkv 10240x5120", 10240, 5120), ("32B.o 5120x8192", 5120, 8192),
                    ("32B.gate/up 51200x5120", 51200, 5120), ("32B.down 5120x25600", 5120, 25600)]
SHAPES_GEMMA3_27B = [("27B.qkv 8192x5376", 8192, 5376), ("27B.o 5376x4096", 5376, 4096),
                     ("27B.gate/up 43008x5376", 43008, 5376),
                     ("27B.down 5376x21504", 5376, 21504)]
L2_BYTES = 60 << 20


def _random_packed(qt: T, n: int, k: int, copies: int = 1) -> list:
    block, tsize = GGML_QUANT_SIZES[qt]
    nbytes = n * k // block * tsize
    out = []
    for _ in range(copies):
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        out.append(kernels.pack_weight(raw, qt, n, k))
    return out


def _copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / nbytes)))


def _graph_time(fn_list, reps: int = 20) -> float:
    """Median seconds of one fn() call, from CUDA-graph replays of all fns back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list:  # warm-up (compiles) outside capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2] / len(fn_list)


def _event_time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def hbm_copy_gbps() -> float:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = _event_time(lambda: dst.copy_(src), reps=20)
    del src, dst
    return 2 * 2 * n / t / 1e9


_WCACHE: dict = {}


def _weights(qt: T, n: int, k: int, timed: bool, keep: bool = False) -> list:
    """Copies of a random weight (enough to overflow L2 when timed); `keep` caches them."""
    key = (qt, n, k, timed)
    if key in _WCACHE:
        return _WCACHE[key]
    probe = _random_packed(qt, n, k)[0]
    copies = _copies_for(probe.gguf_bytes) if timed else 1
    ws = [probe] + _random_packed(qt, n, k, copies - 1)
    if keep:
        _WCACHE.clear()
        _WCACHE[key] = ws
    return ws


def bench_gemv(qt: T, n: int, k: int, m: int, timed: bool, config=None, keep=False,
               q8: bool = False) -> dict:
    """q8: the int8-activation kernel (gemv_q8.py), its x-quantizing launch included."""
    ws = _weights(qt, n, k, timed, keep)
    probe = ws[0]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    if q8:  # precision="fast" weights: scales fused per unit
        ws = [fuse_scales(w) for w in ws]
        probe = ws[0]
        cfg = config or gemv_q8_config(probe, m)
        fns = [lambda w=w: gemv_q8(x, w, out=y, config=cfg) for w in ws]
    else:
        cfg = config or gemv_config(probe, m)
        fns = [lambda w=w: kernels.gemv(x, w, out=y, config=cfg) for w in ws]
    if not timed:
        fns[0]()
        return {}
    t = _graph_time(fns)
    return {"us": t * 1e6, "GBps": probe.gguf_bytes / t / 1e9,
            "packed_GBps": probe.nbytes / t / 1e9, "config": cfg}


def bench_prefill(qt: T, n: int, k: int, m: int, timed: bool) -> dict:
    w = _random_packed(qt, n, k)[0]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    scratch = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    fn = lambda: kernels.matmul(x, w, scratch=scratch)  # noqa: E731
    if not timed:
        fn()
        return {}
    t = _event_time(fn)
    tdq = _event_time(lambda: kernels.dequantize(w, out=scratch)) if qt != T.BF16 else 0.0
    tmm = _event_time(lambda: torch.matmul(x, scratch.t()))
    return {"us": t * 1e6, "TFLOPs": 2 * m * n * k / t / 1e12, "dequant_us": tdq * 1e6,
            "cublas_us": tmm * 1e6}


def sweep_configs(qt: T, m: int) -> list[dict]:
    if qt in (T.F32, T.F16, T.BF16):
        return [{"BN": bn, "BK": bk, "num_warps": nw} for bn in (1, 2, 4, 8, 16)
                for bk in (256, 512, 1024, 2048) for nw in (4, 8) if m * bn * bk <= 16384]
    if m < 0:  # the int8-activation kernel at |m| rows
        return [{"BN": bn, "NU": nu, "num_warps": nw} for bn in (1, 2, 4, 8)
                for nu in (16, 32, 64, 128) for nw in (2, 4, 8)]
    if m == 1:  # the m = 1 kernel (_gemv_q1_kernel): BN rows x NG scale groups per step
        return [{"BN": bn, "NG": ng, "num_warps": nw} for bn in (1, 2, 4, 8)
                for ng in (16, 32, 64, 128, 256) for nw in (4, 8) if bn * ng * 32 <= 16384]
    out = [{"BN": bn, "NU": nu, "num_warps": nw} for bn in (1, 2, 4, 8, 16)
           for nu in (8, 16, 32, 64) for nw in (4, 8) if 8 * bn * nu <= 2048]
    return out


# --sweep-q8 tunes the
# int8-activation kernel (m < 0 in these tuples means that kernel at |m| rows).
SWEEP_Q8_CASES = [(T.Q4_K, -1, [SHAPES_8B[2], SHAPES_8B[3], SHAPES_70B[2]]),
                  (T.Q6_K, -1, [VOCAB_8B]), (T.Q8_0, -1, [SHAPES_8B[2]])]
# --sweep-q8 --families: the Qwen3-32B and Gemma-3-27B shapes, Q4_K
SWEEP_Q8_FAMILY_CASES = [(T.Q4_K, -1, SHAPES_QWEN3_32B + SHAPES_GEMMA3_27B)]
SWEEP_CASES = [(T.Q4_K, 1, SHAPES_8B), (T.Q6_K, 1, [VOCAB_8B, SHAPES_8B[2]]),
               (T.Q8_0, 1, SHAPES_8B[2:3]), (T.Q4_0, 1, SHAPES_8B[2:3]),
               (T.Q5_K, 1, SHAPES_8B[3:4]), (T.Q3_K, 1, SHAPES_8B[3:4])]


QUICK_FORMATS = [T.Q4_K, T.Q6_K, T.Q8_0, T.F16]


# A mixture of experts' routed projections (kernels.gemv_routed, gemv_q8.gemv_q8_routed), as a
# decode token runs them: (name, experts, top_k, rows of one expert, K, x_div); gate/up's slots
# share the token's input (x_div = top_k), down's each have their own (x_div = 1)
MOE_SHAPES = [("Qwen3-30B-A3B gate/up", 128, 8, 1536, 2048, 8),
              ("Qwen3-30B-A3B down", 128, 8, 2048, 768, 1),
              ("Mixtral-8x7B gate/up", 8, 2, 28672, 4096, 2),
              ("Mixtral-8x7B down", 8, 2, 4096, 14336, 1)]
MOE_FORMATS = [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4]


def bench_routed(qt: T, e: int, k: int, n: int, kk: int, x_div: int, q8: bool,
                 timed: bool) -> dict:
    """One routed launch over k experts of a stacked (e * n, kk) weight; "GBps" is the k
    experts' GGUF bytes over its time. Launches with different random ids follow each other
    in the graph until they read 3 L2s, so the experts come from HBM, as in decode."""
    w = _random_packed(qt, e * n, kk)[0]
    if q8:
        w = fuse_scales(w)
    expert_bytes = w.gguf_bytes // e
    calls = max(1, min(64, math.ceil(3 * L2_BYTES / (k * expert_bytes))))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, e, (k,), generator=g).cuda() for _ in range(calls)]
    x = torch.randn(k // x_div, kk, device="cuda")
    if q8:
        xq, xm = quantize_x(x)
        fns = [lambda i=i: gemv_q8_routed(xq, xm, w, i, e, x_div) for i in ids]
    else:
        fns = [lambda i=i: kernels.gemv_routed(x, w, i, e, x_div, out_dtype=torch.float32)
               for i in ids]
    if not timed:
        fns[0]()
        return {}
    t = _graph_time(fns)
    return {"us": t * 1e6, "GBps": k * expert_bytes / t / 1e9}


def moe_rows(timed: bool) -> list[dict]:
    rows = []
    for qt in MOE_FORMATS:
        for name, e, k, n, kk, x_div in MOE_SHAPES:
            row = {"format": qt.name, "shape": name, "experts": e, "top_k": k, "N": n, "K": kk}
            for mode in ("f32", "q8"):
                if mode == "q8" and qt == T.MXFP4:  # codebook codes: no int8 GEMV
                    continue
                try:
                    row[mode] = bench_routed(qt, e, k, n, kk, x_div, mode == "q8", timed)
                except Exception as err:
                    row[mode] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def cases(quick: bool):
    """--quick: the anchor formats (Q4_K, Q6_K, Q8_0) and F16 on the 8B and 70B shapes."""
    for qt in (QUICK_FORMATS if quick else FORMATS):
        shapes = SHAPES_8B + ([VOCAB_8B] if qt in (T.Q6_K, T.Q4_K, T.Q8_0) else []) + SHAPES_70B
        for name, n, k in shapes:
            yield qt, name, n, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default="/tmp/kernels-bench",
                    help="the sweep's and the compile runs' files")
    ap.add_argument("--results", default=str(common.RESULTS), help="where the JSON goes")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-q8", action="store_true")
    ap.add_argument("--families", action="store_true",
                    help="with --sweep-q8: the Qwen3-32B and Gemma-3-27B shapes instead")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-main", action="store_true")
    ap.add_argument("--moe", action="store_true",
                    help="time the routed GEMVs of a mixture of experts instead")
    args = ap.parse_args()
    # Triton's kernels, once the arguments are read: --help runs on a machine without Triton
    global kernels, gemv_config, gemv_q8, gemv_q8_config, fuse_scales, gemv_q8_routed
    global quantize_x
    from slipstream import kernels
    from slipstream.kernels.gemv import gemv_config
    from slipstream.kernels.gemv_q8 import gemv_q8, gemv_q8_config, gemv_q8_routed, quantize_x
    from slipstream.kernels.pack import fuse_scales

    if args.moe:
        torch.manual_seed(0)
        hbm = hbm_copy_gbps() if not args.compile_only else 0.0
        rows = moe_rows(not args.compile_only)
        if args.compile_only:
            return
        doc = {**common.provenance("cuda"), "hbm_copy_gbps": round(hbm, 1),
               "triton": __import__("triton").__version__, "rows": rows}
        print(f"wrote {common.write_result('kernels-moe', doc, args.results)}")
        for r in rows:
            cells = [f"{m} {r[m]['us']:7.1f} us {r[m]['GBps']:6.0f} GB/s "
                     f"{100 * r[m]['GBps'] / hbm:5.1f}% HBM" if "us" in r.get(m, {}) else
                     f"{m} {r[m]['error'] if m in r else '-'}" for m in ("f32", "q8")]
            print(f"{r['format']:6s} {r['shape']:24s} " + " | ".join(cells))
        return

    os.makedirs(args.out_dir, exist_ok=True)
    part, nparts = (int(v) for v in args.part.split("/"))
    timed = not args.compile_only
    torch.manual_seed(0)

    if args.sweep or args.sweep_q8:
        sweep = []
        jobs = [(qt, m, name, n, k, cfg) for qt, m, shapes in
                (SWEEP_Q8_FAMILY_CASES if args.sweep_q8 and args.families else
                 SWEEP_Q8_CASES if args.sweep_q8 else SWEEP_CASES)
                for name, n, k in shapes for cfg in sweep_configs(qt, m)]
        if not timed:  # compile: one launch per (format, m, config) is enough
            seen, uniq = set(), []
            for j in jobs:
                key = (j[0], j[1], tuple(sorted(j[5].items())))
                if key not in seen:
                    seen.add(key)
                    uniq.append(j)
            jobs = [(qt, m, name, 64, k, cfg) for qt, m, name, n, k, cfg in uniq]
        for i, (qt, m, name, n, k, cfg) in enumerate(jobs):
            if i % nparts != part:
                continue
            try:
                r = bench_gemv(qt, abs(n), k, abs(m), timed, config=cfg, keep=True, q8=m < 0)
            except Exception as e:  # a config that does not compile or fit is data too
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            if timed:
                sweep.append({"format": qt.name, "m": m, "shape": name, **r,
                              "config": cfg})
                print(f"sweep {qt.name:5s} m={m} {name:24s} {cfg} "
                      f"{r.get('GBps', float('nan')):8.1f} GB/s", flush=True)
        _WCACHE.clear()
        if timed:
            with open(os.path.join(args.out_dir, "sweep.json"), "w") as f:
                json.dump(sweep, f, indent=1)
            best = {}
            for r in sweep:
                key = (r["format"], r["m"], r["shape"])
                if "GBps" in r and r["GBps"] > best.get(key, {}).get("GBps", 0):
                    best[key] = r
            print("\nbest configs:")
            for key, r in best.items():
                print(f"  {key}: {r['config']} {r['GBps']:.0f} GB/s ({r['us']:.1f} us)")
        if args.no_main:
            return

    rows = []
    hbm = hbm_copy_gbps() if timed else 0.0
    t0 = time.time()
    for i, (qt, name, n, k) in enumerate(cases(args.quick)):
        if i % nparts != part:
            continue
        row = {"format": qt.name, "shape": name, "N": n, "K": k}
        for m in (1, 8):
            try:
                r = bench_gemv(qt, n, k, m, timed, keep=True)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            row[f"m{m}"] = r
            if qt not in (T.F32, T.F16, T.BF16):
                try:
                    r = bench_gemv(qt, n, k, m, timed, keep=True, q8=True)
                except Exception as e:
                    r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row[f"m{m}q8"] = r
        try:
            row["m512"] = bench_prefill(qt, n, k, 512, timed)
        except Exception as e:
            row["m512"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
        torch.cuda.empty_cache()
        if timed:
            with open(os.path.join(args.out_dir, "kernels_bench.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "hbm_copy_GBps": hbm,
                           "torch": torch.__version__, "triton": __import__("triton").__version__,
                           "rows": rows}, f, indent=1)
    if not timed:
        return
    doc = {**common.provenance("cuda"), "hbm_copy_gbps": round(hbm, 1),
           "triton": __import__("triton").__version__, "quick": args.quick, "rows": rows}
    print(f"wrote {common.write_result('kernels', doc, args.results)}")
    print(f"\n{torch.cuda.get_device_name()}  HBM copy (read+write): {hbm:.0f} GB/s  "
          f"[{time.time() - t0:.0f}s]")
    print(f"{'format':6s} {'shape':24s} {'m=1 us':>8s} {'GB/s':>6s} {'%HBM':>5s} "
          f"{'m=8 us':>8s} {'GB/s':>6s} {'%HBM':>5s} "
          f"{'q8 m=1':>8s} {'GB/s':>6s} {'%HBM':>5s} {'q8 m=8':>8s} {'GB/s':>6s} {'%HBM':>5s} "
          f"{'m=512 us':>9s} {'TFLOP/s':>8s}")
    for row in rows:
        cells = []
        for m in ("m1", "m8", "m1q8", "m8q8"):
            r = row.get(m, {})
            if "us" in r:
                cells.append(f"{r['us']:8.1f} {r['GBps']:6.0f} {100 * r['GBps'] / hbm:5.1f}")
            else:
                cells.append(f"{'ERR':>8s} {'':6s} {'':5s}")
        p = row["m512"]
        cells.append(f"{p['us']:9.1f} {p['TFLOPs']:8.1f}" if "us" in p else f"{'ERR':>9s}")
        print(f"{row['format']:6s} {row['shape']:24s} " + " ".join(cells))
    errs = [(r["format"], r["shape"], m, r[m]["error"]) for r in rows
            for m in ("m1", "m8", "m1q8", "m8q8", "m512") if "error" in r.get(m, {})]
    for e in errs:
        print("ERROR", *e)


if __name__ == "__main__":
    sys.exit(main())
