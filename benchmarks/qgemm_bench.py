"""Small-m matmuls on the GPU: the tensor-core quantized GEMM (kernels/qgemm.py) against the
fused GEMVs (m <= 8) and dequantize + cuBLAS (the path m > 8 took before), m = 1..128.

    python bench/qgemm_bench.py OUT_DIR [--no-sweep]

Times are CUDA-graph replays over copies of the weight that overflow the L2 (kernels_bench.py's
method), so each matmul reads its weight from HBM as a draft's tree level does. "of HBM" is
the GGUF bytes over the time, divided by the device-to-device copy rate measured in the same
run. The summary adds one 8B Llama layer's matmuls (qkv, o, gate_up, down; Q4_K) times 32 and
the Q6_K head: the matmul part of a draft tree level at each width, by path.
--sweep (default on) first times a grid of qgemm tiles on the Q4_K shapes (sweep rows in the
JSON), to check qgemm_config's choices against the best found.
Writes OUT_DIR/qgemm-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernels_bench import _copies_for, _graph_time, _random_packed, hbm_copy_gbps  # noqa: E402

from slipstream import kernels  # noqa: E402
from slipstream.kernels.gemv_q8 import gemv_q8  # noqa: E402
from slipstream.kernels.pack import f16_scales, fuse_scales  # noqa: E402
from slipstream.kernels.qgemm import qgemm, qgemm_config  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402

LAYER_8B = [("qkv 6144x4096", 6144, 4096), ("o 4096x4096", 4096, 4096),
            ("gate_up 28672x4096", 28672, 4096), ("down 4096x14336", 4096, 14336)]
HEAD_8B = ("head 128256x4096", 128256, 4096)
LAYERS_8B = 32
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
CASES = [(T.Q4_K, s) for s in LAYER_8B] + [(T.Q6_K, HEAD_8B), (T.Q8_0, LAYER_8B[2])]


def weights(qt: T, n: int, k: int) -> list:
    probe = _random_packed(qt, n, k)[0]
    ws = [probe] + _random_packed(qt, n, k, _copies_for(probe.gguf_bytes) - 1)
    return ws


def time_path(path: str, ws: list, m: int, config: dict | None = None) -> float:
    """Seconds of one matmul of m rows by one of the weights, along `path`."""
    k, n = ws[0].cols, ws[0].rows
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    if path == "gemv":
        fns = [lambda w=w: kernels.gemv(x, w, out=y) for w in ws]
    elif path == "gemv_q8":
        fns = [lambda w=w: gemv_q8(x, w, out=y) for w in ws]
    elif path == "qgemm":
        fns = [lambda w=w: qgemm(x, w, out=y, config=config) for w in ws]
    elif path == "qgemm_streamed":  # a streamed layer's GGUF scale planes: fused for the call
        buf = torch.empty(n * k // 8, device="cuda", dtype=torch.float16)
        unfused = [f16_scales(w) for w in ws]
        fns = [lambda w=w: qgemm(x, w, out=y, scale_buffer=buf) for w in unfused]
    else:  # dequantize into one float16 scratch + cuBLAS: what m > 8 did before qgemm
        scratch = torch.empty(n, k, device="cuda", dtype=torch.float16)
        x16 = x.to(torch.float16)
        fns = [lambda w=w: torch.matmul(x16, kernels.dequantize(w, torch.float16, out=scratch).t(),
                                        out=y.view(torch.float16)) for w in ws]
    return _graph_time(fns)


def sweep(hbm: float) -> list[dict]:
    rows = []
    for name, n, k in (LAYER_8B[0], LAYER_8B[2]):
        ws = weights(T.Q4_K, n, k)
        for m in (16, 128):
            for bn, warps in ((64, 4), (128, 8)):
                for nu in (8, 16):
                    for split in (1, 2, 4):
                        cfg = {"BN": bn, "NU": nu, "SPLIT": split, "num_warps": warps}
                        try:
                            t = time_path("qgemm", ws, m, cfg)
                            r = {"us": round(t * 1e6, 2),
                                 "of_hbm": round(ws[0].gguf_bytes / t / 1e9 / hbm, 4)}
                        except Exception as e:  # a tile that does not compile is data too
                            r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                        rows.append({"shape": name, "m": m, "config": cfg, **r})
            best = min((r for r in rows if r["shape"] == name and r["m"] == m and "us" in r),
                       key=lambda r: r["us"])
            chosen = qgemm_config(ws[0], m)
            try:
                t = time_path("qgemm", ws, m)
            except Exception as e:
                t = float("nan")
                print(f"default config {chosen}: {type(e).__name__}: {str(e)[:160]}")
            print(f"sweep {name:20s} m={m:3d} best {best['us']:8.1f} us {best['config']}  "
                  f"default {t * 1e6:8.1f} us {chosen}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def results_header(hbm: float) -> dict:
    """The GPU results shape's fields (device, commit, tree, date, versions), the copy rate
    measured in the run, and empty rows and sweep."""
    rev = source_revision()
    return {"device": torch.cuda.get_device_name(), "commit": rev["commit"], "tree": rev["tree"],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "hbm_copy_GBps": round(hbm, 1), "rows": [], "sweep": []}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    torch.manual_seed(0)
    hbm = hbm_copy_gbps()
    doc = results_header(hbm)
    out = Path(a.out_dir) / "qgemm-bench.json"
    if not a.no_sweep:
        doc["sweep"] = sweep(hbm)
        out.write_text(json.dumps(doc, indent=1))
    for qt, (name, n, k) in CASES:
        raw = weights(qt, n, k)
        for fast in (False, True):
            ws = [fuse_scales(w) for w in raw] if fast else raw
            for m in WIDTHS:
                row = {"format": qt.name, "shape": name, "N": n, "K": k, "m": m,
                       "fused_scales": fast, "gguf_bytes": ws[0].gguf_bytes}
                paths = ["qgemm"] + (["gemv_q8" if fast else "gemv"] if m <= 8 else []) + \
                    (["dequant_cublas"] if m >= 8 and not fast else []) + \
                    (["qgemm_streamed"] if fast and qt == T.Q4_K and m >= 16 else [])
                for p in paths:
                    try:
                        t = time_path(p, raw if p == "qgemm_streamed" else ws, m)
                        row[f"{p}_us"] = round(t * 1e6, 2)
                        row[f"{p}_of_hbm"] = round(ws[0].gguf_bytes / t / 1e9 / hbm, 4)
                    except Exception as e:
                        row[f"{p}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                doc["rows"].append(row)
                print(f"{qt.name:5s} {'fast' if fast else 'exact':5s} {name:20s} m={m:3d} " +
                      " ".join(f"{p} {row.get(p + '_us', float('nan')):9.1f} us" for p in paths),
                      flush=True)
            del ws
        del raw
        torch.cuda.empty_cache()
        out.write_text(json.dumps(doc, indent=1))
    # one draft level's matmuls (8B, Q4_K layers, Q6_K head) by path and width
    summary = []
    for fast in (False, True):
        for m in WIDTHS:
            level = {}
            for p in ("qgemm", "gemv_q8" if fast else "gemv", "dequant_cublas"):
                parts = [r.get(f"{p}_us") for r in doc["rows"] if r["m"] == m and
                         r["fused_scales"] == fast and
                         (r["format"], r["shape"]) in {("Q4_K", s[0]) for s in LAYER_8B} |
                         {("Q6_K", HEAD_8B[0])}]
                if len(parts) == 5 and None not in parts:
                    level[p] = round((LAYERS_8B * sum(parts[:4]) + parts[4]) / 1e3, 3)
            summary.append({"m": m, "fused_scales": fast, "level_matmul_ms": level})
    doc["level_8b"] = summary
    out.write_text(json.dumps(doc, indent=1))
    print(f"\n{doc['device']}  HBM copy {hbm:.0f} GB/s; an 8B draft level's matmuls (32 Q4_K "
          f"layers + Q6_K head), ms:")
    print(f"{'m':>4s} {'precision':9s} {'qgemm':>8s} {'gemv':>8s} {'dequant+cuBLAS':>15s}")
    for s in summary:
        lv = s["level_matmul_ms"]
        gv = lv.get("gemv_q8" if s["fused_scales"] else "gemv")
        print(f"{s['m']:4d} {'fast' if s['fused_scales'] else 'exact':9s} "
              f"{lv.get('qgemm', float('nan')):8.2f} "
              f"{gv if gv is not None else float('nan'):8.2f} "
              f"{lv.get('dequant_cublas', float('nan')):15.2f}")


if __name__ == "__main__":
    main()
