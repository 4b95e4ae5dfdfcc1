"""Where a load's time goes: slipstream.load under cProfile (the main thread; the packing
pool's workers show up as the main thread's waits on their futures), the top functions by
cumulative and by own time, and the load's wall time.

    python bench/load_profile.py OUTDIR MODEL.gguf [--vram-budget 24GiB] [--hybrid auto]

Session 22: the 70B at 24 GiB loaded in 23 s with hybrid off and 81-114 s with it on, which
is what keeps issue 12's bracketed floor (four 70B loads) and its other cases out of one call.
Writes OUTDIR/load-profile-<hybrid>.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import slipstream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("model")
    ap.add_argument("--vram-budget", default="24GiB")
    ap.add_argument("--hybrid", default="auto")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    m = slipstream.load(a.model, device="cuda", ctx=2048, vram_budget=a.vram_budget,
                        hybrid=a.hybrid)
    prof.disable()
    wall = time.perf_counter() - t0
    h = m.plan.hybrid
    m.close()
    text = io.StringIO()
    print(f"load {Path(a.model).name} vram {a.vram_budget} hybrid {a.hybrid}: {wall:.1f} s; "
          f"split layers {len(h.layers) if h else 0}", file=text)
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(a.top)
    out = a.outdir / f"load-profile-{a.hybrid}.txt"
    out.write_text(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
