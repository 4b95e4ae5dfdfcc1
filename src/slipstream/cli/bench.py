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
    from ..runtime.bench import SPEC_PROMPT_TOKENS, SPEC_ROOM, bench_prefill, \
        weight_bytes_per_token

    speculative = bool(draft_kwargs(a))
    if a.ctx is None:
        # a speculative tg runs after a prompt, and its last verify passes need room
        tg_room = SPEC_PROMPT_TOKENS + a.tg + SPEC_ROOM if speculative else a.tg
        a.ctx = max(a.pp, tg_room) + 16
    model = load_model(a)
    results = [bench_prefill(model.engine, a.pp, a.reps), bench_tg(model, a)]
    bw = memory_read_gbps(model.device)
    per_token = weight_bytes_per_token(model.engine, model.gguf)
    roofline = bw * 1e9 / per_token
    console = Console(stderr=a.json is not None and a.json == "-")
    console.print(bench_table(model, results))
    console.print(f"weights read per decode token {per_token / 1e6:.1f} MB, memory read "
                  f"{bw:.1f} GB/s: decode roofline {roofline:.1f} tok/s, reached "
                  f"{results[1].tok_s / roofline:.0%}"
                  + (" (speculative: a target pass yields several tokens)" if speculative
                     else ""))
    if a.json:
        import torch  # loaded with the model; not at start-up, which --help shares

        rev = source_revision()
        doc = {"model": str(model.path), "device": str(model.device),
               "threads": torch.get_num_threads(), "commit": rev["commit"], "tree": rev["tree"],
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "memory_read_gbps": round(bw, 2), "weight_bytes_per_token": per_token,
               "roofline_decode_tok_s": round(roofline, 1),
               "decode_fraction_of_roofline": round(results[1].tok_s / roofline, 3),
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


def bench_tg(model, a: argparse.Namespace):
    """tg: plain decode steps, or with a draft speculative decoding of real text."""
    # the bench's tools and the tree's sizer import torch
    from ..runtime.bench import bench_decode, bench_speculative, spec_prompt
    from ..speculative.sizing import TreeSizer
    from ..speculative.rounds import speculative_source

    if model.draft is None:
        return bench_decode(model.engine, a.tg, a.reps)
    # what generate() decodes with: the loaded draft, trees of --spec-nodes/--spec-depth or
    # sized by one sizer, which learns the costs over the warm-up as generate()'s does over
    # a model's generations
    source = speculative_source(model.draft.engine, nodes=a.spec_nodes, depth=a.spec_depth,
                                sizer=TreeSizer())
    return bench_speculative(model.engine, source, spec_prompt(model.tokenize), a.tg, a.reps)


def bench_table(model, results) -> Table:
    t = Table(title=f"slipstream bench: {model.path.name} on {model.device}")
    spec = any(r.speculative for r in results)
    cols = ["test", "tok/s", "±", "runs"]
    cols += ["tok / pass", "target passes", "draft s", "verify s"] if spec else []
    for col in cols:
        t.add_column(col, justify="right")
    for r in results:
        row = [r.test, f"{r.tok_s:.1f}", f"{r.tok_s_std:.1f}", str(len(r.seconds))]
        if spec:
            row += ([f"{r.tokens_per_pass:.2f}", f"{r.target_passes:.0f}", f"{r.draft_s:.3f}",
                     f"{r.verify_s:.3f}"] if r.speculative else [""] * 4)
        t.add_row(*row)
    return t
