"""The CPU: decode and prefill against llama.cpp, and the speed of the packed CPU kernels.

    python benchmarks/cpu.py speed --llama-build ../llama.cpp/build [--threads 2] [--rounds 3]
        [-m FILE --case CASE --pp 512 --tg 128 --pin-threads --baseline-src ../main/src]
    OMP_NUM_THREADS=2 python benchmarks/cpu.py kernels [--threads 1 2] [--formats q4vnni]
    python benchmarks/cpu.py threads [--compete 1] [--rounds 3]

speed: the default model's decode (tg128) and prefill (pp512) through `slipstream bench --device
cpu` against llama.cpp's `llama-bench -p 512 -n 128`, back to back on the same machine and
alternating (llama.cpp, slipstream, llama.cpp, ...) so that a shared machine's load falls on
both; the medians over --rounds. --baseline-src DIR (another checkout's src/) adds that tree's
`slipstream bench` to every round, right after this tree's: a before/after ratio under the same
load. --pp and --tg set the tests' sizes (default 512 and 128) on both sides; --pin-threads runs
slipstream on --threads too, as llama-bench's -t (else load() picks the count). Writes
RESULTS/DATE-CASE-cpu.json (--case; default: default-cpu).

threads: decode (tg64 after a 16-token prompt) at the default thread count, which load() picks
from the cores other processes leave free, against each explicit -t, back to back and
alternating, with --compete CPU-bound processes running beside it; the default should reach 0.9
of the best explicit count. Writes RESULTS/DATE-threads-under-load-cpu.json with the load
average around each run.

kernels: batch-1 matrix-vector products on 70B-sized (8192x8192, 28672x8192, 8192x28672) and
8B-sized (4096x4096, 1024x4096, 14336x4096, 4096x14336) weights, per layout:

    f32 dense, f16 dense     DenseLinear, what precision "exact" / "fast" use on CPU for prefill
    bf16 dense               DenseLinear on bfloat16 weights (for comparison)
    q4vnni (Q4_K)            native/q4_matvec.c on the file's 4-bit codes (decode's default)
    q8vnni (Q8_0)            the same loop on 8-bit codes
    int4pack (Q4_K)          aten._weight_int4pack_mm_for_cpu, group 32, bf16 scales/zeros
    int4pair (Q8_0)          the int4 kernel on Q8_0's codes split in two nibbles
    int8pack (Q8_0)          aten._weight_int8pack_mm, one bf16 scale per row
    cb4 (MXFP4, IQ4_XS)      native/cb4_matvec.c on the codebook formats' 4-bit codes
    iq (IQ3_XXS .. IQ1_M)    native/iq_matvec.c on the i-quant grid formats' own blocks

at each thread count of --threads. GB/s counts the bytes a call reads (the layout's codes and
scales; for dense the matrix), against the machine's memory read rate measured in the same run.
Each layout cycles through copies of its weights totalling at least --rotate-gib, so a call reads
RAM rather than a cache the previous call warmed. The machine may be shared: the median
(typical) and the minimum are both kept, with the load average around each row. An m sweep
(1..8 rows) on one 8B matrix follows. Writes RESULTS/DATE-CASE-cpu.json (--case; default
cpu-kernels). --rotate-gib 0 (two copies) on a small shape times the kernels from cache.
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
import tempfile
import time
from pathlib import Path

import common  # noqa: E402,F401  (puts this checkout's src/ first on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from slipstream.memory.probes import memory_read_gbps  # noqa: E402
from slipstream.synth import random_tensor  # noqa: E402
from slipstream.weights.cpu import pack_linear  # noqa: E402
from slipstream.weights.cpu.groups import GroupAffine  # noqa: E402
from slipstream.weights.linear import DenseLinear  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/slipstream/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = common.ROOT


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def slipstream_cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(common.SRC))
    return subprocess.run([sys.executable, "-m", "slipstream", *args], check=True,
                          capture_output=True, text=True, env=env)


def bench_args(pp: int, tg: int, pin_threads: int | None) -> list[str]:
    """`slipstream bench`'s test sizes, and -t where the threads are pinned (else load()
    picks them from the cores other processes leave free)."""
    return ["--pp", str(pp), "--tg", str(tg)] + (
        [] if pin_threads is None else ["-t", str(pin_threads)])


def speed(build, model_path, threads, reps, work, pp: int = 512, tg: int = 128,
          pin_threads: int | None = None) -> dict:
    la0 = loadavg()
    out = subprocess.run([str(build / "bin/llama-bench"), "-m", str(model_path), "-p", str(pp),
                          "-n", str(tg), "-t", str(threads), "-r", str(reps), "-o", "json"],
                         check=True, capture_output=True, text=True)
    lb = json.loads(out.stdout)
    la1 = loadavg()
    jf = work / "sl_bench.json"
    slipstream_cli(["bench", "-m", str(model_path), "--device", "cpu", "--reps", str(reps),
                    *bench_args(pp, tg, pin_threads), "--json", str(jf)])
    sj = json.loads(jf.read_text())
    la2 = loadavg()
    lc = {}
    for r in lb:
        key = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        lc[key] = {"tok_s": r["avg_ts"], "tok_s_std": r["stddev_ts"]}
    sl = {r["test"]: {"tok_s": r["tok_s"], "tok_s_std": r["tok_s_std"]} for r in sj["results"]}
    # the decode roofline of this round: the bytes a token reads over the memory read rate
    # `slipstream bench` measured beside its runs (both engines read the same file's weights)
    roof = {k: sj.get(k) for k in ("memory_read_gbps", "weight_bytes_per_token",
                                   "roofline_decode_tok_s")}
    return {"llama": lc, "slipstream": sl, "roofline": roof, "threads": threads, "reps": reps,
            "loadavg_before": la0, "loadavg_between": la1, "loadavg_after": la2,
            "llama_build": {k: lb[0].get(k) for k in ("build_commit", "cpu_info", "backends",
                                                       "type_k", "flash_attn", "n_batch")}}



SHAPES = {
    "70b attn 8192x8192": (8192, 8192),
    "70b gate/up 28672x8192": (28672, 8192),
    "70b down 8192x28672": (8192, 28672),
    "8b attn 4096x4096": (4096, 4096),
    "8b kv 1024x4096": (1024, 4096),
    "8b gate/up 14336x4096": (14336, 4096),
    "8b down 4096x14336": (4096, 14336),
    # gpt-oss's head (Q8_0 in the files it ships): most of a short gpt-oss file's token bytes
    "gpt-oss head 201088x2880": (201088, 2880),
}
FORMATS = ("f32 dense", "f16 dense", "bf16 dense", "q4vnni (Q4_K)", "q8vnni (Q8_0)",
           "int4pack (Q4_K)", "int4pair (Q8_0)", "int8pack (Q8_0)", "cb4 (MXFP4)",
           "cb4 (IQ4_XS)", "iq (IQ3_XXS)", "iq (IQ2_XXS)", "iq (IQ3_S)", "iq (IQ1_S)",
           "iq (IQ2_XS)", "iq (IQ2_S)", "iq (IQ1_M)")


def _meta() -> dict:
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
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
    qtype = Q[fmt.split("(")[1].rstrip(")")]  # "q4vnni (Q4_K)" -> Q4_K
    raw = torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)
    return pack_linear(raw, qtype, (rows, cols), kind=fmt.split()[0])


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
    t = Table(title=f"batch-1 matvec on {doc['host']['cpu']} ({doc['host']['cores']} cores), "
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


def baseline_speed(src: Path, model: Path, reps: int, work: Path, pp: int = 512,
                   tg: int = 128, pin_threads: int | None = None) -> dict:
    """`slipstream bench` of the checkout whose package is `src`, as speed() runs this one's."""
    jf = work / "baseline_bench.json"
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-m", "slipstream", "bench", "-m", str(model),
                    "--device", "cpu", "--reps", str(reps), *bench_args(pp, tg, pin_threads),
                    "--json", str(jf)], check=True,
                   capture_output=True, text=True, env=env, cwd=src.parent)
    sj = json.loads(jf.read_text())
    return {"tests": {r["test"]: {"tok_s": r["tok_s"], "tok_s_std": r["tok_s_std"]}
                      for r in sj["results"]},
            "commit": sj.get("commit"), "loadavg_after": loadavg()}


def speed_cmd(a: argparse.Namespace) -> None:
    model = a.model or DEFAULT_MODEL
    work = Path(tempfile.mkdtemp(prefix="cpu_speed_"))
    rounds = []
    pin = a.threads if a.pin_threads else None
    for _ in range(a.rounds):
        r = speed(a.llama_build, model, a.threads, a.reps, work, a.pp, a.tg, pin)
        if a.baseline_src is not None:
            r["baseline"] = baseline_speed(a.baseline_src.resolve(), model, a.reps, work,
                                           a.pp, a.tg, pin)
        rounds.append(r)
    summary = {}
    for test in (f"pp{a.pp}", f"tg{a.tg}"):
        lc = statistics.median(r["llama"][test]["tok_s"] for r in rounds)
        sl = statistics.median(r["slipstream"][test]["tok_s"] for r in rounds)
        summary[test] = {"llama_cpp_tok_s": round(lc, 1), "slipstream_tok_s": round(sl, 1),
                         "ratio": round(sl / lc, 3)}
        roofs = [r["roofline"]["roofline_decode_tok_s"] for r in rounds
                 if (r.get("roofline") or {}).get("roofline_decode_tok_s")]
        if test.startswith("tg") and roofs:
            roof = statistics.median(roofs)
            summary[test].update(roofline_tok_s=round(roof, 1),
                                 llama_cpp_of_roofline=round(lc / roof, 3),
                                 slipstream_of_roofline=round(sl / roof, 3))
        if a.baseline_src is not None:
            bl = statistics.median(r["baseline"]["tests"][test]["tok_s"] for r in rounds)
            summary[test].update(baseline_tok_s=round(bl, 1),
                                 baseline_ratio=round(bl / lc, 3),
                                 speedup_over_baseline=round(sl / bl, 3))
    doc = {"name": "cpu-speed-vs-llamacpp", "model": Path(model).name, "threads": a.threads,
           "slipstream_threads": "pinned" if a.pin_threads else "default",
           "summary": summary, "rounds": rounds}
    if a.baseline_src is not None:
        doc["baseline_src"] = str(a.baseline_src)
    doc = {**common.provenance("cpu"), **doc}
    path = common.write_result(a.case, doc, a.results)
    lines = [f"CPU speed, {Path(model).name}, {a.threads} threads, {a.rounds} rounds x "
             f"{a.reps} reps, medians over rounds ({doc['date']}, {doc.get('commit', '')[:10]})",
             "", "| test | llama.cpp tok/s | slipstream tok/s | ratio | roofline tok/s | "
             "llama.cpp / roofline | slipstream / roofline |", "|---|---:|---:|---:|---:|---:|---:|"]
    for test, s in summary.items():
        lines.append(f"| {test} | {s['llama_cpp_tok_s']} | {s['slipstream_tok_s']} | "
                     f"{s['ratio']} | {s.get('roofline_tok_s', '-')} | "
                     f"{s.get('llama_cpp_of_roofline', '-')} | {s.get('slipstream_of_roofline', '-')} |")
    if a.baseline_src is not None:
        base = rounds[0]["baseline"].get("commit") or ""
        lines += ["", f"baseline (before), {a.baseline_src} at {base[:10]}, in the same rounds:",
                  "", "| test | llama.cpp tok/s | baseline tok/s | ratio | this tree / baseline |",
                  "|---|---:|---:|---:|---:|"]
        for test, s in summary.items():
            lines.append(f"| {test} | {s['llama_cpp_tok_s']} | {s['baseline_tok_s']} | "
                         f"{s['baseline_ratio']} | {s['speedup_over_baseline']} |")
    lines.append("")
    for test in summary:  # the spread a shared machine's load leaves, round by round
        who = "llama.cpp / slipstream" + (" / baseline" if a.baseline_src else "")
        lines.append(f"{test} per round, {who}: " + "; ".join(
            f"{r['llama'][test]['tok_s']:.1f} / {r['slipstream'][test]['tok_s']:.1f}"
            + (f" / {r['baseline']['tests'][test]['tok_s']:.1f}" if a.baseline_src else "")
            for r in rounds))
    lines.append("load average per round (before / between / after"
                 + (" / after the baseline" if a.baseline_src else "") + "): " + "; ".join(
        f"{r['loadavg_before']} / {r['loadavg_between']} / {r['loadavg_after']}"
        + (f" / {r['baseline']['loadavg_after']}" if a.baseline_src else "") for r in rounds))
    print("\n".join(lines))
    print(f"wrote {path}")



# --- threads under load -----------------------------------------------------------------------

SPIN = "while True: pass"  # the competing CPU-bound process


def decode_tok_s(model: Path, threads: int | None, tokens: int, reps: int, work: Path,
                 src: Path = common.SRC) -> dict:
    """`slipstream bench` decode (a 16-token prompt, then `tokens`) at `threads` (None: the
    default, chosen at load), in a fresh process running the tree at `src`."""
    jf = work / "threads_bench.json"
    args = ["bench", "-m", str(model), "--device", "cpu", "--pp", "16", "--tg", str(tokens),
            "--reps", str(reps), "--json", str(jf)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the default's own
    la0 = loadavg()
    subprocess.run([sys.executable, "-m", "slipstream", *args]
                   + ([] if threads is None else ["-t", str(threads)]), check=True,
                   capture_output=True, text=True, env={**env, "PYTHONPATH": str(src)})
    doc = json.loads(jf.read_text())
    tg = next(r for r in doc["results"] if r["test"] == f"tg{tokens}")
    return {"threads_given": threads, "threads_used": doc.get("threads"),
            "tok_s": tg["tok_s"], "tok_s_std": tg["tok_s_std"], "loadavg_before": la0,
            "loadavg_after": loadavg()}


def threads_cmd(a: argparse.Namespace) -> None:
    """Decode at the default thread count against each explicit -t, back to back and
    alternating, beside --compete CPU-bound processes: the default should reach 0.9 of the
    best explicit count."""
    model = a.model or DEFAULT_MODEL
    work = Path(tempfile.mkdtemp(prefix="cpu_threads_"))
    counts = a.counts or list(range(1, len(os.sched_getaffinity(0)) + 1))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(a.compete)]
    rounds: list[dict] = []
    try:
        time.sleep(1.0)  # the competitors are running before the first load samples the CPUs
        for r in range(a.rounds):
            order = [None, *counts] if r % 2 == 0 else [*counts, None]
            rd = {str(t if t is not None else "default"):
                  decode_tok_s(model, t, a.tokens, a.reps, work) for t in order}
            if a.baseline_src is not None:  # the other tree's default, in the same round
                rd["baseline default"] = decode_tok_s(model, None, a.tokens, a.reps, work,
                                                      a.baseline_src.resolve())
            rounds.append(rd)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    keys = ["default", *map(str, counts)] + (["baseline default"] if a.baseline_src else [])
    med = {k: statistics.median(rd[k]["tok_s"] for rd in rounds) for k in keys}
    best = max(counts, key=lambda t: med[str(t)])
    ratio = med["default"] / med[str(best)]
    summary = {"decode_tok_s_median": {k: round(v, 1) for k, v in med.items()},
               "default_threads_used": sorted({rd["default"]["threads_used"] for rd in rounds}),
               "best_explicit": best, "default_over_best": round(ratio, 3),
               "meets_0_9": ratio >= 0.9}
    loads = [x for rd in rounds for v in rd.values()
             for x in (v["loadavg_before"][0], v["loadavg_after"][0])]
    doc = {**common.provenance("cpu"), "name": "threads-under-load", "model": Path(model).name,
           "competing_processes": a.compete, "decode_tokens": a.tokens, "reps": a.reps,
           "rounds_n": a.rounds, "loadavg_1m": {"min": min(loads), "max": max(loads)},
           "omp_wait_policy_env": os.environ.get("OMP_WAIT_POLICY"),
           "baseline_src": str(a.baseline_src) if a.baseline_src else None,
           "summary": summary, "rounds": rounds}
    path = common.write_result("threads-under-load", doc, a.results)
    print(f"decode tok/s beside {a.compete} CPU-bound process(es), medians of {a.rounds} "
          f"rounds ({doc['date']}, {str(doc.get('commit', ''))[:10]}, "
          f"{doc['host']['cpu']}, load average {min(loads):.1f}-{max(loads):.1f})\n")
    print("| threads | decode tok/s |\n|---|---:|")
    for k in keys:
        used = f" (chose {summary['default_threads_used']})" if k == "default" else (
            f" ({a.baseline_src}: torch's threads, OpenMP's own wait policy)"
            if k == "baseline default" else "")
        print(f"| {k}{used} | {med[k]:.1f} |")
    print(f"\ndefault / best explicit (-t {best}): {ratio:.2f} (target >= 0.9)\nwrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(common.RESULTS), help="where the JSON goes")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("speed", help="decode and prefill against llama.cpp's llama-bench")
    sp.add_argument("--llama-build", type=Path, required=True)
    sp.add_argument("-m", "--model", type=Path, default=None)
    sp.add_argument("--case", default="default-cpu",
                    help="the result's case name (default-cpu: the default model)")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--reps", type=int, default=3)
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--baseline-src", type=Path, default=None,
                    help="another checkout's src/, timed after this one in every round")
    sp.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill test")
    sp.add_argument("--tg", type=int, default=128, help="tokens of the decode test")
    sp.add_argument("--pin-threads", action="store_true",
                    help="slipstream on --threads too (default: the count load() picks)")
    mv = sub.add_parser("kernels", help="the packed CPU layouts' matvec speed")
    mv.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    mv.add_argument("--shapes", nargs="*", help="e.g. 8192x8192 4096x4096 (default: all)")
    mv.add_argument("--formats", nargs="*", help="substrings of layout names (default: all)")
    mv.add_argument("--seconds", type=float, default=1.5, help="timing per row")
    mv.add_argument("--min-calls", type=int, default=5)
    mv.add_argument("--rotate-gib", type=float, default=1.0)
    mv.add_argument("--case", default="cpu-kernels", help="the result file's case name")
    mv.add_argument("--no-m-sweep", dest="m_sweep", action="store_false")
    mv.add_argument("--sweep-threads", type=int, default=1,
                    help="threads of the m sweep (a loaded 2nd core makes t=2 rows waits)")
    th = sub.add_parser("threads", help="decode at the default threads against each -t, "
                        "beside competing CPU-bound processes")
    th.add_argument("-m", "--model", type=Path, default=None)
    th.add_argument("--compete", type=int, default=1, help="CPU-bound processes beside it")
    th.add_argument("--counts", type=int, nargs="*", help="explicit -t values (default 1..CPUs)")
    th.add_argument("--tokens", type=int, default=64, help="decode tokens a run")
    th.add_argument("--reps", type=int, default=2)
    th.add_argument("--rounds", type=int, default=3)
    th.add_argument("--baseline-src", type=Path, default=None,
                    help="another checkout's src/: its default, in every round")
    a = ap.parse_args(argv)
    if a.cmd == "speed":
        speed_cmd(a)
        return
    if a.cmd == "threads":
        threads_cmd(a)
        return
    doc = {**common.provenance("cpu"), **matvec(a)}
    console = Console(width=200)
    for tab in (matvec_table(doc), sweep_table(doc)):
        if tab is not None:
            console.print(tab)
    doc["memory_read_gbps"] = round(memory_read_gbps(torch.device("cpu"), 1 << 30), 1)
    print(f"memory read {doc['memory_read_gbps']} GB/s; wrote "
          f"{common.write_result(a.case, doc, a.results)}")


if __name__ == "__main__":
    main()
