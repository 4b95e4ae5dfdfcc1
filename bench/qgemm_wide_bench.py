"""qgemm's fast kernels side by side: the per-slot one (kernels/qgemm.py) and the wide one
(kernels/qgemm_wide.py, one [BN, NU*32] x [NU*32, m] MMA per K step) with float32 and with
float16 dequantization (the default), on an 8B draft's matrices, with a tile sweep of the
wide kernel.

    python bench/qgemm_wide_bench.py OUT_DIR [--sweep] [--compile-only --part I/N]

Times are CUDA-graph replays over copies of the weight that overflow the L2 (kernels_bench.py's
method), fused scales (precision "fast", a resident layer). "of_hbm" is GGUF bytes over time
over the device-to-device copy rate measured in the same run. The summary is one 8B draft
level's matmuls (32 layers of qkv, o, gate_up, down in Q4_K, and the Q6_K head) by width.
--compile-only launches every variant once on small weights (Triton compiles into its cache),
so N processes can compile in parallel before the timed run. Writes OUT_DIR/qgemm-wide.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernels_bench import _graph_time, _random_packed, hbm_copy_gbps  # noqa: E402
from qgemm_bench import HEAD_8B, LAYER_8B, LAYERS_8B, results_header, weights  # noqa: E402

from slipstream.kernels.gemv_q8 import gemv_q8  # noqa: E402
from slipstream.kernels.pack import fuse_scales  # noqa: E402
from slipstream.kernels.qgemm import qgemm  # noqa: E402
from slipstream.kernels import qgemm_wide  # noqa: E402
from slipstream.kernels.qgemm_wide import wide_config  # noqa: E402

CASES = [(T.Q4_K, s) for s in LAYER_8B] + [(T.Q6_K, HEAD_8B), (T.Q8_0, LAYER_8B[2])]
WIDTHS = (2, 4, 8, 16, 32, 64, 128)
SWEEP_WIDTHS = (8, 32, 128)
# the kernels at their default tiles: per slot, wide, wide with float16 dequantization
PATHS = {"slots": {"KERNEL": "slots"}, "wide_f32": {"KERNEL": "wide", "F16MATH": False},
         "wide": {"KERNEL": "wide"}}
SWEEP_CASES = [CASES[i] for i in (0, 2, 3, 4)]  # qkv, gate_up, down, head


def sweep_configs(n: int, nut: int, m: int) -> list[dict]:
    out = []
    for bn, nu, warps, fill, f16 in itertools.product((64, 128), (2, 4), (4, 8), (1, 2),
                                                      (False, True)):
        split = 1
        while -(-n // bn) * split < fill * 132 and nut // (split * 2) >= 2 * nu:
            split *= 2
        cfg = {"KERNEL": "wide", "BN": bn, "NU": nu, "SPLIT": split, "num_warps": warps,
               "num_stages": 3, "F16MATH": f16}
        if m <= 16:
            out.append({**cfg, "M_PAD": 16})
        out.append(cfg)
    return [dict(c) for c in {json.dumps(c, sort_keys=True): c for c in out}.values()]


def time_call(ws: list, m: int, config: dict | None, path: str = "qgemm") -> float:
    k, n = ws[0].cols, ws[0].rows
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    if path == "gemv_q8":
        return _graph_time([lambda w=w: gemv_q8(x, w, out=y) for w in ws])
    return _graph_time([lambda w=w: qgemm(x, w, out=y, config=config) for w in ws])


def leave_out(out_dir: Path) -> None:
    """The wide kernel at its default tiles with nothing, the scales, the MMA or the unpacking
    left out (qgemm_wide's LEAVE_OUT; the results are wrong on purpose): by difference, what
    each stage of a K step costs."""
    stages = {0: "full", 1: "no scales", 2: "no MMA", 3: "no unpacking"}
    qt, (name, n, k) = CASES[2]
    ws = [fuse_scales(w) for w in weights(qt, n, k)]
    rows = []
    for m in (16, 128):
        for lo, what in stages.items():
            t = time_call(ws, m, {"KERNEL": "wide", "LEAVE_OUT": lo})
            rows.append({"format": qt.name, "shape": name, "m": m, "left_out": what,
                         "us": round(t * 1e6, 2)})
            print(f"{name} m={m:3d} {what:13s} {t * 1e6:8.1f} us", flush=True)
    doc = results_header(hbm_copy_gbps()) | {"rows": rows}
    (out_dir / "qgemm-leave-out.json").write_text(json.dumps(doc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--leave-out", action="store_true",
                    help="only time the wide kernel with each stage left out in turn (gate_up "
                         "Q4_K, 16 and 128 rows): where a step's time goes")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    torch.manual_seed(0)
    part, parts = map(int, a.part.split("/"))
    if a.compile_only:  # every variant once, on weights of the same formats
        jobs = []  # (format, rows, K, m, config): the sweep's on 256 rows, SPLIT 1 or 2 (the
        # partials' float32 output is another specialization), the defaults on the real shape
        for qt, (name, n, k) in SWEEP_CASES if a.sweep else []:
            for m in SWEEP_WIDTHS:
                jobs += [(qt, 256, k, m, {**c, "SPLIT": min(c["SPLIT"], 2)})
                         for c in sweep_configs(n, k // 32, m)]
        for qt, (name, n, k) in CASES:
            for m in WIDTHS:
                jobs += [(qt, n, k, m, c) for c in PATHS.values()]
        uniq = {json.dumps([j[0].name, *j[1:]], sort_keys=True): j for j in jobs}
        for i, key in enumerate(sorted(uniq)):
            if i % parts != part:
                continue
            qt, n, k, m, cfg = uniq[key]
            w = fuse_scales(_random_packed(qt, n, k)[0])
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            try:
                qgemm(x, w, out=torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
                      config=cfg)
            except Exception as e:
                print(f"compile {qt.name} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        return
    if a.leave_out:
        leave_out(Path(a.out_dir))
        return
    hbm = hbm_copy_gbps()
    doc = results_header(hbm)
    out = Path(a.out_dir) / "qgemm-wide.json"
    for qt, (name, n, k) in CASES:
        ws = [fuse_scales(w) for w in weights(qt, n, k)]
        gb = ws[0].gguf_bytes
        if a.sweep and (qt, (name, n, k)) in SWEEP_CASES:
            for m in SWEEP_WIDTHS:
                best = None
                for cfg in sweep_configs(n, k // 32, m):
                    try:
                        t = time_call(ws, m, cfg)
                        r = {"us": round(t * 1e6, 2), "of_hbm": round(gb / t / 1e9 / hbm, 4)}
                    except Exception as e:
                        r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                    doc["sweep"].append({"format": qt.name, "shape": name, "m": m,
                                         "config": cfg, **r})
                    if "us" in r and (best is None or r["us"] < best[0]):
                        best = (r["us"], cfg)
                if best:
                    print(f"sweep {qt.name} {name:20s} m={m:3d} best {best[0]:8.1f} us "
                          f"({gb / best[0] / 1e3 / hbm:.2f} of HBM) {best[1]}", flush=True)
            out.write_text(json.dumps(doc, indent=1))
        for m in WIDTHS:
            row = {"format": qt.name, "shape": name, "N": n, "K": k, "m": m, "gguf_bytes": gb,
                   "wide_config": wide_config(ws[0], m)}
            paths = PATHS
            for p, cfg in paths.items():
                try:
                    t = time_call(ws, m, cfg)
                    row[f"{p}_us"] = round(t * 1e6, 2)
                    row[f"{p}_of_hbm"] = round(gb / t / 1e9 / hbm, 4)
                except Exception as e:
                    row[f"{p}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                if p.startswith("wide") and qgemm_wide.last_launch is not None:
                    row[f"{p}_regs"] = getattr(qgemm_wide.last_launch, "n_regs", None)
                    row[f"{p}_spills"] = getattr(qgemm_wide.last_launch, "n_spills", None)
            if m <= 8:
                t = time_call(ws, m, None, "gemv_q8")
                row["gemv_q8_us"] = round(t * 1e6, 2)
            doc["rows"].append(row)
            print(f"{qt.name:5s} {name:20s} m={m:3d} " + " ".join(
                f"{p} {row.get(p + '_us', float('nan')):7.1f}" for p in paths) + " us" +
                (f" gemv_q8 {row['gemv_q8_us']:7.1f}" if m <= 8 else "") +
                f" (best {max(row.get(p + '_of_hbm', 0) for p in paths):.2f} of HBM)",
                flush=True)
        del ws
        torch.cuda.empty_cache()
        out.write_text(json.dumps(doc, indent=1))
    level = []
    for m in WIDTHS:
        parts_ = {}
        for p in PATHS:
            us = [r.get(f"{p}_us") for r in doc["rows"] if r["m"] == m and
                  (r["format"], r["shape"]) in {("Q4_K", s[0]) for s in LAYER_8B} |
                  {("Q6_K", HEAD_8B[0])}]
            if len(us) == 5 and None not in us:
                parts_[p] = round((LAYERS_8B * sum(us[:4]) + us[4]) / 1e3, 3)
        level.append({"m": m, "level_matmul_ms": parts_})
    doc["level_8b"] = level
    out.write_text(json.dumps(doc, indent=1))
    print(f"\n{doc['device']}  HBM copy {hbm:.0f} GB/s; an 8B draft level's matmuls, ms:")
    print(f"{'m':>4s} " + " ".join(f"{p:>8s}" for p in PATHS))
    for r in level:
        lv = r["level_matmul_ms"]
        print(f"{r['m']:4d} " + " ".join(f"{lv.get(p, float('nan')):8.2f}"
                                          for p in PATHS))


if __name__ == "__main__":
    main()
