"""How often the tree grown ahead holds the next root, on the real pair, on the CPU.

While a target pass runs, the draft grows the same tree on ahead (speculative.tree); when the
walk's outcome is a node grown ahead, the next tree needs no draft forward in series. On CUDA
that growth runs beside the streamed pass; on the CPU it runs after it (the cores are shared),
so this bench measures the outcome, not the time: the share of rounds whose tree was grown
ahead, and the draft forwards left in series per target pass, with and without growing ahead.

Target: the default model requantized to Q8_0; draft: its Q4_0 requantization (as in
bench/spec_acceptance.py). Growing ahead runs --ahead levels of 4 nodes per pass: about what a
streamed 70B pass leaves room for on the H200 (a 0.48 s pass, 8B draft levels of 4 nodes at
about 10 ms through CUDA graphs: bench/results/2026-11-30-s6-spec-bench-70b-h200.json).

    python bench/spec_ahead_cpu.py [--out bench/results/...json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import slipstream  # noqa: E402
from spec_acceptance import PROMPTS, SAMPLING, cpu_name, make_file, provenance  # noqa: E402


def cell(model, prompts, nodes: int, depth: int, temperature: float, ahead: int,
         max_tokens: int, seed: int) -> dict:
    passes = tokens = grown = series = ahead_fw = 0
    out_tokens = []
    t = time.perf_counter()
    for ids in prompts:
        toks = [e.id for e in model.generate(ids, max_tokens=max_tokens, temperature=temperature,
                                             seed=seed, spec_nodes=nodes, spec_depth=depth,
                                             spec_ahead=ahead, **SAMPLING)]
        out_tokens.append(toks)
        x = model.last_stats.extra
        p = int(x["spec_target_passes"])
        passes += p
        tokens += round(x["spec_tokens_per_pass"] * p)
        grown += int(x["spec_ahead_trees"])
        series += int(x["spec_draft_forwards"])
        ahead_fw += int(x["spec_ahead_forwards"])
    return dict(nodes=nodes, depth=depth, temperature=temperature, ahead_levels=ahead,
                target_passes=passes, tokens_per_pass=tokens / passes,
                trees_grown_ahead=grown, share_grown_ahead=grown / passes,
                series_draft_forwards_per_pass=series / passes,
                ahead_forwards_per_pass=ahead_fw / passes,
                seconds=time.perf_counter() - t, tokens=out_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/slipstream-spec")
    p.add_argument("--nodes", default="64,256")
    p.add_argument("--temps", default="0,0.8")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ahead", type=int, default=32)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench/results/2026-11-30-s7-spec-ahead-cpu.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from slipstream.hub.pull import pull

    src = Path(pull(quiet=True))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target, _ = make_file(src, work, "Q8_0", "Q4_0")
    draft, _ = make_file(src, work, "Q4_0", "Q4_0")
    model = slipstream.load(target, device="cpu", ctx=512, precision="fast", draft=draft)
    prompts = []
    for _, kind, text in PROMPTS[:a.prompts]:
        prompts.append(model.chat_ids([{"role": "user", "content": text}]) if kind == "chat"
                       else model.tokenize(text))
    rows = []
    load = os.getloadavg()
    for nodes in (int(x) for x in a.nodes.split(",")):
        for temp in (float(x) for x in a.temps.split(",")):
            base = cell(model, prompts, nodes, a.depth, temp, 0, a.max_tokens, a.seed)
            ahead = cell(model, prompts, nodes, a.depth, temp, a.ahead, a.max_tokens, a.seed)
            # lossless either way: the same seed gives the same tokens
            ahead["same_tokens_as_without"] = ahead["tokens"] == base["tokens"]
            rows += [base, ahead]
            print(f"nodes {nodes} T={temp}: {base['tokens_per_pass']:.2f} tok/pass; grown "
                  f"ahead {ahead['share_grown_ahead']:.0%} of trees; draft forwards in series "
                  f"per pass {base['series_draft_forwards_per_pass']:.2f} -> "
                  f"{ahead['series_draft_forwards_per_pass']:.2f}", flush=True)
    model.close()
    for r in rows:
        r.pop("tokens")
    doc = dict(bench="spec_ahead_cpu", date=datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), device="cpu", cpu=cpu_name(),
               threads=a.threads, load_average_at_start=load, torch=torch.__version__,
               **provenance(), target=str(target.name), draft=str(draft.name),
               settings=dict(vars(a)), rows=rows,
               note="outcomes, not times: on the CPU the levels grown ahead run after each "
                    "target pass; on CUDA they run beside it")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    t = Table(title="trees grown ahead (CPU, default model Q8_0 target, Q4_0 draft)")
    for c in ("nodes", "T", "ahead levels", "tok/pass", "grown ahead", "series fw/pass",
              "ahead fw/pass", "same tokens"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["nodes"]), f"{r['temperature']:g}", str(r["ahead_levels"]),
                  f"{r['tokens_per_pass']:.2f}", f"{r['share_grown_ahead']:.0%}",
                  f"{r['series_draft_forwards_per_pass']:.2f}",
                  f"{r['ahead_forwards_per_pass']:.1f}",
                  str(r.get("same_tokens_as_without", "")))
    console = Console(width=140, record=True)
    console.print(t)
    out.with_suffix(".txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
