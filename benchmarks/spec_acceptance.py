"""Speculative decoding's acceptance on the CPU: tokens per target pass, by target, draft, tree
size and temperature (the issue's acceptance table).

Target: the default model (SmolLM2-135M-Instruct, pulled as Q4_1) requantized to Q8_0 (and F16
with --targets Q8_0,F16). Drafts: its Q2_K and Q4_0 requantizations, and the layer-skip
self-draft (`load(draft=SelfDraft(skip_layers=K))`: the target's own weights with K layers left out),
where this checkout's `slipstream.load` has that keyword (rows are skipped with a note where it
does not), and the low-bit copy (`--drafts lowbit-Q2_K`: `load(draft=SelfDraft(lowbit="Q2_K"))`, the
target's layers requantized at load, sharing its embedding, head, norms and KV cache). Every file is made by `slipstream.quant.requantize` from the Q4_1 file (dequantized,
then re-encoded by slipstream's own encoders, not llama.cpp's); a Q2_K file keeps the matrices
whose rows are not whole 256-element blocks (576 columns here: all but ffn_down) in a fallback
type (Q4_0 by default, as llama.cpp falls back from K-quants to a 32-block type), because
neither format can hold them.

Each (target, draft) pair loads once; every (nodes, temperature) cell then generates
--max-tokens from each of a fixed set of prompts (prose, code, a list, a factual question, two
chats through the chat template) with a fixed seed, and sums the generation's `stats.extra`
speculative figures over the prompts: tokens_per_pass = all tokens emitted by verify passes /
all verify passes (not a mean of per-prompt means). At temperature 0 the tokens are also
compared with the target's plain greedy decode (speculation is lossless, so they should be
equal but for float near-ties between a tree pass and a decode step).

    python benchmarks/spec_acceptance.py            # the full table into benchmarks/results
    python benchmarks/spec_acceptance.py --quick         # a small smoke run into /tmp
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # this checkout's slipstream, whatever is pip-installed

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import slipstream  # noqa: E402
from slipstream.provenance import cpu_name  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks/results/spec-acceptance-cpu.json"
QUICK_OUT = Path("/tmp/slipstream-spec/2026-11-30-spec-acceptance-cpu-quick.json")

# (name, kind, content): kind "text" is tokenized as is (BOS added), "chat" goes through the
# model's chat template (model.chat_ids)
PROMPTS = [
    ("prose", "text", "Once upon a time, in a small village at the edge of a great forest, "
                      "there lived an old clockmaker who"),
    ("code", "text", "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
                     "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
    ("list", "text", "Ten things to pack for a week-long camping trip:\n1."),
    ("factual", "text", "Question: What is the capital of France, and what is it famous for?\n"
                        "Answer:"),
    ("chat-tips", "chat", "Give me three tips for staying focused while studying."),
    ("chat-explain", "chat", "Explain what a hash table is and when I should use one."),
]
SAMPLING = dict(top_k=40, top_p=0.95, min_p=0.05)
# The tree's depth is fixed (speculative.rounds's DEFAULT_DEPTH), not left to the sizer
# (speculative.sizing), which would choose it, plain steps included, from timings: the table
# measures acceptance at a given tree shape, whatever the machine's load.
SPEC_DEPTH = 8
HOW_COUNTED = ("tokens_per_pass: spec_tokens_per_pass x spec_target_passes per generation (every "
               "token a verify pass emits, the pending root included; the first token comes "
               "from the prefill and no pass), summed over prompts, over the passes summed. "
               "The last pass of a generation is cut short by max_tokens (it may be a plain "
               "step, counted in plain_steps), and a pass that draws an end token also counts "
               "the tokens it drew after it; tokens_per_pass_used counts only the tokens "
               "generation kept (generated - 1 per prompt) over the same passes")


# --- model files ---------------------------------------------------------------------------------

def make_file(src: Path, work: Path, qtype: str, fallback: str) -> tuple[Path, dict]:
    """`src` requantized to `qtype` in `work` (reused when present), and how it was made."""
    from slipstream.errors import GGUFError
    from slipstream.quant.requantize import requantize

    dst = work / f"{src.stem}.to-{qtype}.gguf"
    how = {"made_by": f"slipstream.quant.requantize.requantize(src, dst, {qtype!r})",
           "fallback": None}
    fb_dst = work / f"{src.stem}.to-{qtype}-fallback-{fallback}.gguf"
    if fb_dst.exists():
        dst = fb_dst
    if not dst.exists():
        t = time.perf_counter()
        try:
            requantize(src, dst, qtype)
        except GGUFError as e:  # K-quant rows must be whole 256-element blocks
            print(f"requantize to {qtype} failed ({e}); making it with rows that are not whole "
                  f"blocks in {fallback}")
            dst = fb_dst
            requantize(src, dst, qtype, fallback=fallback)
        print(f"made {dst.name} in {time.perf_counter() - t:.1f} s")
    if dst == fb_dst:
        how = {"made_by": f"slipstream.quant.requantize.requantize(src, dst, {qtype!r}, "
                          f"fallback={fallback!r}): tensors whose rows are not whole {qtype} "
                          f"blocks in {fallback}",
               "fallback": fallback}
    how["tensor_types"] = tensor_types(dst)
    how["bytes"] = dst.stat().st_size
    return dst, how


def tensor_types(path: Path) -> dict[str, int]:
    from slipstream.modelfile.gguf_file import GGUFFile

    gf = GGUFFile(path)
    try:
        out: dict[str, int] = {}
        for info in gf.tensors.values():
            out[info.ggml_type.name] = out.get(info.ggml_type.name, 0) + 1
        return dict(sorted(out.items()))
    finally:
        gf.close()


def has_draft_skip() -> bool:
    return hasattr(slipstream, "SelfDraft")


# --- measuring -----------------------------------------------------------------------------------

def prompt_ids(model) -> list[tuple[str, list[int]]]:
    out = []
    for name, kind, text in PROMPTS:
        ids = (model.chat_ids([{"role": "user", "content": text}]) if kind == "chat"
               else model.tokenize(text))
        out.append((name, ids))
    return out


def run_one(model, ids: list[int], max_tokens: int, temperature: float, seed: int,
            nodes: int | None, depth: int = SPEC_DEPTH) -> tuple[list[int], dict, object]:
    if nodes is None:
        kw = dict(draft=False)
    else:
        kw = dict(spec_nodes=nodes)
        if "spec_depth" in inspect.signature(model.generate).parameters:
            kw["spec_depth"] = depth
    gen = model.generate(ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                         **SAMPLING, **kw)
    toks = [e.id for e in gen]
    st = gen.stats
    return toks, dict(st.extra), st


def measure_cell(model, prompts, nodes: int, temperature: float, a, plain: dict | None
                 ) -> dict:
    passes = tokens = generated = forwards = plain_steps = 0
    tree_nodes = draft_s = verify_s = 0.0
    hist: list[int] = []
    per_prompt, mismatches = [], []
    t0 = time.perf_counter()
    for name, ids in prompts:
        toks, x, st = run_one(model, ids, a.max_tokens, temperature, a.seed, nodes, a.depth)
        p = int(x["spec_target_passes"])
        n = int(round(x["spec_tokens_per_pass"] * p))
        passes += p
        tokens += n
        generated += st.generated_tokens
        forwards += int(x.get("spec_draft_forwards", 0))
        plain_steps += int(x.get("spec_plain_steps", 0))
        tree_nodes += x["spec_tree_nodes_mean"] * p
        draft_s += x["spec_draft_s"]
        verify_s += x["spec_verify_s"]
        for i, c in enumerate(x["spec_accepted_hist"]):
            while len(hist) <= i:
                hist.append(0)
            hist[i] += c
        pp = {"prompt": name, "passes": p, "tokens": n,
              "tokens_per_pass": round(n / p, 4) if p else None,
              "generated": st.generated_tokens, "finish": st.finish_reason}
        if plain is not None:
            ref = plain[name]
            same = next((i for i, (u, v) in enumerate(zip(toks, ref)) if u != v),
                        None if len(toks) == len(ref) else min(len(toks), len(ref)))
            pp["greedy_equals_plain"] = same is None
            if same is not None:
                pp["first_difference_at"] = same
                mismatches.append(name)
        per_prompt.append(pp)
    wall = time.perf_counter() - t0
    q = max(passes, 1)
    row = {"nodes": nodes, "depth": a.depth, "temperature": temperature,
           "tree_tau": _tree_tau(temperature), **_tau_fit(model, temperature),
           "tokens_per_pass": round(tokens / q, 4), "passes": passes, "tokens": tokens,
           "generated_tokens": generated, "accepted_hist": hist,
           "mean_accepted": round(sum(i * c for i, c in enumerate(hist)) / q, 4),
           "tree_nodes_mean": round(tree_nodes / q, 2),
           "draft_forwards_per_pass": round(forwards / q, 3), "plain_steps": plain_steps,
           "draft_ms_per_pass": round(1e3 * draft_s / q, 2),
           "verify_ms_per_pass": round(1e3 * verify_s / q, 2),
           "wall_s": round(wall, 1), "per_prompt": per_prompt}
    if plain is not None:
        row["greedy_equals_plain"] = f"{len(prompts) - len(mismatches)}/{len(prompts)}"
        row["greedy_mismatch_prompts"] = mismatches
    return derive(row)


def derive(row: dict) -> dict:
    """tokens_per_pass_used: the tokens generation kept per pass. A pass that draws an end
    token also counts the tokens it drew after it (spec figures), which generation drops; the
    first token of each generation comes from the prefill, not a pass."""
    used = sum(p["generated"] - 1 for p in row["per_prompt"])
    row["tokens_per_pass_used"] = round(used / max(row["passes"], 1), 4)
    return row


def load_pair(target: Path, draft: str, files: dict, ctx: int, precision: str):
    """(model, draft description) for one target and draft; None where the draft cannot be
    loaded by this checkout."""
    if draft.startswith("skip-"):
        k = int(draft.split("-")[1])
        own_kv = draft.endswith("-ownkv")  # a KV cache of its own, not the target's
        if not has_draft_skip():
            return None, None
        m = slipstream.load(target, device="cpu", ctx=ctx, precision=precision,
                            draft=slipstream.SelfDraft(skip_layers=k))
        skipped = None
        try:  # the new keyword's model shape is not settled: report what it offers
            d = getattr(m, "draft", None)
            skipped = sorted(d.engine.skip) if d is not None and d.engine.skip else None
        except Exception:  # noqa: BLE001
            pass
        if own_kv:
            from slipstream.api import Model

            d = m.draft
            mine = Model(m.path, m.gguf, m.config, m.engine.self_draft(d.engine.skip),
                         m.tokenizer, m.template)
            mine.owns_resources = False
            d.close()
            m.draft = mine
        return m, {"kind": "layer-skip self-draft" + (", with a KV cache of its own (built as "
                                                       "model.engine.self_draft(skip))"
                                                       if own_kv else ""),
                   "load": f"draft=SelfDraft(skip_layers={k})", "skipped_layers": skipped}
    if draft.startswith("lowbit-"):
        qtype = draft.split("-", 1)[1]
        m = slipstream.load(target, device="cpu", ctx=ctx, precision=precision,
                            draft=slipstream.SelfDraft(lowbit=qtype))
        return m, {"kind": "low-bit self-draft (speculative.lowbit: the target's layers "
                           "requantized at load, its embedding, head, norms and KV cache "
                           "shared)", "load": f"draft=SelfDraft(lowbit={qtype!r})",
                   "plan_draft": list(m.plan.draft)}
    path = files[draft]
    m = slipstream.load(target, device="cpu", ctx=ctx, precision=precision, draft=path)
    return m, {"kind": "file", "path": str(path)}


# --- provenance and output -----------------------------------------------------------------------

def git(*args: str) -> str | None:
    try:  # read-only: --no-optional-locks keeps status from refreshing the index
        r = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args],
                           capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout


_START: dict | None = None  # provenance() at the start of the run: what was imported


def provenance() -> dict:
    commit = (git("rev-parse", "--short", "HEAD") or "").strip() or None
    status = git("status", "--porcelain", "--untracked-files=all", "--", "src", "bench",
                 "tests")
    dirty = [ln[3:] for ln in (status or "").splitlines()]
    files = ["src/slipstream/runtime/speculative.py", "src/slipstream/api.py",
             "src/slipstream/quant/requantize.py", "src/slipstream/runtime/generate.py",
             "benchmarks/spec_acceptance.py"]
    sha = {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest()[:16]
           for f in files if (REPO / f).exists()}
    return {"commit": commit, "dirty": bool(dirty), "dirty_paths": dirty,
            "sha256_16_of_files_run": sha}


def table(rows: list[dict]) -> Table:
    t = Table(title="speculative decoding on the CPU: tokens per target pass "
                    "(SmolLM2-135M-Instruct; drafts requantized by slipstream)")
    cols = ["target", "draft", "nodes", "depth", "T", "tok/pass", "used tok/pass", "passes",
            "tokens", "accepted hist", "tree", "draft ms/pass", "verify ms/pass", "wall s", "greedy = plain"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("target", "draft", "accepted hist") else "right")
    for r in rows:
        t.add_row(r["target"], r["draft"], str(r["nodes"]), str(r.get("depth", SPEC_DEPTH)),
                  f"{r['temperature']:g}",
                  f"{r['tokens_per_pass']:.3f}", f"{r['tokens_per_pass_used']:.3f}",
                  str(r["passes"]), str(r["tokens"]),
                  " ".join(map(str, r["accepted_hist"])), f"{r['tree_nodes_mean']:.1f}",
                  f"{r['draft_ms_per_pass']:.1f}", f"{r['verify_ms_per_pass']:.1f}",
                  f"{r['wall_s']:.0f}", r.get("greedy_equals_plain", ""))
    return t


def _tree_tau(temperature: float) -> float | None:
    """The temperature the draft's candidates were ranked at (speculative.tree.tree_tau;
    None in a tree that ranked at the draft's own temperature, 1)."""
    try:
        from slipstream.speculative.tree import tree_tau
    except ImportError:
        return None
    return tree_tau(temperature)


def _tau_fit(model, temperature: float) -> dict:
    """The ranking temperature's fit after the cell (speculative.calibration;
    it carries over from cell to cell of one draft, as over a model's generations): the score
    temperature it ranks at, the nodes it scored and the walk score per temperature of its grid."""
    fits = [s.tau_fits[float(temperature)] for s in model.speculation.sizers.values()
            if float(temperature) in getattr(s, "tau_fits", {})]
    if not fits:
        return {}
    fit = fits[0]
    return {"tree_tau_fitted": fit.tau, "tree_tau_observed": fit.observed,
            "tree_tau_walked": {f"{t:g}": v for t, v in zip(fit.grid, fit.walked)}}


def write(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    with out.with_suffix(".txt").open("w") as f:
        Console(file=f, width=170).print(table(doc["rows"]))
        for n in doc["notes"]:
            f.write(f"note: {n}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/slipstream-spec", help="where requantized files go "
                   "(reused when present)")
    p.add_argument("--targets", default="Q8_0", help="comma-separated: Q8_0, F16")
    p.add_argument("--drafts", default="Q2_K,Q4_0,skip-4,skip-8",
                   help="comma-separated: a type to requantize to, skip-K for the "
                        "layer-skip self-draft (skip-K-ownkv: with a KV cache of its own), "
                        "lowbit-TYPE for the low-bit copy")
    p.add_argument("--nodes", default="16,64,256")
    p.add_argument("--temps", default="0,0.8")
    p.add_argument("--depth", type=int, default=SPEC_DEPTH, help="the trees' depth (drafted "
                   "tokens below the root on the longest branch)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--precision", default="fast")
    p.add_argument("--fallback", default="Q4_0", help="type for matrices a K-quant can't hold")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-plain-check", action="store_true",
                   help="do not compare greedy rows with the target's plain greedy decode")
    p.add_argument("--quick", action="store_true", help="smoke run: Q4_0 and skip-4 drafts, "
                   "16 and 64 nodes, 2 prompts, 24 tokens, into /tmp")
    p.add_argument("--note", action="append", default=[], help="recorded in the JSON")
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing --out "
                   "that this run does not measure (e.g. drafts run later), and its runs")
    p.add_argument("--rewrite", action="store_true", help="measure nothing: add the derived "
                   "figures to --out's rows and write its JSON and table again")
    p.add_argument("--out", default=None, help=f"JSON (the table also goes to .txt); default "
                   f"{DEFAULT_OUT.relative_to(REPO)}, or {QUICK_OUT} with --quick")
    a = p.parse_args()
    if a.quick:
        a.drafts, a.nodes, a.prompts, a.max_tokens = "Q4_0,skip-4", "16,64", 2, 24
    out = Path(a.out) if a.out else (QUICK_OUT if a.quick else DEFAULT_OUT)
    if a.rewrite:
        doc = json.loads(out.read_text())
        doc["rows"] = [derive(r) for r in doc["rows"]]
        doc["how_tokens_are_counted"] = HOW_COUNTED
        doc["notes"] += [n for n in a.note if n not in doc["notes"]]
        write(doc, out)
        Console(width=170).print(table(doc["rows"]))
        return
    torch.set_num_threads(a.threads)
    global _START
    _START = provenance()  # the sources as they were when this run imported them
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    targets = a.targets.split(",")
    drafts = a.drafts.split(",")
    nodes = [int(x) for x in a.nodes.split(",")]
    temps = [float(x) for x in a.temps.split(",")]

    from slipstream.hub.pull import pull

    src = Path(pull(quiet=True))
    files, made = {}, {}
    for q in dict.fromkeys(targets + [d for d in drafts
                                      if not d.startswith(("skip-", "lowbit-"))]):
        files[q], made[q] = make_file(src, work, q, a.fallback)

    notes = list(a.note)
    skip_ok = has_draft_skip()
    if any(d.startswith("skip-") for d in drafts) and not skip_ok:
        msg = ("this checkout's slipstream.load has no draft_skip_layers keyword: the "
               "layer-skip self-draft rows (" + ", ".join(d for d in drafts
                                                          if d.startswith("skip-"))
               + ") were not run")
        print(f"NOTE: {msg}")
        notes.append(msg)

    rows, drafts_info, old = [], {}, None
    if a.merge and out.exists():
        old = json.loads(out.read_text())
        mine = {"max_tokens": a.max_tokens, "seed": a.seed, "ctx": a.ctx,
                "precision": a.precision, "prompts": len(PROMPTS[:a.prompts])}
        theirs = dict(old["settings"], prompts=len(old["settings"]["prompts"]))
        differ = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if differ:
            raise SystemExit(f"--merge: {out} was measured with other settings "
                             f"(theirs, ours): {differ}")
        drafts_info.update(old.get("drafts", {}))
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    console = Console(width=170)
    for tq in targets:
        plain = None
        if 0.0 in temps and not a.no_plain_check:
            m = slipstream.load(files[tq], device="cpu", ctx=a.ctx, precision=a.precision)
            t = time.perf_counter()
            plain = {name: run_one(m, ids, a.max_tokens, 0.0, a.seed, None)[0]
                     for name, ids in prompt_ids(m)[:a.prompts]}
            plain_s = time.perf_counter() - t
            toks = sum(len(v) for v in plain.values())
            print(f"{tq}: plain greedy reference, {toks} tokens in {plain_s:.1f} s "
                  f"({toks / plain_s:.1f} tok/s with prefills)")
            m.close()
        for d in drafts:
            model, info = load_pair(files[tq], d, files, a.ctx, a.precision)
            if model is None:
                continue
            drafts_info[d] = info
            prompts = prompt_ids(model)[:a.prompts]
            for n in nodes:
                for temp in temps:
                    row = {"target": tq, "draft": d,
                           **measure_cell(model, prompts, n, temp, a,
                                          plain if temp == 0.0 else None)}
                    rows.append(row)
                    print(f"{tq} <- {d:7s} nodes {n:3d} T {temp:g}: "
                          f"{row['tokens_per_pass']:.3f} tok/pass over {row['passes']} "
                          f"passes ({row['wall_s']:.0f} s)"
                          + (f", greedy = plain {row['greedy_equals_plain']}"
                             if "greedy_equals_plain" in row else ""), flush=True)
            model.close()  # the rows so far are written after each pair: a cut run keeps them
            write_doc(a, out, src, files, made, drafts_info, rows, notes, load_before, t_all,
                      old, partial=True)
    doc = write_doc(a, out, src, files, made, drafts_info, rows, notes, load_before, t_all, old,
                    partial=False)
    console.print(table(doc["rows"]))
    for n in doc["notes"]:
        print(f"note: {n}")
    print(f"wrote {out} and {out.with_suffix('.txt')} ({doc['runtime_s']:.0f} s)")


def write_doc(a, out: Path, src: Path, files, made, drafts_info, rows, notes, load_before,
              t_all, old: dict | None, partial: bool) -> dict:
    run = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **(_START or provenance()),
           "threads": torch.get_num_threads(), "targets": a.targets, "drafts": a.drafts, "nodes": a.nodes, "temps": a.temps,
           "load_avg_before": [round(x, 2) for x in load_before],
           "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "runtime_s": round(time.perf_counter() - t_all, 1), "partial": partial}
    runs, all_rows = [run], list(rows)
    if old is not None:  # --merge: the old rows this run did not remeasure, first
        def key(r: dict) -> tuple:
            return (r["target"], r["draft"], r["nodes"], r.get("depth", SPEC_DEPTH),
                    r["temperature"])

        mine = {key(r) for r in rows}
        all_rows = [r for r in old["rows"] if key(r) not in mine] + all_rows
        old_threads = old.get("threads")  # a run written before runs carried their threads
        runs = [r if "threads" in r or not isinstance(old_threads, int)
                else {**r, "threads": old_threads} for r in old.get("runs", [])] + runs
        # a note that the skip rows were missing goes once they are here
        notes = [n for n in old.get("notes", []) if not ("draft_skip_layers" in n and any(
            r["draft"].startswith("skip-") for r in all_rows))] + [
            n for n in notes if n not in old.get("notes", [])]
        files = {**{q: Path(v["path"]) for q, v in old.get("files", {}).items()}, **files}
        made = {**old.get("files", {}), **made}
    order = {d: i for i, d in enumerate(["Q2_K", "Q4_0"])}
    all_rows = [r if "tokens_per_pass_used" in r else derive(r) for r in all_rows]
    all_rows.sort(key=lambda r: (r["target"], order.get(r["draft"], 9), r["draft"],
                                 r["nodes"], r["temperature"]))
    doc = {
        "what": "speculative decoding acceptance: tokens emitted per target (verify) pass, "
                "summed over the prompts (total tokens / total passes), by target, draft, "
                "tree size (nodes, the root included) and temperature",
        "device": "cpu", "cpu": cpu_name(),
        "threads": sorted({r.get("threads") for r in runs} - {None}),
        "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(_START or provenance()),
        "settings": {"precision": a.precision, "ctx": a.ctx, "max_tokens": a.max_tokens,
                     "seed": a.seed, **SAMPLING, "spec_depth": a.depth,
                     "tree_top_k": 8, "sizer": "bypassed: spec_nodes and spec_depth fixed",
                     "prompts": [{"name": n, "kind": k, "text": t}
                                 for n, k, t in PROMPTS[:a.prompts]],
                     "quick": a.quick},
        "source_model": {"path": str(src), "bytes": src.stat().st_size,
                         "tensor_types": tensor_types(src)},
        "files": {q: {**made[q], "path": str(files[q])} for q in files},
        "drafts": drafts_info,
        "how_files_were_made": "every target and draft file is the default model's Q4_1 "
                               "file dequantized by slipstream's reference dequantizer and "
                               "re-encoded by slipstream's own encoders "
                               "(slipstream.quant.requantize / quant.encode), not llama.cpp's "
                               "quantize; the token embedding (Q8_0 in the source) is "
                               "re-encoded too, norms stay F32. So the Q8_0 and F16 targets "
                               "carry the Q4_1 model's rounding, and the drafts a second one.",
        "how_tokens_are_counted": HOW_COUNTED,
        "notes": notes,
        "runtime_s": round(sum(r["runtime_s"] for r in runs), 1),
        "partial": partial,
        "runs": runs,
        "rows": all_rows,
    }
    write(doc, out)
    return doc


if __name__ == "__main__":
    main()
