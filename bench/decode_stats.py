"""Where a streamed decode token's time goes, from the store's CUDA events (what `slipstream
run --stats` reports), over decode steps alone: prefill and warm-up stay out of the average.

    python bench/decode_stats.py MODEL --vram-budget 24GiB [--tokens 16] [--json FILE]

It uses only the API that every slipstream since the streaming stores has (load, engine.forward
/ decode / reset, the store's enable_timing / collect / stats), so the same script measures an
older tree put first on PYTHONPATH: bench/before_after.sh runs it on both sides of a change.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import slipstream


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vram-budget", default="24GiB")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None, help="append one JSON line to this file")
    a = ap.parse_args()
    model = slipstream.load(a.model, device="cuda", ctx=640, vram_budget=a.vram_budget)
    engine, store = model.engine, model.engine.layers
    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(a.tokens, device="cuda") + 100
    for i in range(4):  # warm-up: kernels compiled, the ring in its steady state
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    store.stats.reset()
    store.enable_timing()
    t0 = time.perf_counter()
    for i in range(a.tokens):
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    store.collect()
    store.enable_timing(False)
    s, n = store.stats, a.tokens
    out = {"label": a.label, "slipstream": slipstream.__file__, "model": a.model,
           "vram_budget": a.vram_budget, "tokens": n,
           "tiers": {t: model.plan.tiers.count(t) for t in set(model.plan.tiers)},
           "wall_ms_per_token": round(wall / n * 1e3, 2),
           "compute_ms_per_token": round(s.compute_s / n * 1e3, 2),
           "stall_ms_per_token": round(s.stall_s / n * 1e3, 2),
           "h2d_busy_ms_per_token": round(s.h2d_s / n * 1e3, 2),
           "h2d_gbps_busy": round(s.h2d_bytes / s.h2d_s / 1e9, 1) if s.h2d_s else None,
           "layers_streamed_per_token": s.layers_streamed / n}
    print(json.dumps(out), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
