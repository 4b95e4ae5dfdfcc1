"""Load-time packing speed of the CPU layouts hybrid decode and CPU decode build from GGUF bytes
(weights.cpu_packed.pack_group): int4pack (torch's layout, packed natively by int4_pack.c),
q4vnni and q4vnni-f16, each natively and through the torch-op path it replaced (session 29).

    python bench/pack_speed.py OUTDIR [--rows 7168 --cols 4096 --reps 3]

One thread (the load packs on a pool of single-threaded workers: the pool is the parallelism),
a gate/up pair of Q4_K matrices of the given shape (an 8B's half FFN by default), the best of
--reps. Prints a table; writes OUTDIR/pack-speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.provenance import cpu_name, source_revision  # noqa: E402
from slipstream.weights import int4_native  # noqa: E402
from slipstream.weights.cpu_packed import pack_group  # noqa: E402
from slipstream.weights.int4_native import _random_matrix  # noqa: E402


def seconds(raws, shapes, kind: str, reps: int) -> float:
    pack_group(raws, [Q.Q4_K] * 2, shapes, [None, None], kind)  # first call: library, caches
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        pack_group(raws, [Q.Q4_K] * 2, shapes, [None, None], kind)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--rows", type=int, default=7168)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    raws = [_random_matrix(Q.Q4_K, a.rows, a.cols, gen) for _ in range(2)]
    shapes = [(a.rows, a.cols)] * 2
    gguf_bytes = sum(r.numel() for r in raws)
    rows = []
    for kind, layout in (("torch", "int4pack"), ("auto", "q4vnni"), ("auto-f16", "q4vnni-f16")):
        for path in ("native", "torch ops"):
            if path == "torch ops" and layout == "int4pack":
                continue  # its torch-op path is int4pack_torch, replaced in session 23
            with mock.patch.object(int4_native, "q4vnni_native", lambda *x, **k: None) \
                    if path == "torch ops" else contextlib.nullcontext():
                s = seconds(raws, shapes, kind, a.reps)
            rows.append({"layout": layout, "path": path, "seconds": round(s, 4),
                         "gguf_gbps": round(gguf_bytes / s / 1e9, 3)})
            print(f"{layout:12} {path:10} {s * 1e3:8.1f} ms {gguf_bytes / s / 1e9:6.2f} GB/s "
                  f"of Q4_K", flush=True)
    doc = {"what": "packing a gate/up pair of Q4_K matrices on one thread",
           "shape": [a.rows, a.cols], "gguf_bytes": gguf_bytes, "reps": a.reps,
           "cpu": cpu_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **source_revision(), "torch": torch.__version__, "rows": rows}
    a.outdir.mkdir(parents=True, exist_ok=True)
    (a.outdir / "pack-speed.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
