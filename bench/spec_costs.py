"""What speculation has to work with on a GPU: the cost of one target pass over a tree of N
drafted tokens (a streamed 70B costs about the same for 1 token as for hundreds), and the cost
of one level of tree growth on a resident draft, by the level's width.

    python bench/spec_costs.py OUTDIR [--workdir /tmp/slipstream-models]

Target: the synthetic 70B Q4_K at a 24 GiB VRAM budget (41 of 80 layers streamed from pinned
RAM). Draft: the synthetic 8B Q4_K, resident. Each pass runs `Engine.forward` with a tree step
(model.step.tree_step: depth positions, node slots, ancestor mask) after a 256-token prefix,
then truncates the cache back to the prefix; times are CUDA events around the pass, the best
and the median of `reps`. Writes OUTDIR/spec-costs.json in the GPU results shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import slipstream  # noqa: E402
from slipstream.memory.probes import h2d_pinned_gbps  # noqa: E402
from slipstream.model import tree_step  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402

PREFIX = 256


def tree_parents(n: int, arity: int = 4) -> list[int]:
    """A full `arity`-ary tree of n nodes in level order (parent -1: a child of the prefix)."""
    return [t // arity - 1 for t in range(n)]


def pass_seconds(engine, n: int, reps: int) -> list[float]:
    ids = torch.randint(0, engine.cfg.vocab_size, (n,), device=engine.device)
    parents = tree_parents(n)
    times = []
    for r in range(reps + 1):  # the first run warms up (kernels, workspaces)
        step = tree_step(parents, PREFIX, PREFIX, engine.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        engine.forward(ids, all_logits=True, step=step)
        end.record()
        end.synchronize()
        engine.truncate(PREFIX)
        if r:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def model(work: Path, shape: str, **kw):
    path = work / f"{shape}-Q4_K.gguf"
    if not path.exists():
        write_synth(path, shape, "Q4_K")
    m = slipstream.load(path, device="cuda", ctx=PREFIX + 640, **kw)
    m.engine.reset()
    m.engine.forward(list(range(5, 5 + PREFIX)))
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    a = ap.parse_args()
    out, work = Path(a.outdir), Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    rev = source_revision()
    h2d = h2d_pinned_gbps(2 << 30)
    doc = {"device": torch.cuda.get_device_name(), "commit": rev["commit"], "tree": rev["tree"],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "h2d_gbps": round(h2d, 1), "prefix_tokens": PREFIX, "cases": []}

    def record(case: dict) -> None:
        doc["cases"].append(case)
        print(json.dumps(case), flush=True)
        (out / "spec-costs.json").write_text(json.dumps(doc, indent=2) + "\n")

    target = model(work, "70b", vram_budget="24GiB")
    streamed = target.plan.bytes_per_token("pinned")
    for n in (1, 8, 64, 256, 512):
        t = pass_seconds(target.engine, n, reps=3)
        record({"name": "70b-q4k-vram24-pass", "nodes": n, "target_pass_s": round(min(t), 4),
                "target_pass_median_s": round(statistics.median(t), 4),
                "tiers": {k: target.plan.tiers.count(k) for k in set(target.plan.tiers)},
                "h2d_bytes_per_pass": streamed,
                "h2d_roofline_s": round(streamed / (h2d * 1e9), 4)})
    target.close()
    del target
    torch.cuda.empty_cache()
    draft = model(work, "8b")
    for n in (1, 4, 8, 16, 32, 64, 128):
        t = pass_seconds(draft.engine, n, reps=5)
        record({"name": "8b-q4k-draft-level", "nodes": n, "level_s": round(min(t), 5),
                "level_median_s": round(statistics.median(t), 5)})
    tok = torch.tensor([7], device="cuda")
    draft.engine.decode(tok)  # captures the decode graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(32):
        draft.engine.decode(tok)
    torch.cuda.synchronize()
    record({"name": "8b-q4k-draft-graph-decode", "nodes": 1,
            "level_s": round((time.perf_counter() - t0) / 32, 5)})
    print(f"\n{'case':28} {'nodes':>6} {'seconds':>10}")
    for c in doc["cases"]:
        s = c.get("target_pass_s", c.get("level_s"))
        print(f"{c['name']:28} {c['nodes']:6} {s:10.4f}")


if __name__ == "__main__":
    main()
