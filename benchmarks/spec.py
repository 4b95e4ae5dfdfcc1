"""Speculative decoding on the GPU, end to end.

    python benchmarks/spec.py [--case default-spec,70b-q4k-vram24-spec] [--tokens 64]
        [--model GGUF] [--llamacpp BUILD] [--results DIR] [--workdir DIR]

default-spec: the default model requantized to Q8_0 as the target, its Q4_0 requantization as
the resident draft, with budgets so small that most target layers are read from disk on every
pass (4 layers in VRAM, 24 MiB of pinned RAM: a pass bound by streaming, as a 70B's is). Greedy
decode without the draft, then with it: the sizer's trees (a first generation, traced token by
token, then a second on the same load), 64-node trees 8 deep, and both with the draft growing
the next tree beside the pass; where speculative greedy output parts from plain's at precision
"fast", the top-2 gap there, and plain against speculative at precision "exact".

70b-q4k-vram24-spec: the synthetic 70B Q4_K at a 24 GiB VRAM budget.
  * plain decode at the whole budget (twice, around the target pass over trees of N = 1..512
    nodes: a streamed 70B pass costs about the same for 1 token as for hundreds);
  * with the synthetic 8B Q4_K draft inside the same 24 GiB: the draft's cost per tree level
    by width (CUDA graphs, and eager), plain decode on that split, forced 256-node trees (with
    and without growth beside the pass), and the sizer from scratch, which on random weights
    (nothing accepted) must give the draft up: speculation's floor against plain decode;
  * with --bracket (the default) a third load decodes plain after it, so the floor stands
    between plain runs on both sides, and then skips the streamed layers (lossy).
--llamacpp BUILD: llama-bench -ngl 46 on the same 70B file in the same run.

decode_tok_s comes from generation's own figures (tokens after the first over decode seconds);
passes and levels from CUDA events. Prints a table; writes RESULTS/DATE-<case>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import common
import slipstream
from slipstream.memory.probes import h2d_pinned_gbps
from slipstream.model import tree_step
from slipstream.quant.requantize import requantize
from slipstream.speculative.rounds import CUDA_LEVEL_WIDTH

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The keeper")
RESIDENT = 4  # default-spec: the target's layers held in VRAM; the rest stream
AHEAD_BESIDE = 64  # levels the draft may grow past a tree's verified nodes, beside the pass
PASS_PREFIX = 256  # tokens before a timed target pass


def decode(model, tokens: int, trace: bool = False, **kw) -> dict:
    """Greedy generation of `tokens` tokens; figures of the run. trace: also each token's
    interval (host clock between events; each event reads its token back) and what the
    target's store moved in it (StoreStats' counters, kept whether or not --stats is on)."""
    ids = model.tokenize(PROMPT)
    out, marks = [], []
    store = model.engine.layers if trace else None
    gen = model.generate(ids, max_tokens=tokens, temperature=0, **kw)
    for e in gen:
        out.append(e.id)
        if trace:
            s = store.stats
            marks.append((time.perf_counter(), s.h2d_bytes, s.cpu_bytes, s.cpu_s,
                          s.layers_streamed, model.draft is None))
    st = gen.stats
    row = {"decode_tok_s": round(st.decode_tok_s, 3), "generated": st.generated_tokens,
           "prefill_s": round(st.prefill_s, 3), "decode_s": round(st.decode_s, 3)}
    spec = st.speculation
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


def pass_seconds(engine, n: int, reps: int) -> list[float]:
    """A target pass over a full 4-ary tree of n nodes after PASS_PREFIX tokens (CUDA events),
    the cache truncated back to the prefix after each; the first run warms up."""
    ids = torch.randint(0, engine.cfg.vocab_size, (n,), device=engine.device)
    parents = [t // 4 - 1 for t in range(n)]  # level order; -1: a child of the prefix
    times = []
    for r in range(reps + 1):
        step = tree_step(parents, PASS_PREFIX, PASS_PREFIX, engine.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        engine.forward(ids, all_logits=True, step=step)
        end.record()
        end.synchronize()
        engine.truncate(PASS_PREFIX)
        if r:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def pass_costs(engine, widths, reps: int = 3) -> list[dict]:
    """pass_seconds at each width: the best and the median."""
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
        graphs = engine.tree_graphs
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
    given_up = []  # variants during which the sizer gave the draft up

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
        # traced: a first generation's slow rounds (an H100 once took plain steps in 17 of 27
        # rounds of the next generation)
        auto = run("auto-first", trace=True)
        auto2 = run("auto")  # the sizer has learned the costs on the first run (same load)
        fixed = run("tree64x8", spec_nodes=64, spec_depth=8)
        # the draft growing the next tree on its own stream while the target's layers stream
        beside = run("auto-beside", spec_ahead=AHEAD_BESIDE)
        fixed_beside = run("tree64x8-beside", spec_nodes=64, spec_depth=8,
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
                        ("auto", auto2), ("tree64x8", fixed), ("auto-beside", beside),
                        ("tree64x8-beside", fixed_beside))},
                "draft_levels": levels, "vram_gib": vram_gib()}
    finally:
        m.close()
    # at precision "fast" speculative greedy parts from plain at near-ties (batched and
    # single-token passes round differently): where, how near, and the same at "exact"
    base["exactness"] = attempt(exactness, target, draft, budgets, tokens, plain["ids"],
                                auto2["ids"])
    for label, r in (("auto-first", auto), ("auto", auto2), ("tree64x8", fixed),
                     ("auto-beside", beside), ("tree64x8-beside", fixed_beside)):
        rows.append(base | {"variant": label} | {k: v for k, v in r.items() if k != "ids"})
    return rows


def exactness(target: Path, draft: Path, budgets: dict, tokens: int,
              fast_plain: list[int], fast_spec: list[int]) -> dict:
    """The lossless check where a benchmark can show it: where the fast path's speculative
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


def seventy(work: Path, tokens: int, skip_case: bool = True,
            pass_widths=(1, 8, 64, 256, 512), level_widths=(1, 2, 4, 8, 16, 32, 64, 128),
            vram_layers: int | None = None, fresh_sizer: bool = False,
            bracket: bool = False) -> list[dict]:
    """bracket: speculation's floor in the same run. The sized run starts from a fresh sizer,
    and a third load without the draft decodes plain after it, so that the speculative figure
    stands between plain runs on both sides (floor()'s bracket, without its extra loads); the
    layer-skip case then runs on that third load, with exactly the streamed layers skipped."""
    fresh_sizer = fresh_sizer or bracket
    t70, t8 = work / "70b-Q4_K.gguf", work / "8b-Q4_K.gguf"
    for path, shape in ((t70, "70b"), (t8, "8b")):
        if not path.exists():
            common.synth_model(shape, "Q4_K", work)
    h2d = h2d_pinned_gbps(2 << 30)
    rows = []
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, placement=slipstream.Placement(
                             vram_budget="24GiB", vram_layers=vram_layers)) as m:
        streamed = len(m.plan.streamed_layers)
        plain_layout = list(m.plan.streamed_layers)
        moved = m.plan.bytes_per_token("pinned")
        # warmed first: a first generation compiles the decode kernels inside its timing
        # (3.695 tok/s cold against 4.664 warmed on one H200, the same plan)
        decode(m, 4, draft=False)
        first = decode(m, tokens, draft=False)  # as long as the speculative runs below
        passes = pass_costs(m.engine, pass_widths)
        # twice, around the pass costs: runs of hybrid decode spread by 7-20% on an H200;
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
    with slipstream.load(t70, device="cuda", ctx=2048, placement=slipstream.Placement(
                             vram_budget="24GiB", vram_layers=vram_layers), draft=t8) as m:
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
            m.speculation.reset()
        # traced (per-token intervals and store traffic): where a floor under 0.9x loses
        # its time (four learning passes once averaged 0.85 s against a 0.45 s step)
        auto = attempt(decode, m, tokens, trace=fresh_sizer)
        released = m.speculation.released
        after = decode(m, tokens, draft=False)  # plain, with the layers the draft's VRAM took
        store = m.engine.layers
        # what plain decode runs on after the release (once 7% under plain without a draft,
        # with one streamed layer more): resident layers and how long the release took
        after_release = {"resident_layers": sum(x is not None for x in store.layers),
                         "release_s": round(released.seconds, 3),
                         # the plan beside the draft streams plain's layers first and the
                         # release promotes the others: plain's layout again
                         "same_layout_as_plain": m.plan.streamed_layers == plain_layout,
                         "vram_gib_after": round(torch.cuda.memory_reserved() / 2**30, 2)
                         } if released else None
        # a reference held past the load keeps its resident layers in VRAM: a third load
        # (bracket) once measured 44.6 GiB reserved with this one's on top
        del store
        row = {"name": "70b-q4k-vram24-spec", "draft": t8.name,
               "draft_vram_bytes": draft_vram, "streamed_layers": streamed_with_draft,
               "plain_decode_tok_s": rows[0]["decode_tok_s"],
               "plain_same_split_tok_s": same_split["decode_tok_s"],
               "draft_released": released is not None,
               "layers_made_resident": len(released.promoted) if released else 0,
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
        return rows
    if not skip_case:
        return rows
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, placement=slipstream.Placement(
                             vram_budget="24GiB", vram_layers=vram_layers),
                         skip_layers=streamed) as m:
        r = decode(m, 16, draft=False)
        rows.append({"name": f"70b-q4k-vram24-skip{streamed}", "skip_layers": streamed,
                     "skipped_streamed": len(set(m.skipped_layers)
                                             & set(m.plan.streamed_layers)),
                     "decode_tok_s": r["decode_tok_s"], "vram_gib": vram_gib(),
                     "note": "lossy: random weights say nothing of quality "
                             "(benchmarks/quality.py skip measures it)"})
        # exactly the streamed layers, whatever calibration says: nothing crosses PCIe
        m.engine.skip = frozenset(m.plan.streamed_layers)
        r = decode(m, 16, draft=False)
        rows.append({"name": "70b-q4k-vram24-skip-streamed", "skip_layers": streamed,
                     "skipped_streamed": streamed, "decode_tok_s": r["decode_tok_s"],
                     "vram_gib": vram_gib(), "note": "lossy, as above"})
    return rows


def _bracket_load(t70: Path, rows: list[dict], tokens: int, vram_layers: int | None
                  ) -> list[dict]:
    """seventy(bracket=True)'s third load: plain decode after the speculative load, the floor
    row judged against the plain runs on both sides, then the streamed layers skipped."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with slipstream.load(t70, device="cuda", ctx=2048, placement=slipstream.Placement(
                             vram_budget="24GiB", vram_layers=vram_layers)) as m:
        decode(m, 4, draft=False)
        after = decode(m, tokens, draft=False)
        streamed = list(m.plan.streamed_layers)
        m.engine.skip = frozenset(streamed)  # nothing crosses PCIe
        skipped = decode(m, 16, draft=False)
        skip_row = {"name": "70b-q4k-vram24-skip-streamed", "skip_layers": len(streamed),
                    "skipped_streamed": len(streamed), "decode_tok_s": skipped["decode_tok_s"],
                    "vram_gib": vram_gib(), "note": "lossy: random weights say nothing of "
                    "quality (benchmarks/quality.py skip measures it)"}
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


CASES = ("default-spec", "70b-q4k-vram24-spec")
COLUMNS = [("name", "case", ""), ("variant", "variant", ""), ("decode_tok_s", "tok/s", ".2f"),
           ("plain_decode_tok_s", "plain", ".2f"), ("ratio_to_plain", "/plain", ".3f"),
           ("tokens_per_pass", "tok/pass", ".2f"), ("target_pass_s", "pass s", ".3f"),
           ("draft_s_per_pass", "draft s", ".3f"), ("error", "error", "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--model", help="the default model (Q4_1); default: the cache's, pulled")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llamacpp", metavar="BUILD", help="llama.cpp's build folder: -ngl 46 "
                    "on the 70B file in this run")
    ap.add_argument("--results", default=str(common.RESULTS))
    ap.add_argument("--workdir", default=str(common.MODELS))
    ap.add_argument("--quick", action="store_true", help="70B: fewer pass and level widths")
    ap.add_argument("--no-bracket", action="store_true", help="70B: no third load (the floor "
                    "is then judged against the first load's plain runs, then layer skip)")
    a = ap.parse_args(argv)
    work = Path(a.workdir)
    cases = [c for c in a.case.split(",") if c]
    if set(cases) - set(CASES):
        ap.error(f"unknown case(s) {', '.join(set(cases) - set(CASES))}")
    head = common.provenance("cuda")
    shown = []
    for case in cases:
        t0 = time.perf_counter()
        if case == "default-spec":
            from slipstream.hub.pull import pull

            model = Path(a.model) if a.model else pull(None, quiet=True)
            rows = [attempt(lambda: default_spec(model, work, a.tokens))]
            rows = rows[0] if isinstance(rows[0], list) else [{"name": case, **rows[0]}]
        else:
            quick = dict(pass_widths=(1, 256, 512),
                         level_widths=(1, 4, CUDA_LEVEL_WIDTH)) if a.quick else {}
            rows = attempt(lambda: seventy(work, a.tokens, fresh_sizer=not a.no_bracket,
                                           bracket=not a.no_bracket, **quick))
            rows = rows if isinstance(rows, list) else [{"name": case, **rows}]
        doc = {**head, "tokens": a.tokens, "seconds": round(time.perf_counter() - t0, 1),
               "rows": rows}
        if case != "default-spec" and a.llamacpp:
            doc["llamacpp"] = common.llama_bench(
                a.llamacpp, common.synth_model("70b", "Q4_K", work),
                ["-ngl", "46", "-p", "512", "-n", "16", "-r", "2", "-fa", "1", "-t", "16"])
        print(json.dumps({"case": case, "file": str(common.write_result(case, doc, a.results))}),
              flush=True)
        shown.extend(rows)
    print(common.table(shown, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
