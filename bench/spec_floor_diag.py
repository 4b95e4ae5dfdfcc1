"""Why plain decode after a draft is given up runs slower than plain decode at the same budget
(issue 12's floor): the store's CUDA events (as `--stats`) for three ways of reaching the same
resident count on the synthetic 70B at 24 GiB.

    python bench/spec_floor_diag.py OUTDIR --workdir /tmp/slipstream-models

  plain      loaded at the budget with no draft;
  released   loaded with the 8B draft inside the budget, the draft given up at once
             (Model.release_draft: its VRAM goes to promoted layers), nothing generated before;
  promoted   loaded with no draft at the budget less the draft's share, then the same room
             promoted (store.promote), to tell the promotion apart from the release.

Each row: tiers, wall ms per decode token (host clock around synchronised steps), GPU compute,
stall and copy-busy ms per token (CUDA events), and the copy GB/s while busy. Writes
OUTDIR/spec-floor-diag.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import slipstream  # noqa: E402
from slipstream.api import DRAFT_GRAPH_HEADROOM  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402


def timed_decode(model, tokens: int) -> dict:
    engine, store = model.engine, model.engine.layers
    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(tokens + 4, device="cuda") + 100
    for i in range(4):  # warm-up: the ring in its steady state
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    store.stats.reset()
    store.enable_timing()
    t0 = time.perf_counter()
    for i in range(tokens):
        engine.decode(ids[4 + i:5 + i])
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    store.collect()
    store.enable_timing(False)
    s, n = store.stats, tokens
    tiers = model.plan.tiers
    return {"tiers": {t: tiers.count(t) for t in sorted(set(tiers))},
            "streamed": [i for i, t in enumerate(tiers) if t != "vram"],
            "tok_s": round(n / wall, 3),
            "wall_ms_per_token": round(wall / n * 1e3, 2),
            "compute_ms_per_token": round(s.compute_s / n * 1e3, 2),
            "stall_ms_per_token": round(s.stall_s / n * 1e3, 2),
            "h2d_busy_ms_per_token": round(s.h2d_s / n * 1e3, 2),
            "h2d_gb_per_token": round(s.h2d_bytes / n / 1e9, 3),
            "h2d_gbps_busy": round(s.h2d_bytes / s.h2d_s / 1e9, 1) if s.h2d_s else None,
            "vram_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t70, t8 = work / "70b-Q4_K.gguf", work / "8b-Q4_K.gguf"
    for path, shape in ((t70, "70b"), (t8, "8b")):
        if not path.exists():
            write_synth(path, shape, "Q4_K")
    rows = []

    def run(label: str, model, **extra) -> None:
        row = {"case": label} | extra | timed_decode(model, a.tokens)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "streamed"}), flush=True)
        write()

    def write() -> None:
        out = {"name": "spec-floor-diag", "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "commit": source_revision(), "tokens": a.tokens, "rows": rows}
        Path(a.outdir, "spec-floor-diag.json").write_text(json.dumps(out, indent=1))

    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB") as m:
        run("plain", m)
    torch.cuda.empty_cache()
    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB", draft=t8) as m:
        held = m.plan.draft[1]
        run("draft-loaded-unused", m)
        promoted = m.release_draft()
        run("released", m, promoted=promoted)
        run("released-again", m)

if __name__ == "__main__":
    main()
