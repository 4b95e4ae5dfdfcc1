"""The sizer's depth cap on the CPU: the default model's Q8_0 as target, its Q4_0 as draft,
trees sized by the sizer (speculative.sizing) with drafted depths up to 8 (the cap before
session 25) and up to 16 (speculative.rounds.MAX_DEPTH), against plain decoding.

    python bench/spec_depth_cpu.py [--tokens 96] [--out FILE]

Each setting loads the pair afresh (the sizer learns across a model's generations) and
generates from spec_acceptance.py's six prompts, greedy. Reports decode tok/s, tokens per
target pass, the deepest acceptance seen, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

import slipstream  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.hub.pull import pull_default  # noqa: E402
from slipstream.speculative import rounds as speculative  # noqa: E402
from spec_acceptance import PROMPTS, make_file, prompt_ids  # noqa: E402


def generate_all(model, prompts, tokens: int, draft: bool) -> dict:
    out = {"tokens": [], "decode_s": 0.0, "generated": 0, "passes": 0, "hist": []}
    for _, ids in prompts:
        toks = [e.id for e in model.generate(ids, max_tokens=tokens, temperature=0.0,
                                             **({} if draft else {"draft": False}))]
        st = model.last_stats
        out["tokens"].append(toks)
        out["decode_s"] += st.decode_s
        out["generated"] += len(toks) - 1  # the first comes from the prefill
        if draft:
            ex = st.extra
            out["passes"] += int(ex.get("spec_target_passes", 0))
            hist = ex.get("spec_accepted_hist") or []
            out["hist"] = [a + b for a, b in zip(out["hist"] + [0] * len(hist),
                                                 hist + [0] * len(out["hist"]))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--work", default="/tmp/slipstream-spec")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(pull_default())
    target, _ = make_file(src, work, "Q8_0", "Q4_0")
    draft, _ = make_file(src, work, "Q4_0", "Q4_0")
    rows = []
    plain_model = slipstream.load(str(target), device="cpu", ctx=1024)
    prompts = prompt_ids(plain_model)
    plain = generate_all(plain_model, prompts, a.tokens, draft=False)
    plain_model.close()
    rows.append({"setting": "plain", "decode_tok_s": round(plain["generated"] / plain["decode_s"], 2)})
    for cap in (8, 16):
        speculative.MAX_DEPTH = cap
        model = slipstream.load(str(target), device="cpu", ctx=1024, draft=str(draft))
        r = generate_all(model, prompts, a.tokens, draft=True)
        model.close()
        rows.append({"setting": f"sizer, depth up to {cap}",
                     "decode_tok_s": round(r["generated"] / r["decode_s"], 2),
                     "tokens_per_pass": round(r["generated"] / max(r["passes"], 1), 3),
                     "deepest_accepted": max((i for i, n in enumerate(r["hist"]) if n), default=0),
                     "accepted_hist": r["hist"],
                     "greedy_equal_plain": r["tokens"] == plain["tokens"]})
    rev = source_revision()
    doc = {"device": "cpu", "threads": torch.get_num_threads(), "commit": rev["commit"],
           "tree": rev["tree"], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "target": target.name, "draft": draft.name,
           "prompts": [p[0] for p in PROMPTS], "max_tokens": a.tokens, "rows": rows}
    for r in rows:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
