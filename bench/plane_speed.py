"""The CPU kernels hybrid decode's CPU share can run, on a 70B layer's share: the image's planes
read in place (hybrid.plane_host, kind "planes"), q4vnni (Q4_K's own scales, 4.625 bits a
weight), q4vnni-f32 (its float32 records before session 35, 6 bits) and torch's int4pack.

    python bench/plane_speed.py OUTDIR [--threads 1,2] [--share 0.6] [--reps 3] [--rounds 3]

Each kind multiplies m activation rows (1: decode, 4: a small tree) by a split layer's CPU units
(a 70B's FFN: hidden 8192, 28672 units, the CPU taking `share` of them: gate/up's rows as one
matrix, down's columns as another), random weights made directly in each layout: the best of
--reps in each of --rounds rounds, the kinds taking turns within a round (a shared machine's
load moves between them), and the median over the rounds. Each timed call goes to the next of
--layers distinct shares (default: as many as outweigh twice the last-level cache), so that
the weights come from DRAM as in decode, where a split layer's share is read once a token: a
300 MiB L3 (session 37's and 39's H100 hosts) holds one 70B share of 243 MB, and calling it
again measured the cache (session 39: 60.8 then 33.3 Gweights/s for a token in two rounds,
106-144 for 4). Reports ms a layer, weights a second and bytes read a second (each layout's own bytes:
planes and q4vnni 4.625 bits a Q4_K weight, q4vnni-f32 6, int4pack 5). Prints a table; writes
OUTDIR/plane-speed.json. On a small machine the kernels are compute-bound (their weights a
second is the figure); on a GPU host sharing its memory bus with the copies, bytes are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.hybrid import plan as hybrid_plan  # noqa: E402
from slipstream.provenance import cpu_name, source_revision  # noqa: E402
from slipstream.weights.cpu_packed import INT4_GROUP  # noqa: E402

HIDDEN, FFN, ALIGN = 8192, 28672, 256  # a 70B's layer


def layer_share(kind: str, units: int):
    """(call(x float32 (m, HIDDEN)), bytes read): gate/up rows and down's columns of `units`
    FFN units, in kind's layout, random."""
    shapes = ((2 * units, HIDDEN), (HIDDEN, units))
    if kind == "int4pack":
        mats = [hybrid_plan._int4_weight(*s) for s in shapes]

        def mul(i, x):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), mats[i][0], INT4_GROUP, mats[i][1]).float()

        nbytes = sum(p.numel() + sz.numel() * 2 for p, sz in mats)
    else:
        if kind == "planes":
            mats = [hybrid_plan._plane_weight(*s) for s in shapes]
        else:  # q4vnni: Q4_K's own scales (4.625 bits); q4vnni-f32: the float32 records (6)
            mats = [hybrid_plan._q4vnni_weight(*s, k_scales=kind == "q4vnni") for s in shapes]

        def mul(i, x):
            out = torch.empty(x.shape[0], mats[i].out_features)
            return mats[i].matvec(x, out)

        nbytes = sum(m.nbytes for m in mats)

    def call(x):
        gate, up = mul(0, x).chunk(2, dim=-1)
        return mul(1, (torch.nn.functional.silu(gate) * up).contiguous())

    return call, nbytes


def _q4_amx() -> int | None:
    from slipstream import native

    lib = native.library()
    return None if lib is None else int(lib.ss_q4_has_amx())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1 and all)")
    ap.add_argument("--share", type=float, default=0.6)
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="planes,q4vnni,q4vnni-f32,int4pack")
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct shares each kind rotates over (0: outweigh twice the LLC)")
    a = ap.parse_args()
    cores = torch.get_num_threads()
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    units = int(round(FFN * a.share / ALIGN)) * ALIGN
    weights = 3 * units * HIDDEN
    tokens = [int(v) for v in a.tokens.split(",")]
    kinds = a.kinds.split(",")
    per_kind = {kind: layer_share(kind, units) for kind in kinds}
    layers = a.layers or max(1, -(-2 * hybrid_plan.last_level_cache_bytes()
                                  // min(n for _, n in per_kind.values())))
    # each kind's calls rotate over `layers` distinct shares (the first one made above)
    shares = {kind: ([call] + [layer_share(kind, units)[0] for _ in range(layers - 1)], nbytes)
              for kind, (call, nbytes) in per_kind.items()}
    times: dict[tuple, list[float]] = {}
    for _ in range(a.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for m in tokens:
                x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m))
                for kind in kinds:
                    calls = shares[kind][0]
                    for call in calls:  # warm: threads awake, pages touched
                        call(x)
                    best = float("inf")
                    for _ in range(a.reps):
                        t0 = time.perf_counter()
                        for call in calls:
                            call(x)
                        best = min(best, (time.perf_counter() - t0) / len(calls))
                    times.setdefault((kind, t, m), []).append(best)
    rows = []
    print(f"{'kind':>9} {'threads':>7} {'m':>3} {'ms/layer':>9} {'Gweights/s':>10} {'GB/s':>7}"
          f"  rounds (ms)")
    for (kind, t, m), ts in times.items():
        best = statistics.median(ts)
        nbytes = shares[kind][1]
        row = {"kind": kind, "threads": t, "tokens": m, "ms_per_layer": round(best * 1e3, 3),
               "rounds_ms": [round(v * 1e3, 3) for v in ts],
               "gweights_per_s": round(weights / best / 1e9, 2),
               "gb_per_s": round(nbytes / best / 1e9, 2), "bytes": nbytes,
               "bits_per_weight": round(nbytes * 8 / weights, 3)}
        rows.append(row)
        print(f"{kind:>9} {t:>7} {m:>3} {row['ms_per_layer']:>9} {row['gweights_per_s']:>10} "
              f"{row['gb_per_s']:>7}  {row['rounds_ms']}", flush=True)
    torch.set_num_threads(cores)
    doc = {"bench": "plane-speed", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": "cpu", "cpu": cpu_name(), "cores": cores, **source_revision(ROOT),
           "torch": torch.__version__, "share": a.share, "cpu_units": units,
           # build-time settings of the native loops (native/__init__.py), if any
           "native_defines": os.environ.get("SLIPSTREAM_NATIVE_DEFINES", ""),
           # which loop ran passes of more than 4 rows (1: AMX tiles; a Q4_AMX=1 build at 0
           # ran VNNI: no tiles in its compiler, CPU or kernel)
           "q4_amx": _q4_amx(),
           "weights_per_layer": weights, "rows": rows,
           "rounds": a.rounds, "reps": a.reps, "layers": layers,
           "last_level_cache_mib": hybrid_plan.last_level_cache_bytes() >> 20,
           "note": "random weights in each layout; the median over rounds of the best of "
                   "--reps (each a pass over `layers` distinct shares, per share), kinds taking "
                   "turns; a 70B layer's CPU share"}
    a.outdir.mkdir(parents=True, exist_ok=True)
    (a.outdir / "plane-speed.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
