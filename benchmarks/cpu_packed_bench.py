"""Packed CPU linears (weights.cpu_packed) against the dense ones: speed.

matvec (the default): batch-1 matrix-vector products on 70B-sized (8192x8192, 28672x8192,
8192x28672) and 8B-sized (4096x4096, 1024x4096, 14336x4096, 4096x14336) weights, per layout:

    f32 dense, f16 dense     DenseLinear, what precision "exact" / "fast" use on CPU today
    bf16 dense               DenseLinear on bfloat16 weights (for comparison)
    int4pack (Q4_K)          aten._weight_int4pack_mm_for_cpu, group 32, bf16 scales/zeros
    int4pair (Q8_0)          the int4 kernel on Q8_0's codes split in two nibbles (2x the
                             columns, x fed twice), bf16 block scales
    int8pack (Q8_0)          aten._weight_int8pack_mm, one bf16 scale per row
    dequant-dot (Q4_K/Q8_0)  float32 dequantize-and-dot on the GGUF codes, eager torch
    dequant-dot compiled     the same as one torch.compile'd reduction (m = 1; m > 1 eager)

at each thread count of --threads. GB/s counts the bytes a call reads: the layout's weights
(codes and scales; for dense the matrix). Each layout cycles through copies of its weights
totalling at least --rotate-gib, so a call reads RAM rather than a cache the previous call warmed
(the L3 here is large). The machine may be shared: times are per call, and the median (typical)
and the minimum (what the machine gives when nobody else runs) are both kept, with the load
average around each row. Weights are packed with one thread (packing is many small ops, which a
busy second core stalls). An m sweep (1..8 rows) on one 8B matrix follows (--sweep-threads).

The perplexity cost of the layouts is bench/cpu_packed_ppl.py's.

    OMP_NUM_THREADS=2 python bench/cpu_packed_bench.py matvec \\
        --out bench/results/2026-11-30-s6-cpu-packed-bench
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # this checkout's slipstream, whatever is pip-installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from slipstream.synth import random_tensor  # noqa: E402
from slipstream.weights.cpu_packed import GroupAffine, pack_linear  # noqa: E402
from slipstream.weights.linear import DenseLinear  # noqa: E402

SHAPES = {
    "70b attn 8192x8192": (8192, 8192),
    "70b gate/up 28672x8192": (28672, 8192),
    "70b down 8192x28672": (8192, 28672),
    "8b attn 4096x4096": (4096, 4096),
    "8b kv 1024x4096": (1024, 4096),
    "8b gate/up 14336x4096": (14336, 4096),
    "8b down 4096x14336": (4096, 14336),
}
FORMATS = ("f32 dense", "f16 dense", "bf16 dense", "int4pack (Q4_K)", "int4pair (Q8_0)",
           "int8pack (Q8_0)",
           "dequant-dot (Q4_K)", "dequant-dot (Q8_0)", "dequant-dot compiled (Q4_K)",
           "dequant-dot compiled (Q8_0)")


def _meta() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"device": "cpu", "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": rev,
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


# --- matvec ------------------------------------------------------------------------------------

def _clone(lin):
    """A copy of a linear with its own weight memory (scratch buffers shared)."""
    new = copy.copy(lin)
    for k, v in vars(lin).items():
        if isinstance(v, torch.Tensor) and k != "_buf":
            setattr(new, k, v.clone())
    if hasattr(lin, "ga"):
        ga = lin.ga
        new.ga = GroupAffine(ga.codes.clone(), ga.scale.clone(),
                             None if ga.offset is None else ga.offset.clone(), ga.group, ga.lo)
    return new


def _nbytes(lin) -> int:
    if isinstance(lin, DenseLinear):
        return lin.weight.numel() * lin.weight.element_size()
    return lin.nbytes


def build(fmt: str, rows: int, cols: int, rng: np.random.Generator):
    if fmt.endswith("dense"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[
            fmt.split()[0]]
        return DenseLinear((0.02 * torch.randn(rows, cols)).to(dtype))
    qtype = Q.Q4_K if "Q4_K" in fmt else Q.Q8_0
    raw = torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)
    kind = ("dequant-compiled" if "compiled" in fmt else "dequant") if fmt.startswith(
        "dequant") else fmt.split()[0]
    return pack_linear(raw, qtype, (rows, cols), kind=kind)


def time_calls(lins: list, m: int, cols: int, min_s: float, min_calls: int) -> list[float]:
    x = torch.randn(m, cols)
    for lin in lins:  # warm: every copy touched once
        lin(x)
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    i = 0
    while time.perf_counter() < t_end or len(times) < min_calls:
        lin = lins[i % len(lins)]
        t0 = time.perf_counter()
        lin(x)
        times.append(time.perf_counter() - t0)
        i += 1
    return times


def _copies(lin, rotate_gib: float) -> list:
    n = max(2, math.ceil(rotate_gib * 2 ** 30 / _nbytes(lin)))
    return [lin] + [_clone(lin) for _ in range(n - 1)]


def matvec(a: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    rows_out = []
    shapes = {k: v for k, v in SHAPES.items() if not a.shapes or k.split()[-1] in a.shapes}
    formats = [f for f in FORMATS if not a.formats or any(s in f for s in a.formats)]
    console = Console()
    for label, (rows, cols) in shapes.items():
        for fmt in formats:
            torch.set_num_threads(1)  # packing is many small ops: a busy 2nd core stalls them
            t0 = time.perf_counter()
            lin = build(fmt, rows, cols, rng)
            pack_s = time.perf_counter() - t0
            nb = _nbytes(lin)
            lins = _copies(lin, a.rotate_gib)
            for threads in a.threads:
                torch.set_num_threads(threads)
                load0 = os.getloadavg()[0]
                ts = time_calls(lins, 1, cols, a.seconds, a.min_calls)
                med, best = statistics.median(ts), min(ts)
                row = {"shape": label, "rows": rows, "cols": cols, "format": fmt,
                       "threads": threads, "m": 1, "bytes_per_call": nb, "copies": len(lins),
                       "calls": len(ts), "ms_median": round(med * 1e3, 3),
                       "ms_min": round(best * 1e3, 3), "gbps_median": round(nb / med / 1e9, 2),
                       "gbps_best": round(nb / best / 1e9, 2), "pack_s": round(pack_s, 2),
                       "loadavg_1min_before_after": [round(load0, 2),
                                                     round(os.getloadavg()[0], 2)]}
                rows_out.append(row)
                console.print(f"{label:24s} {fmt:28s} t={threads} {row['ms_median']:9.2f} ms "
                              f"(min {row['ms_min']:8.2f}) {row['gbps_median']:6.2f} GB/s "
                              f"(best {row['gbps_best']:6.2f}) "
                              f"load {row['loadavg_1min_before_after']}")
            del lins, lin
    sweep = []
    if a.m_sweep:
        rows, cols = SHAPES["8b attn 4096x4096"]
        for fmt in formats:
            torch.set_num_threads(1)
            lins = _copies(build(fmt, rows, cols, rng), a.rotate_gib)
            torch.set_num_threads(a.sweep_threads)
            for m in range(1, 9):
                ts = time_calls(lins, m, cols, a.seconds / 2, a.min_calls)
                sweep.append({"shape": "8b attn 4096x4096", "format": fmt, "m": m,
                              "threads": a.sweep_threads,
                              "ms_median": round(statistics.median(ts) * 1e3, 3),
                              "ms_min": round(min(ts) * 1e3, 3)})
            console.print(f"m sweep {fmt:28s} " + " ".join(
                f"{r['ms_median']:.2f}" for r in sweep[-8:]))
            del lins
    return {**_meta(), "kind": "matvec", "threads": a.threads, "rotate_gib": a.rotate_gib,
            "results": rows_out, "m_sweep": sweep}


def matvec_table(doc: dict) -> Table | None:
    if not doc["results"]:
        return None
    t = Table(title=f"batch-1 matvec on {doc['cpu_model']} ({doc['cpu_count']} cores), "
                    f"torch {doc['torch']}: ms per call (median) and GB/s of weights read "
                    f"(median / best)")
    threads = doc["threads"]
    t.add_column("shape")
    t.add_column("layout")
    t.add_column("MB/call", justify="right")
    for th in threads:
        t.add_column(f"ms t={th}", justify="right")
        t.add_column(f"GB/s t={th}", justify="right")
    keyed = {(r["shape"], r["format"], r["threads"]): r for r in doc["results"]}
    seen = []
    for r in doc["results"]:
        if (r["shape"], r["format"]) not in seen:
            seen.append((r["shape"], r["format"]))
    last = None
    for shape, fmt in seen:
        cells = [shape if shape != last else "", fmt,
                 f"{keyed[(shape, fmt, threads[0])]['bytes_per_call'] / 1e6:.1f}"]
        for th in threads:
            r = keyed.get((shape, fmt, th))
            cells += ([f"{r['ms_median']:.2f}", f"{r['gbps_median']:.2f} / {r['gbps_best']:.2f}"]
                      if r else ["", ""])
        t.add_row(*cells)
        last = shape
    return t


def sweep_table(doc: dict) -> Table | None:
    if not doc.get("m_sweep"):
        return None
    t = Table(title=f"ms per call against rows m (8B 4096x4096, {doc['m_sweep'][0]['threads']} "
                    f"thread(s), median)")
    t.add_column("layout")
    for m in range(1, 9):
        t.add_column(f"m={m}", justify="right")
    fmts = []
    for r in doc["m_sweep"]:
        if r["format"] not in fmts:
            fmts.append(r["format"])
    for f in fmts:
        t.add_row(f, *[f"{r['ms_median']:.2f}" for r in doc["m_sweep"] if r["format"] == f])
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")  # one mode today; "matvec" is accepted as its name
    mv = sub.add_parser("matvec")
    mv.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    mv.add_argument("--shapes", nargs="*", help="e.g. 8192x8192 4096x4096 (default: all)")
    mv.add_argument("--formats", nargs="*", help="substrings of layout names (default: all)")
    mv.add_argument("--seconds", type=float, default=1.5, help="timing per row")
    mv.add_argument("--min-calls", type=int, default=5)
    mv.add_argument("--rotate-gib", type=float, default=1.0)
    mv.add_argument("--no-m-sweep", dest="m_sweep", action="store_false")
    mv.add_argument("--sweep-threads", type=int, default=1,
                    help="threads of the m sweep (a loaded 2nd core makes t=2 rows waits)")
    mv.add_argument("--note", help="recorded in the JSON and under the tables as is")
    mv.add_argument("--out", help="path stem: writes STEM.json and STEM.txt")
    a = ap.parse_args()
    if a.cmd is None:
        a = ap.parse_args(["matvec", *sys.argv[1:]])
    doc = matvec(a)
    if a.note:
        doc["note"] = a.note
    tables = [matvec_table(doc), sweep_table(doc)]
    console = Console(width=200, record=True)
    for t in tables:
        if t is not None:
            console.print(t)
    if a.note:
        console.print(a.note)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(a.out + ".txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
