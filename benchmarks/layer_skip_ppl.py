"""What layer skip costs: perplexity and speed of the default model with K layers skipped.

For each K it runs `slipstream perplexity -m MODEL -f TEXT --ctx CTX --skip-layers K --device
cpu` (and, unless --no-bench, `slipstream bench --skip-layers K` for decode and prefill tok/s)
in a subprocess on this checkout's sources, and records the layers chosen with their cosine
similarities (the calibration runs at load, in passes of --ctx tokens), the perplexity and the
rates. The machine may be shared: the load average is recorded before and after each run, and
the rates are only as good as it allows; the perplexities are deterministic.

    python bench/layer_skip_ppl.py --out bench/results/2026-11-30-layer-skip-ppl-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # this checkout's slipstream, whatever is pip-installed

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from slipstream.provenance import source_revision  # noqa: E402

PPL_LINE = re.compile(r"perplexity ([0-9.]+) over (\d+) tokens \((\d+) chunks of (\d+)\), "
                      r"([0-9.]+) tok/s")
SKIP_ITEM = re.compile(r"(\d+) \(([-0-9.]+)\)")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, "-m", "slipstream.cli", *args], capture_output=True,
                       text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"slipstream {' '.join(args)} failed:\n{r.stderr}")
    return r


def _skipped(stderr: str) -> dict[int, float]:
    """{layer: similarity} from the CLI's 'skipping layers ...' line (empty for K = 0)."""
    line = next((x for x in stderr.splitlines() if x.startswith("skipping layers")), "")
    return {int(i): float(s) for i, s in SKIP_ITEM.findall(line)}


def run(model: str, text: str, ctx: int, k: int, bench: bool) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = _cli("perplexity", "-m", model, "-f", text, "--ctx", str(ctx), "--device", "cpu",
             "--skip-layers", str(k))
    wall = time.perf_counter() - t0
    m = PPL_LINE.search(r.stdout)
    if m is None:
        raise SystemExit(f"no perplexity line in: {r.stdout!r}")
    skipped = _skipped(r.stderr)
    row = {"k": k, "skipped_layers": sorted(skipped),
           "similarities": [skipped[i] for i in sorted(skipped)],
           "perplexity": float(m.group(1)), "scored_tokens": int(m.group(2)),
           "chunks": int(m.group(3)), "ctx": int(m.group(4)),
           "ppl_tok_s": float(m.group(5)), "ppl_wall_s": round(wall, 2)}
    if bench:
        b = _cli("bench", "-m", model, "--device", "cpu", "--pp", "128", "--tg", "64",
                 "--reps", "3", "--skip-layers", str(k), "--json", "-")
        doc = json.loads(b.stdout[b.stdout.index("{"):])
        rates = {x["test"]: round(x["tok_s"], 1) for x in doc["results"]}
        row.update(decode_tg64_tok_s=rates["tg64"], prefill_pp128_tok_s=rates["pp128"],
                   weight_bytes_per_token=doc["weight_bytes_per_token"])
    row["loadavg_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return row


def _ppl(model, text: str, ctx: int) -> float:
    """Perplexity of text as `slipstream perplexity` measures it (cli.cmd_perplexity)."""
    from slipstream.runtime.perplexity import perplexity

    tokens = model.tokenize(text, add_special=True, parse_special=False)
    bos = model.tokenizer.bos_id if tokens and tokens[0] == model.tokenizer.bos_id else None
    return perplexity(model.logits, tokens, ctx, bos_id=bos).ppl


def oracle(model_path: str, text: str, ctx: int, ks: list[int]) -> dict:
    """Is cosine similarity a good proxy? Skip each layer alone and measure the perplexity of
    the calibration text (not the evaluation text); the K layers that cost least alone are a
    measured choice to set against the cosine one, on the evaluation text."""
    import slipstream
    from slipstream.runtime.layer_skip import calibrate, calibration_text, choose

    model = slipstream.load(model_path, device="cpu", ctx=ctx)
    engine = model.engine
    calib = calibration_text()
    sims = calibrate(engine, model.tokenize(calib))
    n = len(sims)
    alone = {}
    for i in range(1, n - 1):
        engine.skip = {i}
        alone[i] = _ppl(model, calib, ctx)
    engine.skip = frozenset()
    base = _ppl(model, calib, ctx)
    eval_text = Path(text).read_text(encoding="utf-8")
    rows = []
    for k in ks:
        if k == 0:
            continue
        measured = sorted(sorted(alone, key=alone.get)[:k])
        engine.skip = measured
        ppl_measured = _ppl(model, eval_text, ctx)
        cosine = sorted(choose(sims, k=k))
        engine.skip = cosine
        rows.append({"k": k, "cosine_layers": cosine, "cosine_ppl": _ppl(model, eval_text, ctx),
                     "measured_layers": measured, "measured_ppl": ppl_measured})
    engine.skip = frozenset()
    model.close()

    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0] * len(xs)
        for pos, j in enumerate(order):
            r[j] = pos
        return r

    mid = list(range(1, n - 1))
    a, b = ranks([-sims[i] for i in mid]), ranks([alone[i] for i in mid])
    m = len(mid)
    spearman = 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (m * (m * m - 1))
    return {"similarities": [round(x, 5) for x in sims],
            "calibration_ppl": round(base, 4),
            "calibration_ppl_skipping_each_layer_alone": {str(i): round(v, 4)
                                                          for i, v in alone.items()},
            "spearman_similarity_vs_cost_alone": round(spearman, 3),
            # the reference engine's rule: skip every layer at or above 0.98
            "threshold_0.98_would_skip": sorted(choose(sims, threshold=0.98)),
            "rows": rows}


def table(rows: list[dict]) -> Table:
    t = Table(title="layer skip on the CPU: what K skipped layers cost")
    cols = ["K", "skipped layers (cosine similarity)", "perplexity", "vs K=0", "ppl tok/s"]
    if "decode_tg64_tok_s" in rows[0]:
        cols += ["decode tok/s", "prefill tok/s"]
    for c in cols:
        t.add_column(c, justify="left" if c.startswith("skipped") else "right")
    base = rows[0]["perplexity"]
    for r in rows:
        layers = ", ".join(f"{i} ({s:.4f})" for i, s in zip(r["skipped_layers"],
                                                             r["similarities"])) or "-"
        cells = [str(r["k"]), layers, f"{r['perplexity']:.4f}",
                 f"{r['perplexity'] / base - 1:+.1%}", f"{r['ppl_tok_s']:.1f}"]
        if "decode_tg64_tok_s" in r:
            cells += [f"{r['decode_tg64_tok_s']:.1f}", f"{r['prefill_pp128_tok_s']:.1f}"]
        t.add_row(*cells)
    return t


def oracle_table(m: dict) -> Table:
    t = Table(title="cosine choice against a measured one (the K layers whose skipping alone "
                    "costs the calibration text least)",
              caption=f"Spearman rank correlation of similarity and cost alone: "
                      f"{m['spearman_similarity_vs_cost_alone']}; a 0.98 threshold would skip "
                      f"{m['threshold_0.98_would_skip'] or 'nothing'}")
    for c in ("K", "cosine layers", "perplexity", "measured layers", "perplexity "):
        t.add_column(c, justify="left" if "layers" in c else "right")
    for r in m["rows"]:
        t.add_row(str(r["k"]), ", ".join(map(str, r["cosine_layers"])), f"{r['cosine_ppl']:.4f}",
                  ", ".join(map(str, r["measured_layers"])), f"{r['measured_ppl']:.4f}")
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("-f", "--file", default=str(REPO / "tests/data/prose.txt"))
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--ks", default="0,2,4,8", help="comma-separated K values (first: baseline)")
    p.add_argument("--no-bench", action="store_true", help="perplexity only, no tok/s bench")
    p.add_argument("--no-oracle", action="store_true", help="skip the comparison with a "
                   "measured choice (each layer skipped alone, in process)")
    p.add_argument("--note", default=None, help="recorded in the JSON as is")
    p.add_argument("--out", required=True, help="JSON file; the table goes to stdout and to "
                   "the same name with .txt")
    a = p.parse_args()
    if a.model is None:
        from slipstream.hub.pull import pull

        a.model = str(pull(quiet=True))
    ks = [int(k) for k in a.ks.split(",")]
    rows = [run(a.model, a.file, a.ctx, k, not a.no_bench) for k in ks]
    measured = None if a.no_oracle else oracle(a.model, a.file, a.ctx, ks)
    rev = source_revision()
    doc = {"what": "perplexity and speed with K layers skipped (runtime.layer_skip: the K "
                   "layers of highest input/output cosine similarity on the shipped "
                   "calibration text, never the first or last)",
           "model": a.model, "text": os.path.relpath(a.file, REPO), "device": "cpu",
           "threads": torch.get_num_threads(), "commit": rev["commit"], "tree": rev["tree"],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
           "cosine_vs_measured_choice": measured, "note": a.note}
    out = Path(a.out)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    with out.with_suffix(".txt").open("w") as f:  # the printed tables, next to the JSON
        for console in (Console(width=160), Console(file=f, width=160)):
            console.print(table(rows))
            if measured is not None:
                console.print(oracle_table(measured))


if __name__ == "__main__":
    main()
