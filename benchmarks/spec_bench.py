"""Speculative decoding on the GPU, end to end: the issue's H200 cases in one run.

    python bench/spec_bench.py OUTDIR --model SmolLM2-135M-Instruct.Q4_1.gguf \
        [--workdir /tmp/slipstream-models] [--cases default-spec,70b]

default-spec: the default model requantized to Q8_0 as the target, its Q4_0 requantization as
the resident draft, with budgets so small that most target layers are read from disk on every
pass (a pass bound by streaming, as a 70B's is). Greedy decode with and without speculation.

70b (cases 70b-q4k-vram24, 70b-q4k-vram24-spec, 70b-q4k-vram24-skipK): the synthetic 70B
Q4_K at a 24 GiB VRAM budget.
  * plain decode at the whole budget, and the target pass over trees of N = 1..512 nodes;
  * with the synthetic 8B Q4_K draft placed inside the same 24 GiB: the draft's cost per tree
    level by width (CUDA graphs, and eager for comparison), decode with the sizer choosing
    the trees (random weights accept almost nothing: the floor of speculation's overhead),
    with a forced tree every pass, and plain decode with the draft loaded but unused;
  * layer skip: the streamed layers skipped (skip_layers = their count).
Then a projection for a real 70B/8B pair from the measured pass and level costs, with the
acceptance of bench/results' CPU acceptance table and the published 8-13: labelled projected.

lowbit (cases default-spec-lowbit, 70b-q4k-vram24-lowbit): the low-bit self-draft
(`load(draft_lowbit=...)`: the streamed layers requantized at load, resident, the target's KV
cache shared). The default model's Q8_0 streamed as in default-spec with a Q2_K copy; the 70B
at 24 GiB with a Q2_K copy if the plan can hold one (its 80 layers in Q2_K are ~22.5 GB: the
copy may leave the target nothing, and the load then says BudgetTooSmall, which is the row).
Random weights: the 70B's acceptance is the Q2_K copy's agreement with its own Q4_K target,
not a real pair's.

Timings: decode_tok_s from GenerationStats (tokens after the first / decode seconds, host
clock around synchronising work); passes with CUDA events. Writes OUTDIR/spec-bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import slipstream  # noqa: E402
from slipstream.memory.probes import h2d_pinned_gbps  # noqa: E402
from slipstream.model import tree_step  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.quant.requantize import requantize  # noqa: E402
from slipstream.speculative.rounds import CUDA_LEVEL_WIDTH  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402
from spec_costs import PREFIX as PASS_PREFIX, pass_seconds  # noqa: E402  (bench/ is on sys.path)

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The keeper")
PUBLISHED_TOKENS_PER_PASS = (8.0, 13.0)
RESIDENT = 4  # default-spec: the target's layers held in VRAM; the rest stream
AHEAD_BESIDE = 64  # levels the draft may grow past a tree's verified nodes, beside the pass  # UMbreLLa / SpecExec / Sequoia, 70B with an 8B draft


def decode(model, tokens: int, trace: bool = False, **kw) -> dict:
    """Greedy generation of `tokens` tokens; figures of the run. trace: also each token's
    interval (host clock between events; each event reads its token back) and what the
    target's store moved in it (StoreStats' counters, kept whether or not --stats is on)."""
    ids = model.tokenize(PROMPT)
    out, marks = [], []
    store = model.engine.layers if trace else None
    for e in model.generate(ids, max_tokens=tokens, temperature=0, **kw):
        out.append(e.id)
        if trace:
            s = store.stats
            marks.append((time.perf_counter(), s.h2d_bytes, s.cpu_bytes, s.cpu_s,
                          s.layers_streamed, model.draft is None))
    st = model.last_stats
    row = {"decode_tok_s": round(st.decode_tok_s, 3), "generated": st.generated_tokens,
           "prefill_s": round(st.prefill_s, 3), "decode_s": round(st.decode_s, 3)}
    spec = model.last_speculation
    if spec:
        passes = max(spec["target_passes"], 1)
        row.update(tokens_per_pass=round(spec["tokens_per_pass"], 3),
                   target_passes=spec["target_passes"], plain_steps=spec["plain_steps"],
                   accepted_hist=spec["accepted_hist"],
                   tree_nodes_mean=round(spec["tree_nodes_mean"], 1),
                   target_pass_s=round(spec["verify_s"]
                                       / max(spec.get("verify_passes", passes), 1), 4),
                   plain_after_give_up=spec.get("plain_after_give_up", 0),
                   draft_s_per_pass=round(spec["draft_s"] / passes, 4),
                   series_draft_forwards_per_pass=round(spec["draft_forwards"] / passes, 2),
                   ahead_forwards_per_pass=round(spec.get("ahead_forwards", 0) / passes, 2),
                   trees_grown_ahead=spec.get("ahead_trees", 0),
                   ahead_beside_per_pass=round(spec.get("ahead_beside", 0) / passes, 2))
    if trace:
        row["trace"] = step_trace(marks)
    return row | {"ids": out}


def step_trace(marks: list[tuple]) -> dict:
    """Per-token intervals and store traffic from decode(trace=True)'s marks, with a summary
    of the slow ones: where a run's time went, token by token."""
    steps = [{"ms": round((b[0] - a[0]) * 1e3, 1), "h2d_mb": round((b[1] - a[1]) / 1e6, 1),
              "cpu_mb": round((b[2] - a[2]) / 1e6, 1), "cpu_ms": round((b[3] - a[3]) * 1e3, 1),
              "streamed": b[4] - a[4], "draft_gone": b[5]} for a, b in zip(marks, marks[1:])]
    ms = sorted(s["ms"] for s in steps)
    median = ms[len(ms) // 2] if ms else 0.0
    slow = [(i, s["ms"]) for i, s in enumerate(steps) if s["ms"] > 1.5 * median]
    return {"median_ms": median, "total_ms": round(sum(ms), 1),
            "slow_steps": slow[:40], "slow_excess_ms": round(sum(m - median for _, m in slow), 1),
            "steps": steps}


def attempt(run, *args, **kw) -> dict:
    """run(*args, **kw), or the failure as a row (one case's error does not end the bench)."""
    try:
        return run(*args, **kw)
    except Exception as e:  # noqa: BLE001 - recorded in the results, with its type
        torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def pass_costs(engine, widths, reps: int = 3) -> list[dict]:
    """A target pass over a tree of n nodes after a PASS_PREFIX-token prefix (CUDA events;
    spec_costs.pass_seconds)."""
    engine.reset()
    engine.forward(list(range(5, 5 + PASS_PREFIX)))
    rows = []
    for n in widths:
        times = pass_seconds(engine, n, reps)
        rows.append({"nodes": n, "target_pass_s": round(min(times), 4),
                     "target_pass_median_s": round(statistics.median(times), 4)})
    engine.reset()
    return rows


def level_costs(engine, widths, reps: int = 10) -> list[dict]:
    """One draft tree level of n nodes (a chain below a 256-token prefix), through the engine's
    CUDA graphs and eagerly."""
    engine.reset()
    engine.forward(list(range(5, 5 + PASS_PREFIX)))
    rows = []
    for n in widths:
        row = {"nodes": n}
        for mode in ("graph", "eager"):
            saved = engine.use_graphs
            engine.use_graphs = mode == "graph" and saved
            parents = [-1] * n  # siblings: one level
            ids = torch.randint(0, engine.cfg.vocab_size, (n,), device=engine.device)
            times = []
            for r in range(reps + 2):
                step = tree_step(parents, PASS_PREFIX, PASS_PREFIX, engine.device)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = engine.forward(ids, all_logits=True, step=step)
                torch.topk(logits, 8).indices.tolist()  # what growth reads back
                times.append(time.perf_counter() - t0)
                engine.truncate(PASS_PREFIX)
            engine.use_graphs = saved
            row[f"level_{mode}_s"] = round(statistics.median(times[2:]), 5)
        graphs = engine._tree_graphs
        # buckets whose capture ran out of VRAM run eagerly: then "graph" is an eager figure
        row["graph_fell_back_to_eager"] = bool(graphs and any(k[0] >= n for k in graphs.eager))
        rows.append(row)
    engine.reset()
    return rows


def hybrid_of(model) -> dict | None:
    """The plan's hybrid split, where one was made (hybrid decode is on by default)."""
    h = model.plan.hybrid
    if h is None:
        return None
    return {"cpu_share": round(h.cpu_share, 4), "split_layers": len(h.layers),
            "max_tokens": h.max_tokens, "threads": h.threads,
            "cpu_gbps_probe": round(h.cpu_gbps, 1),
            "predicted_tok_s": round(h.predicted_tok_s or 0, 3)}


def vram_gib() -> float:
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)


def default_spec(model_path: Path, work: Path, tokens: int) -> list[dict]:
    target = work / "smollm-q8_0.gguf"
    draft = work / "smollm-q4_0.gguf"
    for dst, q in ((target, "Q8_0"), (draft, "Q4_0")):
        if not dst.exists():
            requantize(model_path, dst, q)
    rows = []
    # RESIDENT of the target's layers in VRAM (load's vram_layers, as llama.cpp's -ngl), 24
    # MiB of pinned RAM, the rest read from disk on every pass; the draft wholly resident
    budgets = dict(vram_layers=RESIDENT, ram_budget="24MiB")

    def open_model():
        return slipstream.load(target, device="cuda", ctx=1024, draft=draft, **budgets)

    m = open_model()
    given_up = []  # variants during which the sizer gave the draft up (session 16's call 2)

    def run(label: str, **kw) -> dict:
        nonlocal m
        if m.draft is None:  # given up in an earlier variant: a fresh load for this one
            m.close()
            m = open_model()
        r = decode(m, tokens, **kw)
        if m.draft is None:
            given_up.append(label)
        return r | {"draft_given_up": m.draft is None}

    try:
        tiers = {k: m.plan.tiers.count(k) for k in set(m.plan.tiers)}
        draft_vram = m.plan.draft[1] if m.plan.draft else None
        # before the runs: a sized run may give the draft up
        levels = level_costs(m.draft.engine, (1, 4, 8, CUDA_LEVEL_WIDTH))  # widths growth runs
        plain = decode(m, tokens, draft=False)
        # traced: a first generation's slow rounds (session 29's H100 took plain steps in 17
        # of 27 rounds of the next generation, presumably after a first-use pass)
        auto = run("auto-first", trace=True)
        auto2 = run("auto")  # the sizer has learned the costs on the first run (same load)
        fixed = run("nodes64-depth8", spec_nodes=64, spec_depth=8)
        # the draft growing the next tree on its own stream while the target's layers stream
        beside = run("auto-beside", spec_ahead=AHEAD_BESIDE)
        fixed_beside = run("nodes64-depth8-beside", spec_nodes=64, spec_depth=8,
                           spec_ahead=AHEAD_BESIDE)
        base = {"name": "default-spec", "target": target.name, "draft": draft.name,
                "vram_layers": RESIDENT, "ram_budget": "24MiB",
                "draft_vram_bytes": draft_vram,
                "tiers": tiers, "plain_decode_tok_s": plain["decode_tok_s"],
                "draft_released": bool(given_up), "draft_given_up_in": given_up,
                "greedy_equal": auto2["ids"] == plain["ids"] == fixed["ids"] == beside["ids"]
                == fixed_beside["ids"],
                "greedy_equal_by_variant": {
                    k: r["ids"] == plain["ids"] for k, r in (
                        ("auto", auto2), ("nodes64-depth8", fixed), ("auto-beside", beside),
                        ("nodes64-depth8-beside", fixed_beside))},
                "draft_levels": levels, "vram_gib": vram_gib()}
    finally:
        m.close()
    # at precision "fast" speculative greedy parts from plain at near-ties (batched and
    # single-token passes round differently): where, how near, and the same at "exact"
    base["exactness"] = attempt(exactness, target, draft, budgets, tokens, plain["ids"],
                                auto2["ids"])
    for label, r in (("auto-first", auto), ("auto", auto2), ("nodes64-depth8", fixed),
                     ("auto-beside", beside), ("nodes64-depth8-beside", fixed_beside)):
        rows.append(base | {"variant": label} | {k: v for k, v in r.items() if k != "ids"})
    return rows


def exactness(target: Path, draft: Path, budgets: dict, tokens: int,
              fast_plain: list[int], fast_spec: list[int]) -> dict:
    """Issue 12's lossless check where the bench can show it: where the fast path's speculative
    greedy output parts from plain's, the index and the plain path's top-2 logit gap there
    (through the decode kernels plain generation takes: a near-tie or not); then plain and
    speculative greedy at precision "exact" on a fresh load, and whether they are equal."""
    out: dict = {}
    first = next((i for i, (a, b) in enumerate(zip(fast_plain, fast_spec)) if a != b), None)
    if first is not None:
        with slipstream.load(target, device="cuda", ctx=1024, **budgets) as m:
            ctx = m.tokenize(PROMPT) + fast_plain[:first]
            top = m.logits(ctx, one_at_a_time=True)[-1].topk(2)
        out["fast_first_divergence"] = {
            "index": first, "plain": fast_plain[first], "speculative": fast_spec[first],
            "plain_top2": top.indices.tolist(),
            "plain_top2_gap": round(float(top.values[0] - top.values[1]), 5)}
    with slipstream.load(target, device="cuda", ctx=1024, draft=draft, precision="exact",
                         **budgets) as m:
        plain = decode(m, tokens, draft=False)
        spec = decode(m, tokens)
    out.update(exact_plain_decode_tok_s=plain["decode_tok_s"],
               exact_decode_tok_s=spec["decode_tok_s"],
               exact_tokens_per_pass=spec.get("tokens_per_pass"),
               greedy_equal_exact=plain["ids"] == spec["ids"])
    return out


LOWBIT_TYPE = "Q2_K"


def lowbit_cases(model_path: Path, work: Path, tokens: int, seventy_b: bool) -> list[dict]:
    """The low-bit self-draft over a streamed target: the default model's Q8_0 (RESIDENT layers
    in VRAM, 24 MiB pinned, the rest from disk) and, with seventy_b, the synthetic 70B at
    24 GiB. Each: plain decode, sized and forced trees, the copy's load time and VRAM, the
    draft's level costs and the target's pass costs."""
    target = work / "smollm-q8_0.gguf"
    if not target.exists():
        requantize(model_path, target, "Q8_0")
    cases = [("default-spec-lowbit", target,
              dict(ctx=1024, vram_layers=RESIDENT, ram_budget="24MiB"), (32, 64))]
    if seventy_b:
        t70 = work / "70b-Q4_K.gguf"
        if not t70.exists():
            write_synth(t70, "70b", "Q4_K")
        cases.append(("70b-q4k-vram24-lowbit", t70, dict(ctx=2048, vram_budget="24GiB"),
                      (64, 256)))
    rows = []
    for name, path, budgets, trees in cases:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with slipstream.load(path, device="cuda", **budgets) as plain_model:
            decode(plain_model, 4, draft=False)
            plain = decode(plain_model, tokens, draft=False)
            plain_streamed = len(plain_model.plan.streamed_layers)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            m = slipstream.load(path, device="cuda", draft_lowbit=LOWBIT_TYPE, **budgets)
        except Exception as e:  # noqa: BLE001 - a copy the budget cannot hold is the finding
            rows.append({"name": name, "draft": f"lowbit {LOWBIT_TYPE}",
                         "plain_decode_tok_s": plain["decode_tok_s"],
                         "plain_streamed_layers": plain_streamed,
                         "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        with m:
            load_s = time.perf_counter() - t0
            base = {"name": name, "draft": f"lowbit {LOWBIT_TYPE}", "load_s": round(load_s, 1),
                    "plan_draft": list(m.plan.draft) if m.plan.draft else None,
                    "streamed_layers": len(m.plan.streamed_layers),
                    "plain_streamed_layers": plain_streamed,
                    "plain_decode_tok_s": plain["decode_tok_s"],
                    "levels": level_costs(m.draft.engine, (1, 4, 8, CUDA_LEVEL_WIDTH)),
                    "passes": pass_costs(m.engine, (1, 64, 256))}
            same_plan = decode(m, tokens, draft=False)
            base["plain_same_plan_tok_s"] = same_plan["decode_tok_s"]
            runs = [(f"forced-{n}x8", attempt(decode, m, tokens, spec_nodes=n, spec_depth=8))
                    for n in trees]
            runs.append(("auto", attempt(decode, m, tokens)))
            base["vram_gib"] = vram_gib()
            for label, r in runs:
                equal = r.get("ids") == plain["ids"] if "ids" in r else None
                rows.append(base | {"variant": label, "greedy_equal": equal}
                            | {k: v for k, v in r.items() if k != "ids"}
                            | ({"ratio_to_plain": round(r["decode_tok_s"]
                                                        / plain["decode_tok_s"], 3)}
                               if "decode_tok_s" in r else {}))
    return rows


def seventy(work: Path, tokens: int, acceptance: list[dict], skip_case: bool = True,
            pass_widths=(1, 8, 64, 256, 512), level_widths=(1, 2, 4, 8, 16, 32, 64, 128),
            vram_layers: int | None = None, fresh_sizer: bool = False,
            bracket: bool = False) -> list[dict]:
    """bracket: the issue's floor in the same run. The sized run starts from a fresh sizer,
    and a third load without the draft decodes plain after it, so that the speculative figure
    stands between plain runs on both sides (floor()'s bracket, without its extra loads); the
    layer-skip case then runs on that third load, with exactly the streamed layers skipped."""
    fresh_sizer = fresh_sizer or bracket
    t70, t8 = work / "70b-Q4_K.gguf", work / "8b-Q4_K.gguf"
    for path, shape in ((t70, "70b"), (t8, "8b")):
        if not path.exists():
            write_synth(path, shape, "Q4_K")
    h2d = h2d_pinned_gbps(2 << 30)
    rows = []
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB",
                         vram_layers=vram_layers) as m:
        streamed = len(m.plan.streamed_layers)
        plain_layout = list(m.plan.streamed_layers)
        moved = m.plan.bytes_per_token("pinned")
        # warmed first: a first generation compiles the decode kernels inside its timing
        # (session 16: 3.695 tok/s cold here against hybrid_bench's warmed 4.664, same plan)
        decode(m, 4, draft=False)
        first = decode(m, tokens, draft=False)  # as long as the speculative runs below
        passes = pass_costs(m.engine, pass_widths)
        # twice, around the pass costs: runs of hybrid decode spread by 7-20% (session 16);
        # the floor is judged against their mean
        second = decode(m, tokens, draft=False)
        plain_runs = [first["decode_tok_s"], second["decode_tok_s"]]
        plain = {"decode_tok_s": round(statistics.mean(plain_runs), 3)}
        rows.append({"name": "70b-q4k-vram24", "decode_tok_s": plain["decode_tok_s"],
                     "decode_tok_s_runs": plain_runs,
                     "streamed_layers": streamed, "h2d_bytes_per_token": moved,
                     "h2d_gbps": round(h2d, 1),
                     "roofline_tok_s": round(h2d * 1e9 / moved, 3) if moved else None,
                     "passes": passes, "hybrid": hybrid_of(m), "vram_gib": vram_gib()})
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB",
                         vram_layers=vram_layers, draft=t8) as m:
        levels = level_costs(m.draft.engine, level_widths)
        same_split = decode(m, 8, draft=False)
        spec_passes = pass_costs(m.engine, (1, 256))
        draft_vram = m.plan.draft[1] if m.plan.draft else None
        split_with_draft = hybrid_of(m)
        streamed_with_draft = len(m.plan.streamed_layers)
        # forced first: the sized run may give the draft up (random weights accept nothing)
        # (16 tokens at most: a forced 256-node pass costs about a second here)
        forced_tokens = min(max(tokens // 3, 8), 16)
        forced = attempt(decode, m, forced_tokens, spec_nodes=256, spec_depth=8)
        # the same trees with the draft growing beside the pass: does the pass slow down?
        forced_beside = attempt(decode, m, forced_tokens, spec_nodes=256, spec_depth=8,
                                spec_ahead=AHEAD_BESIDE)
        if fresh_sizer:  # the sized run as a first generation: its learning rounds count
            m._sizers.clear()
        # traced (per-token intervals and store traffic): where a floor under 0.9x loses
        # its time (session 28: four learning passes averaged 0.85 s against a 0.45 s step)
        auto = attempt(decode, m, tokens, trace=fresh_sizer)
        released = m.draft_released
        after = decode(m, tokens, draft=False)  # plain, with the layers the draft's VRAM took
        store = m.engine.layers
        # what plain decode runs on after the release (session 12: 7% under plain without a
        # draft, with one streamed layer more): resident layers, split layers, how long the
        # release took
        after_release = {"resident_layers": sum(x is not None for x in store.layers),
                         "split_layers": len(getattr(store, "hosts", {}) or {}),
                         "release_s": round(m.draft_release_s or 0, 3),
                         # since session 13 the plan beside the draft streams plain's layers
                         # first and the release promotes the others: plain's layout again
                         "same_layout_as_plain": m.plan.streamed_layers == plain_layout,
                         "vram_gib_after": round(torch.cuda.memory_reserved() / 2**30, 2)
                         } if released else None
        # a reference held past the load keeps its resident layers in VRAM: session 23's
        # third load (bracket) measured 44.6 GiB reserved with this one's on top
        del store
        row = {"name": "70b-q4k-vram24-spec", "draft": t8.name,
               "draft_vram_bytes": draft_vram, "streamed_layers": streamed_with_draft,
               "plain_decode_tok_s": rows[0]["decode_tok_s"],
               "plain_same_split_tok_s": same_split["decode_tok_s"],
               "draft_released": released is not None,
               "layers_made_resident": len(released[1]) if released else 0,
               "plain_after_release_tok_s": after["decode_tok_s"] if released else None,
               "after_release": after_release,
               "levels": levels, "passes": spec_passes, "hybrid": split_with_draft,
               "vram_gib": vram_gib()}
        for label, r in (("auto-fresh-sizer" if fresh_sizer else "auto", auto),
                         ("forced-256x8", forced),
                         ("forced-256x8-beside", forced_beside)):
            rows.append(row | {"variant": label} | {k: v for k, v in r.items() if k != "ids"}
                        | ({"ratio_to_plain": round(r["decode_tok_s"]
                                                    / rows[0]["decode_tok_s"], 3)}
                           if "decode_tok_s" in r else {}))
    if bracket:
        rows.extend(_bracket_load(t70, rows, tokens, vram_layers))
        return _with_projection(rows, acceptance)
    if not skip_case:
        return _with_projection(rows, acceptance)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB",
                         vram_layers=vram_layers,
                         skip_layers=streamed) as m:
        r = decode(m, 16, draft=False)
        rows.append({"name": f"70b-q4k-vram24-skip{streamed}", "skip_layers": streamed,
                     "skipped_streamed": len(set(m.skipped_layers)
                                             & set(m.plan.streamed_layers)),
                     "decode_tok_s": r["decode_tok_s"], "vram_gib": vram_gib(),
                     "note": "lossy: random weights say nothing of quality; the default "
                             "model's perplexity by K is in bench/results"})
        # exactly the streamed layers, whatever calibration says: nothing crosses PCIe
        m.engine.skip = frozenset(m.plan.streamed_layers)
        r = decode(m, 16, draft=False)
        rows.append({"name": "70b-q4k-vram24-skip-streamed", "skip_layers": streamed,
                     "skipped_streamed": streamed, "decode_tok_s": r["decode_tok_s"],
                     "vram_gib": vram_gib(), "note": "lossy, as above"})
    return _with_projection(rows, acceptance)


def _bracket_load(t70: Path, rows: list[dict], tokens: int, vram_layers: int | None
                  ) -> list[dict]:
    """seventy(bracket=True)'s third load: plain decode after the speculative load, the floor
    row judged against the plain runs on both sides, then the streamed layers skipped."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB",
                         vram_layers=vram_layers) as m:
        decode(m, 4, draft=False)
        after = decode(m, tokens, draft=False)
        streamed = list(m.plan.streamed_layers)
        m.engine.skip = frozenset(streamed)  # nothing crosses PCIe
        skipped = decode(m, 16, draft=False)
        skip_row = {"name": "70b-q4k-vram24-skip-streamed", "skip_layers": len(streamed),
                    "skipped_streamed": len(streamed), "decode_tok_s": skipped["decode_tok_s"],
                    "vram_gib": vram_gib(), "note": "lossy: random weights say nothing of "
                    "quality; the default model's perplexity by K is in bench/results"}
    plain, spec = rows[0], next(r for r in rows if r.get("variant") == "auto-fresh-sizer")
    sides = [plain["decode_tok_s"], after["decode_tok_s"]]
    bracket = statistics.mean(sides)
    row = {"name": "70b-q4k-vram24-spec", "variant": "floor-bracketed", "tokens": tokens,
           "decode_tok_s": spec.get("decode_tok_s"), "plain_decode_tok_s": round(bracket, 3),
           "plain_decode_tok_s_sides": sides,
           "plain_after_release_tok_s": spec.get("plain_after_release_tok_s"),
           "tokens_per_pass": spec.get("tokens_per_pass"),
           "target_pass_s": spec.get("target_pass_s"),
           "note": "before: the mean of the first load's two plain runs (around the pass "
                   "costs); after: a third load without the draft, after the speculative one"}
    if spec.get("decode_tok_s"):
        row["ratio_to_plain"] = round(spec["decode_tok_s"] / bracket, 3)
    return [row, skip_row]


def floor(work: Path, tokens: int, vram_layers: int | None = None) -> list[dict]:
    """Speculation's floor at acceptance ~1 (random weights), bracketed by plain decode.

    Plain decode figures rose through a call in session 18 (3.19, then 3.60, then 4.44 at the
    end), by more than the gap the floor is judged on, so one plain figure taken before or
    after says little. Here: plain on a load without the draft, then the speculative run from a
    fresh sizer on a load with it (its learning trees, the give-up and the release included),
    plain on that load after the release (the same layout as without the draft), and plain on a
    new load without the draft: the speculative figure against the plain runs on both sides."""
    t70, t8 = work / "70b-Q4_K.gguf", work / "8b-Q4_K.gguf"
    for path, shape in ((t70, "70b"), (t8, "8b")):
        if not path.exists():
            write_synth(path, shape, "Q4_K")
    kw = dict(device="cuda", ctx=2048, vram_budget="24GiB", vram_layers=vram_layers)

    def plain_load(label: str) -> dict:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with slipstream.load(t70, **kw) as m:
            decode(m, 4, draft=False)  # kernels compiled outside the timing
            r = decode(m, tokens, draft=False)
            return shown({"run": label, "decode_tok_s": r["decode_tok_s"],
                          "streamed_layers": len(m.plan.streamed_layers),
                          "hybrid": hybrid_of(m), "vram_gib": vram_gib(), "ids": r["ids"]})

    def shown(run: dict) -> dict:  # each run as it ends: a call cut short keeps what ran
        print(json.dumps({k: v for k, v in run.items() if k != "ids"}), flush=True)
        return run

    runs = [plain_load("plain, before")]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, draft=t8, **kw) as m:
        decode(m, 4, draft=False)
        streamed_with_draft = len(m.plan.streamed_layers)
        hybrid_with_draft = hybrid_of(m)
        spec = attempt(decode, m, tokens)
        released = m.draft_released
        runs.append(shown({"run": "speculative, fresh sizer",
                           "streamed_layers": streamed_with_draft,
                           "hybrid": hybrid_with_draft,
                           "vram_gib": vram_gib(),
                           "draft_released": released is not None,
                           "release_s": round(m.draft_release_s or 0, 3)} | spec))
        after = decode(m, tokens, draft=False)
        runs.append(shown({"run": "plain, same load after the release",
                           "decode_tok_s": after["decode_tok_s"],
                           "streamed_layers": len(m.plan.streamed_layers),
                           # the split planned with the draft resident stays after the release
                           # (session 20: this run 6.6% under the no-draft loads' mean)
                           "hybrid": hybrid_of(m),
                           "vram_gib": vram_gib(), "ids": after["ids"]}))
    runs.append(plain_load("plain, after"))
    spec_row = runs[1]
    plain_sides = [runs[0]["decode_tok_s"], runs[3]["decode_tok_s"]]
    bracket = statistics.mean(plain_sides)
    # at precision "fast": random weights' logits sit at near-ties (a top-2 margin of 1e-3 on
    # the tiny shape), where batched and single-token passes may part; a flag, not a check
    greedy_equal = all(r.get("ids") == runs[0]["ids"] for r in runs)
    for r in runs:
        r.pop("ids", None)
    row = {"name": "70b-q4k-vram24-spec", "variant": "floor-bracketed", "draft": t8.name,
           "tokens": tokens, "decode_tok_s": spec_row.get("decode_tok_s"),
           "plain_decode_tok_s": round(bracket, 3), "plain_decode_tok_s_sides": plain_sides,
           "plain_after_release_tok_s": runs[2]["decode_tok_s"],
           "tokens_per_pass": spec_row.get("tokens_per_pass"),
           "target_pass_s": spec_row.get("target_pass_s"),
           "greedy_equal": greedy_equal, "runs": runs}
    if spec_row.get("decode_tok_s"):
        row["ratio_to_plain"] = round(spec_row["decode_tok_s"] / bracket, 3)
        row["ratio_to_plain_after_release"] = round(
            spec_row["decode_tok_s"] / runs[2]["decode_tok_s"], 3)
    return [row]


def floor_trace(work: Path, tokens: int) -> list[dict]:
    """Where the floor's time goes (session 21: a speculative run 6.6 s slower than its parts):
    two loads with the draft, each a speculative run from a fresh sizer and then plain decode
    on the same load, traced token by token (decode(trace=True)). The first load warms plain
    decode only, as floor() does; the second also runs forced 256-node trees first, so that
    the kernels of tree-wide passes and draft levels are compiled before the traced run."""
    t70, t8 = work / "70b-Q4_K.gguf", work / "8b-Q4_K.gguf"
    for path, shape in ((t70, "70b"), (t8, "8b")):
        if not path.exists():
            write_synth(path, shape, "Q4_K")
    rows = []
    for label in ("plain-warmed", "trees-warmed"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with slipstream.load(t70, device="cuda", ctx=2048, vram_budget="24GiB",
                             draft=t8) as m:
            decode(m, 4, draft=False)
            if label == "trees-warmed":
                attempt(decode, m, 8, spec_nodes=256, spec_depth=8)
                m._sizers.clear()
            spec = attempt(decode, m, tokens, trace=True)
            release_s = round(m.draft_release_s or 0, 3)
            after = decode(m, tokens, trace=True, draft=False)
            after.pop("ids")
            spec.pop("ids", None)
            row = {"name": "70b-q4k-vram24-spec", "variant": f"floor-trace-{label}",
                   "tokens": tokens, "release_s": release_s, "speculative": spec,
                   "plain_after_release": after, "vram_gib": vram_gib()}
            print(json.dumps({k: v for k, v in row.items() if k not in ("speculative",
                                                                         "plain_after_release")}
                             | {"spec_tok_s": spec.get("decode_tok_s"),
                                "spec_median_ms": spec.get("trace", {}).get("median_ms"),
                                "spec_slow": spec.get("trace", {}).get("slow_steps"),
                                "after_tok_s": after["decode_tok_s"],
                                "after_median_ms": after["trace"]["median_ms"],
                                "after_slow": after["trace"]["slow_steps"]}), flush=True)
            rows.append(row)
    return rows


def _with_projection(rows: list[dict], acceptance: list[dict]) -> list[dict]:
    """The measured rows, with the projection row after them; a projection that cannot be made
    from them leaves its reason, never the measured rows lost."""
    try:
        return rows + [projection(rows, acceptance)]
    except (KeyError, StopIteration, TypeError) as exc:
        return rows + [{"name": "70b-8b-projection", "projected": True,
                        "error": f"{type(exc).__name__}: {exc}"}]


def acceptance_rows() -> list[dict]:
    """Every CPU acceptance table's rows (bench/results/*spec-acceptance*cpu.json), each with
    its file's name and its trees' depth: the projection takes the best of any of them."""
    rows = []
    for path in sorted(ROOT.glob("bench/results/*spec-acceptance*cpu.json")):
        doc = json.loads(path.read_text())
        depth = doc.get("settings", {}).get("spec_depth")
        rows += [{"table": path.name, **r, "depth": r.get("depth") or depth}
                 for r in doc.get("rows", [])]
    return rows


def projection(rows: list[dict], acceptance: list[dict]) -> dict:
    """tok/s = tokens per pass / (target pass + depth x draft level), from measured costs: the
    published figures at 16 levels, an acceptance-table row at its own trees' depth."""
    plain = next(r for r in rows if r["name"] == "70b-q4k-vram24")
    spec = next(r for r in rows if r["name"] == "70b-q4k-vram24-spec")
    pass_s = {p["nodes"]: p["target_pass_s"] for p in spec["passes"]}[256]
    levels = {lv["nodes"]: lv["level_graph_s"] for lv in spec["levels"]}
    # session 26 lost a whole 70B run to a KeyError here (--quick measured no 32-node level):
    # the nearest width measured stands in, and the row says which
    level_width = min(levels, key=lambda w: abs(w - CUDA_LEVEL_WIDTH))
    level = levels[level_width]
    depth = 16
    cases = {f"published {t:g}": (t, depth) for t in PUBLISHED_TOKENS_PER_PASS}
    used = []
    for temp in (0, 0.8):
        # the row projecting the most tok/s: a deeper tree accepts more and costs more levels
        best = max((a for a in acceptance if a.get("temperature") == temp
                    and a.get("nodes") == 256),
                   key=lambda a: a["tokens_per_pass"] / (pass_s + int(a.get("depth") or depth)
                                                         * level), default=None)
        if best:
            d = int(best.get("depth") or depth)
            cases[f"best CPU acceptance-table row (135M pair, draft {best['draft']}, 256 "
                  f"nodes, depth {d}, T={temp:g})"] = (best["tokens_per_pass"], d)
            used.append({k: best.get(k) for k in ("table", "target", "draft", "nodes", "depth",
                                                  "temperature", "tokens_per_pass")})
    # with the next tree grown beside the pass, a round costs the pass alone, as measured
    # with the draft growing beside it (if that run went through)
    beside = next((r for r in rows if r.get("variant") == "forced-256x8-beside"
                   and "target_pass_s" in r), None)
    hidden = {k: round(t / beside["target_pass_s"], 2) for k, (t, _) in cases.items()} \
        if beside else None
    return {"name": "70b-8b-projection", "projected": True,
            "tok_s_draft_beside": hidden,
            "beside_pass_s": beside["target_pass_s"] if beside else None,
            "measured_inputs": {"target_pass_256_s": pass_s,
                                f"draft_level_{level_width}_s": level,
                                "depth": depth},
            "acceptance_rows_used": used,
            "note": "projected, not measured: tokens per pass over the measured cost of one "
                    "round (a 256-node target pass with the draft inside the 24 GiB, and "
                    f"as many draft levels of {level_width} nodes through CUDA graphs as the "
                    f"trees are deep: {depth} for the published figures)",
            "tok_s": {k: round(t / (pass_s + d * level), 2) for k, (t, d) in cases.items()},
            "plain_decode_tok_s": plain["decode_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--model", required=True, help="the default model (Q4_1)")
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--cases", default="default-spec,70b", help="comma-separated: "
                    "default-spec, 70b, lowbit (the default model's low-bit self-draft), "
                    "70b-lowbit (that and the 70B's)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--levels-from", default=None, metavar="JSON",
                    help="with --project-from: the draft's level costs from a draft_levels.py "
                         "file (a later kernel's) instead of the spec-bench file's")
    ap.add_argument("--project-from", default=None, metavar="JSON",
                    help="only recompute the projection from a spec-bench.json")
    ap.add_argument("--quick", action="store_true", help="70B: fewer pass and level widths")
    ap.add_argument("--no-skip-case", action="store_true", help="leave out the 70B layer-skip "
                    "case (about 40 s)")
    ap.add_argument("--floor", action="store_true", help="70B: only the floor, bracketed by "
                    "plain runs on both sides (three loads)")
    ap.add_argument("--floor-trace", action="store_true", help="70B: the floor's speculative "
                    "run and plain after it, token by token, on two loads (floor_trace)")
    ap.add_argument("--bracket", action="store_true", help="70B: the floor bracketed in the "
                    "same run: a fresh sizer for the sized run, then a third load decoding "
                    "plain (and the streamed layers skipped there, for the skip case)")
    ap.add_argument("--fresh-sizer", action="store_true", help="70B: the sized run starts "
                    "from a new tree sizer (a first generation, its learning rounds and the "
                    "draft's release included) instead of the one the forced runs taught")
    a = ap.parse_args()
    out, work = Path(a.outdir), Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    rev = source_revision()
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "commit": rev["commit"], "tree": rev["tree"],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "cases": []}
    acceptance = acceptance_rows()

    def save(rows: list[dict]) -> None:
        for r in rows:
            print(json.dumps(r), flush=True)
        doc["cases"].extend(rows)
        (out / "spec-bench.json").write_text(json.dumps(doc, indent=2) + "\n")

    if a.project_from:  # recompute the projection from a results file, on any machine
        measured = json.loads(Path(a.project_from).read_text())
        extra = {}
        if a.levels_from:
            levels = json.loads(Path(a.levels_from).read_text())
            spec = next(r for r in measured["cases"] if r["name"] == "70b-q4k-vram24-spec")
            spec["levels"] = levels["levels"]
            extra = {"levels_from": Path(a.levels_from).name,
                     "levels_from_tree": levels.get("tree")}
        row = projection(measured["cases"], acceptance) | {
            "from": Path(a.project_from).name, "from_tree": measured.get("tree")} | extra
        doc["cases"] = [row]
        (out / "spec-projection.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(row, indent=2))
        return
    cases = a.cases.split(",")
    if "default-spec" in cases:
        save(default_spec(Path(a.model), work, a.tokens))
        torch.cuda.empty_cache()
    if "lowbit" in cases or "70b-lowbit" in cases:
        save(lowbit_cases(Path(a.model), work, a.tokens, "70b-lowbit" in cases))
        torch.cuda.empty_cache()
    if "70b" in cases and a.floor_trace:
        save(floor_trace(work, a.tokens))
    elif "70b" in cases and a.floor:
        save(floor(work, a.tokens))
    elif "70b" in cases:
        quick = dict(pass_widths=(1, 256, 512),
                     level_widths=(1, 4, CUDA_LEVEL_WIDTH)) if a.quick else {}
        try:
            save(seventy(work, a.tokens, acceptance, skip_case=not a.no_skip_case,
                         fresh_sizer=a.fresh_sizer, bracket=a.bracket, **quick))
        except torch.OutOfMemoryError as e:
            # once more with the 42 layers in VRAM that ran before the plans' layers took
            # one buffer each (bench/results/2026-12-01-h200-session9.md)
            print(f"70b: {e}", flush=True)
            doc["oom_retry"] = str(e)[:400]
            torch.cuda.empty_cache()
            save(seventy(work, a.tokens, acceptance, skip_case=not a.no_skip_case,
                         vram_layers=42, fresh_sizer=a.fresh_sizer, bracket=a.bracket,
                         **quick))
    print(f"\n{'case':28} {'variant':16} {'tok/s':>8} {'plain':>8} {'tok/pass':>9} "
          f"{'pass s':>8} {'draft s':>8}")
    for c in doc["cases"]:
        print(f"{c['name']:28} {c.get('variant', ''):16} {c.get('decode_tok_s', 0) or 0:8.2f} "
              f"{c.get('plain_decode_tok_s', 0) or 0:8.2f} {c.get('tokens_per_pass', 0) or 0:9.2f} "
              f"{c.get('target_pass_s', 0) or 0:8.3f} {c.get('draft_s_per_pass', 0) or 0:8.3f}")


if __name__ == "__main__":
    main()
