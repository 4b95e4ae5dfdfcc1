"""How often a draft's 8 best hold the target's top token over a prompt's last positions (the
speculative sizer's first evidence, speculative.sizing.PROMPT_POSITIONS), on CPU: the default
model's Q8_0 requantization as target against its Q4_0 and Q2_K copies, on prose, code, noise
and facts, and whether the sizer would give the draft up before its first tree.

    python bench/spec_prompt_agreement.py [--out bench/results/DATE-sNN-spec-prompt-agreement.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import slipstream  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.hub.pull import pull_default  # noqa: E402
from slipstream.quant.requantize import requantize  # noqa: E402
from slipstream.speculative.sizing import PROMPT_POSITIONS, TreeSizer  # noqa: E402
from slipstream.speculative.rounds import DEFAULT_TOP_K, prompt_agreement  # noqa: E402

PROMPTS = {
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "noise": "xq zv 9k pl mm 0r tt qq ww ee rr yy uu ii oo pp aa ss dd ff gg hh jj kk ll",
    "facts": "The capital of France is Paris. The capital of Germany is Berlin. The capital of "
             "Italy is",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/slipstream-agreement")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = pull_default(quiet=True)
    files = {}
    for q in ("Q8_0", "Q4_0", "Q2_K"):
        files[q] = work / f"default-{q}.gguf"
        if not files[q].exists():  # K-quants want rows of 256: 576-wide matrices go Q4_0
            requantize(src, files[q], q, fallback="Q4_0" if q == "Q2_K" else None)
    rows = []
    with slipstream.load(files["Q8_0"], device="cpu", ctx=512) as target:
        for q in ("Q4_0", "Q2_K"):
            with slipstream.load(files[q], device="cpu", ctx=512) as draft:
                for name, text in PROMPTS.items():
                    ids = target.tokenize(text)
                    last = min(len(ids), PROMPT_POSITIONS)
                    target.engine.reset()
                    draft.engine.reset()
                    hits, trials = prompt_agreement(target.engine.forward(ids, last=last),
                                                    draft.engine.forward(ids, last=last),
                                                    DEFAULT_TOP_K)
                    sizer = TreeSizer()
                    sizer.observe_prompt(hits, trials)
                    rows.append({"target": "default Q8_0", "draft": f"default {q}",
                                 "prompt": name, "hits": hits, "trials": trials,
                                 "gives_up": sizer.prompt_says_no})
    print(f"{'draft':14s} {'prompt':7s} {'hits':>5s} {'of':>4s}  sizer")
    for r in rows:
        print(f"{r['draft']:14s} {r['prompt']:7s} {r['hits']:5d} {r['trials']:4d}  "
              f"{'gives up' if r['gives_up'] else 'keeps'}")
    doc = {"what": "top-8 agreement over the prompt's last positions (the sizer's first "
                   "evidence)", "top_k": DEFAULT_TOP_K, "positions": PROMPT_POSITIONS,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
