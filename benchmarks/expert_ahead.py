"""Pre-gating read-ahead of a CPU mixture of experts' cold experts (weights.expert_ahead):
how often layer i's guess of layer i+1's experts is right, and what it does to decode.

For each file (make them with `slipstream synth --shape 30b-a3b --arch qwen3moe --layers 4`,
with and without `--expert-skew`), one CPU load at a RAM budget holding the dense part and
half of every layer's experts; then, rounds of greedy generations of the same prompt with the
read-ahead off, guessing at each layer's input and after its attention (rewired on the same
load, in turn, so the held experts are the same), with the file's pages dropped from the
page cache before each run (posix_fadvise DONTNEED: no root needed; a cold expert then comes
from the disk) or left in it. Per mode: decode tok/s (median of the rounds), cold routed
experts (misses), the share of them read ahead (the guess's hit rate), misses left, experts
read ahead and wasted.

    python benchmarks/expert_ahead.py /tmp/moe4-skew.gguf /tmp/moe4-uni.gguf --case expert-ahead
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import slipstream  # noqa: E402
from slipstream.errors import BudgetTooSmall  # noqa: E402
from slipstream.weights.expert_ahead import wire  # noqa: E402

MODES = ("off", "input", "attention")
CTX = 512


def half_budget(path: Path) -> int:
    """The dense part's bytes (BudgetTooSmall at a 1-byte budget names them) plus half of
    every layer's experts."""
    try:
        slipstream.plan(path, device="cpu", ctx=CTX, measure=False,
                        placement=slipstream.Placement(ram_budget=1))
    except BudgetTooSmall as e:
        need = int(re.search(r"\(1 < (\d+) bytes", str(e)).group(1))
    plan = slipstream.plan(path, device="cpu", ctx=CTX, measure=False,
                           placement=slipstream.Placement(ram_budget=need))
    return need + len(plan.tiers) * (plan.n_experts // 2) * plan.expert_bytes


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def prompt_of(seed: int, n: int, vocab: int) -> list[int]:
    """n token ids drawn at random (seeded): each round's own prompt, so that its routing is
    not the one the banks have just moved into RAM."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def snapshot(banks: list) -> list:
    """Each bank's held experts and use counts, to start every run from the same state: a
    run moves the experts its tokens used into RAM, which would favour the mode run next."""
    return [(dict(b.held), list(b.uses), b._rows) for b in banks]


def restore(banks: list, snap: list) -> None:
    for b, (held, uses, rows) in zip(banks, snap):
        b.held, b.uses, b._rows = dict(held), list(uses), rows


def one_run(model, seed: int, n_prompt: int, tokens: int, cold: bool) -> dict:
    prompt = prompt_of(seed, n_prompt, model.engine.cfg.vocab_size)
    if cold:
        drop_cache(Path(model.path))
    s = model.engine.layers.stats
    s.reset()
    # sampled (seeded, the same in every mode): a random-weight model's greedy tokens
    # repeat, and so would its routing
    gen = model.generate(prompt, max_tokens=tokens, temperature=1.0, top_k=0, top_p=1.0,
                         min_p=0.0, seed=seed)
    ids = [e.id for e in gen]
    st = gen.stats
    return {"ids": ids, "decode_tok_s": st.decode_tok_s, "prefill_tok_s": st.prefill_tok_s,
            "misses": s.expert_misses, "ram_calls": s.expert_hits,
            "ahead_reads": s.expert_ahead_reads, "ahead_hits": s.expert_ahead_hits,
            "read_wait_s": s.expert_read_s, "extra": dict(st.extra)}


def bench_file(path: Path, rounds: int, tokens: int, prompt_len: int) -> dict:
    budget = half_budget(path)
    model = slipstream.load(path, device="cpu", ctx=CTX,
                            placement=slipstream.Placement(ram_budget=budget))
    layers = model.engine.weights.layers
    one_run(model, 10**6, prompt_len, tokens, False)  # warm: the banks take their most used experts
    banks = [w.moe.experts for w in layers if w.moe is not None]
    snap = snapshot(banks)
    out: dict = {"file": path.name, "bytes": path.stat().st_size, "ram_budget": budget,
                 "expert_slots": model.plan.expert_slots, "n_experts": model.plan.n_experts,
                 "prompt_tokens": prompt_len, "tokens": tokens, "cases": {}}
    for cold in (True, False):
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                wire(model.engine.cfg, layers, mode)
                restore(banks, snap)
                runs[mode].append(one_run(model, r + 100 * cold, prompt_len, tokens, cold))
        case = {}
        misses = [x["misses"] for x in runs["off"]]
        for mode, rs in runs.items():
            assert [x["ids"] for x in rs] == [x["ids"] for x in runs["off"]], \
                f"{mode}: tokens differ from off"
            assert [x["misses"] for x in rs] == misses, f"{mode}: misses differ from off"
            last = {k: sum(x[k] for x in rs) for k in
                    ("misses", "ram_calls", "ahead_reads", "ahead_hits")}
            last["extra"] = rs[-1]["extra"]
            case[mode] = {
                "decode_tok_s": round(statistics.median(x["decode_tok_s"] for x in rs), 3),
                "decode_tok_s_runs": [round(x["decode_tok_s"], 3) for x in rs],
                "prefill_tok_s": round(statistics.median(x["prefill_tok_s"] for x in rs), 2),
                "misses": last["misses"], "ram_calls": last["ram_calls"],
                "ahead_reads": last["ahead_reads"], "ahead_hits": last["ahead_hits"],
                "guess_hit_rate": round(last["ahead_hits"] / last["misses"], 4)
                if last["misses"] else None,
                "misses_left": last["misses"] - last["ahead_hits"],
                "wasted_reads": last["ahead_reads"] - last["ahead_hits"],
                "main_thread_read_wait_s": round(
                    statistics.median(x["read_wait_s"] for x in rs), 4),
                "generation_extra": last["extra"]}
        off = case["off"]["decode_tok_s"]
        for mode in MODES[1:]:
            case[mode]["speedup_over_off"] = round(case[mode]["decode_tok_s"] / off, 3)
        out["cases"]["page_cache_dropped" if cold else "page_cache_warm"] = case
    model.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--case", default="expert-ahead")
    ap.add_argument("--results", type=Path, default=None)
    a = ap.parse_args(argv)
    doc = {**common.provenance("cpu"), "name": "expert-read-ahead",
           "loadavg_before": os.getloadavg(),
           "files": [bench_file(p, a.rounds, a.tokens, a.prompt) for p in a.files],
           "loadavg_after": os.getloadavg()}
    print(common.write_result(a.case, doc, a.results))
    for f in doc["files"]:
        for cache, case in f["cases"].items():
            for mode, c in case.items():
                print(f"{f['file']:<20} {cache:<19} {mode:<9} {c['decode_tok_s']:7.2f} tok/s  "
                      f"misses {c['misses']:5d}  guessed {c['guess_hit_rate']}  "
                      f"wasted {c['wasted_reads']}")


if __name__ == "__main__":
    main()
