"""`slipstream bench`: prefill and decode speed, like llama-bench, with speculative decoding's
figures where a draft is given."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..provenance import source_revision
from .loading import draft_kwargs, load_model
from .options import add_draft_args, add_model_args


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    b = command("bench", "prefill and decode speed (like llama-bench)")
    add_model_args(b)
    b.add_argument("--pp", type=int, default=512, help="prompt tokens")
    b.add_argument("--tg", type=int, default=128, help="generated tokens")
    b.add_argument("--reps", type=int, default=3, help="repetitions of each test")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write JSON to a file (or stdout with no argument; default: none)")
    add_draft_args(b)
    b.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    # the bench's tools and the probes import torch
    from ..memory.probes import memory_read_gbps
    from ..runtime.bench import SPEC_PROMPT_TOKENS, SPEC_ROOM, bench_first_token, \
        bench_prefill, decode_traffic, random_prompt

    speculative = bool(draft_kwargs(a))
    if a.ctx is None:
        # a speculative tg runs after a prompt, and its last verify passes need room
        tg_room = SPEC_PROMPT_TOKENS + a.tg + SPEC_ROOM if speculative else a.tg
        a.ctx = max(a.pp, tg_room) + 16
    model = load_model(a)
    results = [bench_prefill(model.engine, a.pp, a.reps), bench_tg(model, a)]
    # time to first token: the pp prompt through the source generation decodes with
    ttft = bench_first_token(model.engine, token_source(model, a),
                             random_prompt(model.engine, a.pp), a.reps)
    traffic = decode_traffic(model.engine, model.plan, memory_read_gbps(model.device),
                             model.gguf)
    console = Console(stderr=a.json is not None and a.json == "-")
    console.print(bench_table(model, results, a.load_s, ttft))
    console.print(roofline_line(traffic, results[1].tok_s, speculative), soft_wrap=True)
    if a.json:
        import torch  # loaded with the model; not at start-up, which --help shares

        rev = source_revision()
        roof = traffic.roofline_tok_s
        doc = {"model": str(model.path), "device": str(model.device),
               "threads": torch.get_num_threads(), "commit": rev["commit"], "tree": rev["tree"],
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_s": round(a.load_s, 3), "load_phases": model.load_phases,
               "ttft_s": round(ttft.mean_s, 4),
               "ttft": ttft.as_dict(),
               "memory_read_gbps": round(traffic.gbps["memory"], 2),
               "weight_bytes_per_token": traffic.memory,
               "decode_traffic": traffic.as_dict(),
               "roofline_decode_tok_s": round(roof, 1) if roof else None,
               "decode_fraction_of_roofline": round(results[1].tok_s / roof, 3) if roof
               else None,
               "results": [r.as_dict() for r in results]}
        if speculative:
            doc["draft"] = (str(model.draft.path) if a.draft is not None
                            else model.plan.draft[0] if model.plan is not None and
                            model.plan.draft else f"self, {a.draft_skip_layers} layers skipped")
            doc["spec_nodes"], doc["spec_depth"] = a.spec_nodes, a.spec_depth  # null: auto
        if a.json == "-":
            print(json.dumps(doc, indent=2))
        else:
            Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def roofline_line(traffic, tok_s: float, speculative: bool) -> str:
    """What a decode token moves over each link and the bound the slowest link sets."""
    names = {"memory": "memory reads", "pcie": "PCIe copies", "disk": "disk reads",
             "cpu": "hybrid CPU share"}
    moved = ", ".join(f"{names[k]} {n / 1e6:.1f} MB"
                      + (f" at {traffic.gbps[k]:.1f} GB/s" if traffic.gbps.get(k) else "")
                      for k, n in traffic.links().items())
    roof = traffic.roofline_tok_s
    if roof is None:
        bound = f"decode roofline: not known ({', '.join(traffic.unmeasured())} not measured)"
    else:
        bound = (f"decode roofline {roof:.1f} tok/s (bound by {names[traffic.bound_by()]}), "
                 f"reached {tok_s / roof:.0%}")
    return (f"per decode token: {moved}; {bound}"
            + (" (speculative: a target pass yields several tokens)" if speculative else ""))


def token_source(model, a: argparse.Namespace):
    """What generate() decodes with: plain steps, or the loaded draft's trees of
    --spec-nodes/--spec-depth or sized by one sizer, which learns the costs over the warm-up as
    generate()'s does over a model's generations."""
    # torch, which the commands that load no model never import
    from ..runtime.generate import autoregressive
    from ..speculative.rounds import speculative_source
    from ..speculative.sizing import TreeSizer

    if model.draft is None:
        return autoregressive
    return speculative_source(model.draft.engine, nodes=a.spec_nodes, depth=a.spec_depth,
                              sizer=TreeSizer())


def bench_tg(model, a: argparse.Namespace):
    """tg: plain decode steps, or with a draft speculative decoding of real text."""
    from ..runtime.bench import bench_decode, bench_speculative, spec_prompt  # torch

    if model.draft is None:
        return bench_decode(model.engine, a.tg, a.reps)
    return bench_speculative(model.engine, token_source(model, a), spec_prompt(model.tokenize),
                             a.tg, a.reps)


def bench_table(model, results, load_s: float | None = None, ttft=None) -> Table:
    """The runs' rates, then the time to first token (ttftN: for an N-token prompt) and the
    load's (llama.cpp's timings)."""
    t = Table(title=f"slipstream bench: {model.path.name} on {model.device}")
    spec = any(r.speculative for r in results)
    cols = ["test", "tok/s", "±", "ms / run", "runs"]
    cols += ["tok / pass", "target passes", "draft s", "verify s"] if spec else []
    for col in cols:
        t.add_column(col, justify="right")
    blank = [""] * 4 if spec else []
    for r in results:
        row = [r.test, f"{r.tok_s:.1f}", f"{r.tok_s_std:.1f}", f"{r.mean_s * 1e3:.1f}",
               str(len(r.seconds))]
        if spec:
            row += ([f"{r.tokens_per_pass:.2f}", f"{r.target_passes:.0f}", f"{r.draft_s:.3f}",
                     f"{r.verify_s:.3f}"] if r.speculative else blank)
        t.add_row(*row)
    if ttft is not None:
        t.add_row(ttft.test, "", "", f"{ttft.mean_s * 1e3:.1f}",
                  str(len(ttft.seconds)), *blank)
    if load_s is not None:
        t.add_row("load", "", "", f"{load_s * 1e3:.1f}", "1", *blank)
        for phase, s in getattr(model, "load_phases", {}).items():
            if s >= 0.001:  # where the load's time went (slipstream.load_clock)
                t.add_row(f"load: {phase}", "", "", f"{s * 1e3:.1f}", "1", *blank)
    return t
