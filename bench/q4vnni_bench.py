"""The q4vnni matvec (native/q4_matvec.c) against torch's int4 CPU kernel on the default model's
layer matrices (fused as the CPU engine fuses them: qkv, o, gate_up, down), one bfloat16
activation row, 1 and 2 threads. Rounds alternate the two kernels and the thread counts; each
figure is the median over rounds of a round's median of `--reps` calls, with the spread (min-max
of the round medians).

Each call goes to the next of all the model's layers in turn (`--layers all`, the default), as a
decode step does, so the weights come from RAM rather than cache (one layer's four matrices,
~2.2 MB, would sit in L2/L3); `--layers 0` times layer 0 alone (cache-hot). "rel err": the
kernel's output against float64 of gguf-py's dequantized weights times the same bfloat16 row,
||y - y_ref|| / ||y_ref||, layer 0.

    PYTHONPATH=src python bench/q4vnni_bench.py --rounds 7 --reps 200 \\
        --out bench/results/DATE-q4vnni-bench
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import gguf.quants
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from slipstream.modelfile.gguf_file import GGUFFile  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.hub.pull import pull_default  # noqa: E402
from slipstream.weights.cpu_packed import (Int4PackLinear, Int4PairLinear,  # noqa: E402
                                           Q4VnniLinear, Q8VnniLinear)

GROUPS = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"],
          "gate_up": ["ffn_gate", "ffn_up"], "down": ["ffn_down"]}


def layer_parts(gf: GGUFFile, layer: int, parts: list[str]):
    raws, types, shapes = [], [], []
    for p in parts:
        info = gf.tensors[f"blk.{layer}.{p}.weight"]
        shape = (int(info.shape[0]), int(info.shape[1]))
        raws.append(torch.from_numpy(gf.tensor_bytes(f"blk.{layer}.{p}.weight").copy())
                    .reshape(shape[0], -1))
        types.append(info.ggml_type)
        shapes.append(shape)
    return raws, types, shapes


def time_calls(fn, reps: int) -> float:
    """Median seconds of one call over reps calls (after 10 warm-up calls)."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matvecs(lins: list[Q4VnniLinear], bits: int):
    """One-row bfloat16 calls of each linear with `bits`-bit activations, as the native decode
    layer makes them: straight into a buffer kept for it."""
    out = torch.empty(1, lins[0].out_features, dtype=torch.bfloat16)
    return [lambda xb, lin=lin: lin.matvec(xb, out, act_bits=bits) for lin in lins]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--layers", default="all", help="all, or one layer's index")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    path = a.model or str(pull_default(quiet=True))
    gf = GGUFFile(path)
    n_layers = sum(1 for n in gf.tensors if n.endswith(".attn_norm.weight"))
    layers = range(n_layers) if a.layers == "all" else [int(a.layers)]
    cases = {}
    for name, parts in GROUPS.items():
        int4, vnni = [], []
        for i in layers:
            raws, types, shapes = layer_parts(gf, i, parts)
            int4.append(Int4PackLinear.from_raws(raws, types, shapes))
            vnni.append(Q4VnniLinear.from_raws(raws, types, shapes))
            if len(int4) == 1:
                w = torch.cat([torch.from_numpy(gguf.quants.dequantize(r.numpy(), t))
                               for r, t in zip(raws, types)]).double()
                xb = torch.randn(1, shapes[0][1]).to(torch.bfloat16)
                ref = xb.double() @ w.t()
                rel = {"int4pack": float((int4[0].kernel(xb).double() - ref).norm() / ref.norm())}
                for p in (8, 16):
                    y = vnni[0].matvec(xb, torch.empty(1, ref.shape[1], dtype=torch.bfloat16),
                                       act_bits=p)
                    rel[f"q4vnni/{p}"] = float((y.double() - ref).norm() / ref.norm())
        cases[name] = (int4, vnni, xb, rel, (sum(s[0] for s in shapes), shapes[0][1]),
                       [t.name for t in types])
    # the tied Q8_0 head: int4pair (the "int4pack" column) against q8vnni, one matrix
    info = gf.tensors["token_embd.weight"]
    shape = (int(info.shape[0]), int(info.shape[1]))
    raw = torch.from_numpy(gf.tensor_bytes("token_embd.weight").copy()).reshape(shape[0], -1)
    pair = Int4PairLinear.from_raws([raw], [info.ggml_type], [shape])
    q8 = Q8VnniLinear.from_raws([raw], [info.ggml_type], [shape])
    xb = torch.randn(1, shape[1]).to(torch.bfloat16)
    ref = xb.double() @ torch.from_numpy(gguf.quants.dequantize(raw.numpy(), info.ggml_type)
                                         ).double().t()
    rel = {"int4pack": float((pair.kernel(xb).double() - ref).norm() / ref.norm())}
    for p in (8, 16):
        y = q8.matvec(xb, torch.empty(1, shape[0], dtype=torch.bfloat16), act_bits=p)
        rel[f"q4vnni/{p}"] = float((y.double() - ref).norm() / ref.norm())
    cases["head (int4pair / q8vnni)"] = ([pair], [q8], xb, rel, shape, [info.ggml_type.name])
    times: dict[tuple[str, str, int], list[float]] = {}
    saved = torch.get_num_threads()
    with torch.inference_mode():
        for _ in range(a.rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, (int4, vnni, xb, *_r) in cases.items():
                    for kind, calls in (("int4pack", [lin.kernel for lin in int4]),
                                        ("q4vnni/8", matvecs(vnni, 8)),
                                        ("q4vnni/16", matvecs(vnni, 16))):
                        turn = itertools.cycle(calls)
                        t = time_calls(lambda: next(turn)(xb), a.reps)
                        times.setdefault((name, kind, threads), []).append(t)
    torch.set_num_threads(saved)
    rows = []
    kinds = ("int4pack", "q4vnni/8", "q4vnni/16")
    for name, (_i, _v, _x, rel, shape, types) in cases.items():
        for threads in (1, 2):
            row = {"matrix": name, "shape": list(shape), "types": types, "threads": threads,
                   "rel_err": rel}
            for kind in kinds:
                ts = times[(name, kind, threads)]
                row[kind] = {"us": 1e6 * statistics.median(ts),
                             "spread_us": [1e6 * min(ts), 1e6 * max(ts)]}
            rows.append(row)
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    lines = [f"q4vnni (8- and 16-bit activations) vs int4pack, one bf16 row, layers {a.layers} of "
             f"{Path(path).name} in turn, {a.rounds} rounds x {a.reps} calls ({date}, "
             f"{(source_revision()['commit'] or '')[:10]})", "",
             "| matrix (out x in) | threads | int4pack us | q4vnni/8 us | q4vnni/16 us | "
             "speedup /8 | speedup /16 | rel err int4pack | /8 | /16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[k]['us']:.1f} ({r[k]['spread_us'][0]:.1f}-{r[k]['spread_us'][1]:.1f})"
                 for k in kinds]
        lines.append(f"| {r['matrix']} {r['shape'][0]}x{r['shape'][1]} | {r['threads']} | "
                     + " | ".join(cells) + " | "
                     f"{r['int4pack']['us'] / r['q4vnni/8']['us']:.2f}x | "
                     f"{r['int4pack']['us'] / r['q4vnni/16']['us']:.2f}x | "
                     + " | ".join(f"{r['rel_err'][k]:.1e}" for k in kinds) + " |")
    for threads in (1, 2):
        tot = {k: sum(r[k]["us"] for r in rows if r["threads"] == threads and
                      not r["matrix"].startswith("head")) for k in kinds}
        lines.append(f"| one layer (sum) | {threads} | " + " | ".join(
            f"{tot[k]:.1f}" for k in kinds) + f" | {tot['int4pack'] / tot['q4vnni/8']:.2f}x | "
            f"{tot['int4pack'] / tot['q4vnni/16']:.2f}x | | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"name": "q4vnni-bench", "model": Path(path).name, "rows": rows, "date": date,
               "layers": a.layers, "rounds": a.rounds, "reps": a.reps,
               "device": platform.processor() or "cpu",
               "commit": source_revision()}
        a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        a.out.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
    main()
