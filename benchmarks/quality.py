"""What a lossy setting costs in quality on the default model, on the CPU.

    python benchmarks/quality.py skip [--ks 0,2,4,8] [--no-bench]
    OMP_NUM_THREADS=1 python benchmarks/quality.py packed [--variants ...]
    python benchmarks/quality.py int8 [--archs llama,mistral3,phi3] [--seeds 4,5]

skip: perplexity and speed with K layers skipped. For each K it runs `slipstream perplexity -m
MODEL -f TEXT --ctx CTX --skip-layers K --device cpu` (and, unless --no-bench, `slipstream bench
--skip-layers K` for decode and prefill tok/s) in a subprocess on this checkout's sources, and
records the layers chosen with their cosine similarities, the perplexity and the rates; then
compares the calibration's choice with a measured one (each layer skipped alone, in process).
The perplexities are deterministic; the rates are as good as a shared machine allows (the load
average is recorded around each run). Writes RESULTS/DATE-layer-skip-cpu.json.

packed: what the packed CPU linears (weights.cpu) cost. The default model (Q4_1 matrices,
a Q8_0 tied head) is loaded with precision "exact" (float32 dense weights, bit-identical to the
GGUF dequantizer: the reference), and its layers' linears are swapped for ones built from the
same GGUF bytes: int4pack (torch's int4 kernel, scale and zero in bfloat16), int4pair (Q8_0 on
the same kernel, each 8-bit code as two nibbles), int8pack (per-row int8), q4vnni (the native
loop on the file's codes). The same on the model re-encoded as Q8_0, Q6_K and Q4_K (ffn_down;
the 576-wide matrices fall back to Q8_0), each against its own exact reference, so a mapping's
cost stands apart from the format's; "fast" (float16 dense) for scale. Scored as `slipstream
perplexity` scores (chunks of --ctx tokens, the second half of each scored) on
tests/data/prose.txt and the shipped calibration text, with the mean KL divergence from the
reference's next-token distribution and the top-1 agreement over every position. Writes
RESULTS/DATE-packed-layouts-cpu.json.

int8: what CUDA "fast"'s int8 activations (per block of 32 with one scale, as llama.cpp's q8_1)
cost, emulated on the CPU: every dense linear's input rounded so, the rest at "exact". On the
default model over prose (perplexity as `slipstream perplexity` scores it), and on each
family's tiny random-weight file as the GPU tests write it (6 layers, Q4_K_M, std 0.08) for
several seeds: the perplexity of fixed token ids over 128 decode steps (the second half of
each 64-id window scored, in one context where the GPU test restarts it per window) against
exp(mean KL(exact || int8)) - 1, the perplexity ratio expected on the model's own text. Writes RESULTS/DATE-int8-activations-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

REPO = common.ROOT

PPL_LINE = re.compile(r"perplexity ([0-9.]+) over (\d+) tokens \((\d+) chunks of (\d+)\), "
                      r"([0-9.]+) tok/s")
SKIP_ITEM = re.compile(r"(\d+) \(([-0-9.]+)\)")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, "-m", "slipstream", *args], capture_output=True,
                       text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"slipstream {' '.join(args)} failed:\n{r.stderr}")
    return r


def _skipped(stderr: str) -> dict[int, float]:
    """{layer: similarity} from the CLI's 'skipping layers ...' line (empty for K = 0)."""
    line = next((x for x in stderr.splitlines() if x.startswith("skipping layers")), "")
    return {int(i): float(s) for i, s in SKIP_ITEM.findall(line)}


def skip_run(model: str, text: str, ctx: int, k: int, bench: bool) -> dict:
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


def skip_table(rows: list[dict]) -> Table:
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


# (label, source model, precision, layout of the layers' linears (None: the loader's), layout
# of the head (None: the loader's))
VARIANTS = [("Q4_1 exact (f32 dense)", "q4_1", "exact", None, None),
            ("Q4_1 fast (f16 dense)", "q4_1", "fast", None, None),
            ("Q4_1 int4pack", "q4_1", "exact", "int4pack", None),
            ("Q4_1 int4pack, head int4pair", "q4_1", "exact", "int4pack", "int4pair"),
            ("Q4_1 int4pack, head int8pack", "q4_1", "exact", "int4pack", "int8pack"),
            ("Q4_1 int8pack", "q4_1", "exact", "int8pack", None),
            ("Q8_0 exact (f32 dense)", "q8_0", "exact", None, None),
            ("Q8_0 fast (f16 dense)", "q8_0", "fast", None, None),
            ("Q8_0 int4pair", "q8_0", "exact", "int4pair", None),
            ("Q8_0 int8pack", "q8_0", "exact", "int8pack", None),
            ("Q6_K/Q8_0 exact (f32 dense)", "q6_k", "exact", None, None),
            ("Q6_K/Q8_0 auto", "q6_k", "exact", "auto", None),
            ("Q4_K/Q8_0 exact (f32 dense)", "q4_k", "exact", None, None),
            ("Q4_K/Q8_0 auto", "q4_k", "exact", "auto", None),
            ("Q4_K/Q8_0 q4vnni", "q4_k", "exact", "q4vnni", None)]
# How each source is made from the model: (type, fallback for rows that are not whole blocks)
SOURCES = {"q8_0": ("Q8_0", None),
           # K-quant blocks are 256 wide: only ffn_down (1536 wide) takes Q6_K, the 576-wide
           # matrices fall back to Q8_0, as llama.cpp's quantizer would do
           "q6_k": ("Q6_K", "Q8_0"),
           # Q4_K onto int4pack (scale and min rounded to bfloat16): ffn_down again, with the
           # 576-wide matrices in Q8_0 (int4pair, whose cost the Q8_0 rows measure alone)
           "q4_k": ("Q4_K", "Q8_0")}


def packed__meta() -> dict:
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def swap_linears(model, kind: str) -> dict:
    """Replace every layer's linears of a loaded CPU model by cpu_packed ones of `kind`, built
    from the model's own GGUF bytes. The layer objects are the ones the model's resident store
    hands to the forward pass, so changing their fields changes what it multiplies by. A group
    (q/k/v, gate/up) stays fused where pack_group fuses it; the head is left as loaded."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.model.families import spec_for
    from slipstream.weights.cpu import pack_group
    from slipstream.weights.loader import TensorSource

    engine = model.engine
    cfg = engine.cfg
    gf = GGUFFile(model.path)
    src = TensorSource(gf)
    spec = spec_for(cfg.architecture)
    shapes = spec.shapes(cfg)
    counts: dict[str, int] = {}
    nbytes = 0
    for i, layer in enumerate(engine.weights.layers):
        for group in spec.linears:
            names = [f"blk.{i}.{p}" for p in group.parts]
            sh = [shapes[f"{p}.weight"] for p in group.parts]
            raws = [src.raw(f"{n}.weight", s) for n, s in zip(names, sh)]
            types = [src.type_of(f"{n}.weight") for n in names]
            biases = [src.dense(f"{n}.bias", (s[0],), torch.float32, torch.device("cpu"))
                      if src.has(f"{n}.bias") else None for n, s in zip(names, sh)]
            fused, parts = pack_group(raws, types, sh, biases, kind)
            built = [fused] if fused is not None else parts
            if any(p is None for p in built):
                raise SystemExit(f"layer {i} {group.field}: {kind} reads none of {types}")
            for lin in built:
                key = f"{lin.kind} ({'+'.join(sorted({t.name for t in types}))})"
                counts[key] = counts.get(key, 0) + 1
                nbytes += lin.nbytes
            if len(group.parts) > 1:  # the block uses the fused field when it is set
                setattr(layer, group.field, fused)
                for p, lin in zip(group.parts, parts or [None] * len(group.parts)):
                    setattr(layer, p, lin)
            else:
                setattr(layer, group.parts[0], fused)
    gf.close()
    return {"layouts": counts, "layer_linear_bytes": nbytes}


def swap_head(model, kind: str) -> dict:
    """The output head (the tied embedding here) as a cpu_packed linear of `kind`."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.model.layer_spec import head_tensor_name
    from slipstream.weights.cpu import pack_linear
    from slipstream.weights.loader import TensorSource

    cfg = model.engine.cfg
    gf = GGUFFile(model.path)
    src = TensorSource(gf)
    name = head_tensor_name(gf.tensors)
    shape = (cfg.vocab_size, cfg.hidden)
    lin = pack_linear(src.raw(name, shape), src.type_of(name), shape, kind=kind)
    if lin is None:
        raise SystemExit(f"head {name}: {kind} does not read {src.type_of(name).name}")
    model.engine.weights.output = lin  # the engine calls weights.output(h) for the logits
    gf.close()
    return {"head": f"{lin.kind} ({src.type_of(name).name})", "head_bytes": lin.nbytes}


def score(model, text: str, ctx: int) -> tuple[float, int, torch.Tensor]:
    """(summed NLL, scored tokens, every position's logits) as runtime.perplexity scores."""
    from slipstream.runtime.perplexity import perplexity

    tokens = model.tokenize(text, add_special=True, parse_special=False)
    bos = model.tokenizer.bos_id if tokens and tokens[0] == model.tokenizer.bos_id else None
    kept: list[torch.Tensor] = []

    def logits(ids):
        out = model.logits(ids)
        kept.append(out.float())
        return out

    r = perplexity(logits, tokens, ctx, bos_id=bos)
    return r.nll * r.scored_tokens, r.scored_tokens, torch.cat(kept)


def _texts(names: list[str]) -> dict[str, str]:
    out = {}
    for t in names:
        if t == "calibration":
            from slipstream.runtime.layer_skip import calibration_text

            out["calibration"] = calibration_text()
        else:
            out[Path(t).name] = Path(t).read_text(encoding="utf-8")
    return out


def packed_run(a: argparse.Namespace) -> dict:
    import slipstream
    from slipstream.hub.pull import pull
    from slipstream.quant.requantize import requantize

    src = Path(a.model) if a.model else pull(quiet=True)
    texts = _texts(a.text)
    variants = [v for v in VARIANTS if not a.variants or v[0] in a.variants]
    tmp = tempfile.TemporaryDirectory()
    paths = {"q4_1": src}
    for source, (qtype, fallback) in SOURCES.items():
        if any(v[1] == source for v in variants):
            paths[source] = Path(tmp.name) / f"{src.stem}.{qtype}.gguf"
            t0 = time.perf_counter()
            requantize(src, paths[source], qtype, fallback=fallback)
            print(f"requantized to {qtype} (fallback {fallback}) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    refs: dict[str, dict[str, torch.Tensor]] = {}  # source -> text -> the exact logits
    rows = []
    for label, source, precision, kind, head in variants:
        t0 = time.perf_counter()
        model = slipstream.load(paths[source], device="cpu", precision=precision,
                                ctx=max(a.ctx, 256))
        row: dict = {"variant": label, "source": source, "precision": precision, "kind": kind}
        if kind is not None:
            row.update(swap_linears(model, kind))
        if head is not None:
            row.update(swap_head(model, head))
        row["load_s"] = round(time.perf_counter() - t0, 2)
        if kind is None and precision == "exact":
            refs.setdefault(source, {})
        ref = refs.get(source)
        nll_all, n_all = 0.0, 0
        row["texts"] = {}
        t0 = time.perf_counter()
        for name, text in texts.items():
            nll, n, logits = score(model, text, a.ctx)
            nll_all, n_all = nll_all + nll, n_all + n
            v = {"perplexity": math.exp(nll / n), "scored_tokens": n,
                 "positions": int(logits.shape[0])}
            if ref is not None:
                r = ref.setdefault(name, logits)  # the first variant of a source is its ref
                lp_r, lp = torch.log_softmax(r.double(), -1), torch.log_softmax(logits.double(), -1)
                v["kl_vs_exact_mean"] = float((lp_r.exp() * (lp_r - lp)).sum(-1).mean())
                v["top1_agree_vs_exact"] = float((r.argmax(-1) == logits.argmax(-1))
                                                 .float().mean())
                v["max_abs_logit_diff_vs_exact"] = float((r - logits).abs().max())
            row["texts"][name] = v
        row["score_s"] = round(time.perf_counter() - t0, 2)
        row["perplexity"] = math.exp(nll_all / n_all)
        row["scored_tokens"] = n_all
        rows.append(row)
        model.close()
        print(f"{label}: ppl {row['perplexity']:.4f} over {n_all} tokens "
              f"(load {row['load_s']} s, score {row['score_s']} s)", flush=True)
    tmp.cleanup()
    base = {r["source"]: r for r in rows if r["kind"] is None and r["precision"] == "exact"}
    for r in rows:
        b = base.get(r["source"])
        if b is not None:
            r["ppl_change_vs_exact_pct"] = round(100 * (r["perplexity"] / b["perplexity"] - 1), 4)
    return {**packed__meta(), "what": "perplexity cost of weights.cpu layouts",
            "model": str(src),
            "sources": {"q4_1": "the model as shipped (Q4_1 matrices, Q8_0 tied head)",
                        "q8_0": "quant.requantize(model, Q8_0): every matrix",
                        "q6_k": "quant.requantize(model, Q6_K, fallback=Q8_0): ffn_down Q6_K, "
                                "the 576-wide matrices Q8_0",
                        "q4_k": "quant.requantize(model, Q4_K, fallback=Q8_0): ffn_down Q4_K, "
                                "the 576-wide matrices Q8_0"},
            "texts": list(texts), "ctx": a.ctx,
            "tokens_evaluated": sum(v["positions"] for v in rows[0]["texts"].values()),
            "tokens_scored": rows[0]["scored_tokens"], "results": rows}


def packed_table(doc: dict) -> Table:
    t = Table(title=f"{Path(doc['model']).name} on the CPU: perplexity over "
                    f"{doc['tokens_scored']} scored tokens ({', '.join(doc['texts'])}; ctx "
                    f"{doc['ctx']}); KL and top-1 over all {doc['tokens_evaluated']} positions, "
                    f"against the same file's exact (float32) weights")
    for c in ("variant", "layers' linears", "head", "perplexity", "vs exact", "mean KL",
              "top-1 agree", "linear MB"):
        t.add_column(c, justify="left" if c in ("variant", "layers' linears", "head")
                     else "right")
    for r in doc["results"]:
        tx = list(r["texts"].values())
        n = sum(v["positions"] for v in tx)
        kl = sum(v.get("kl_vs_exact_mean", 0) * v["positions"] for v in tx) / n
        top1 = sum(v.get("top1_agree_vs_exact", 0) * v["positions"] for v in tx) / n
        t.add_row(r["variant"], ", ".join(f"{k} x{v}" for k, v in r.get("layouts", {}).items())
                  or f"DenseLinear ({'float32' if r['precision'] == 'exact' else 'float16'})",
                  r.get("head", "as loaded"), f"{r['perplexity']:.4f}",
                  f"{r.get('ppl_change_vs_exact_pct', 0):+.3f}%", f"{kl:.2e}", f"{top1:.4f}",
                  f"{r['layer_linear_bytes'] / 1e6:.1f}" if "layer_linear_bytes" in r else "")
    return t

def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the int8 GEMV quantizes it: per block of 32, scale max|x| / 127."""
    blocks = x.float().reshape(-1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(1e-30)), 0)
    return (q * scale).reshape(x.shape).to(x.dtype)


def int8_run(a: argparse.Namespace) -> dict:
    import slipstream
    from slipstream.hub.pull import pull
    from slipstream.runtime.perplexity import perplexity
    from slipstream.synth import write_synth
    from slipstream.weights import linear

    plain = linear.DenseLinear.__call__

    def rounded(self, x, residual=None):
        return plain(self, _int8_rounded(x) if x.shape[-1] % 32 == 0 else x, residual)

    def logits_both(path, ids, one_at_a_time):
        out = []
        for fn in (plain, rounded):
            linear.DenseLinear.__call__ = fn
            try:
                with slipstream.load(path, device="cpu", ctx=max(256, len(ids) + 1),
                                     precision="exact") as m:
                    out.append(m.logits(ids, one_at_a_time=one_at_a_time).double())
            finally:
                linear.DenseLinear.__call__ = plain
        return out

    def costs(exact, rounded_, ids, ctx):
        lp, lq = exact.log_softmax(-1), rounded_.log_softmax(-1)
        kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
        # the GPU test's perplexity: chunks of ctx ids, the second half of each scored
        nll = []
        for lg in (lp, lq):
            total, n = 0.0, 0
            for c in range(len(ids) // ctx):
                for t in range(c * ctx + ctx // 2, (c + 1) * ctx - 1):
                    total -= float(lg[t, ids[t + 1]])
                    n += 1
            nll.append(total / n)
        return {"ppl_of_ids_change_pct": 100 * math.expm1(nll[1] - nll[0]),
                "expected_ppl_change_pct": 100 * math.expm1(kl), "mean_kl": kl}

    rows = []
    model = Path(a.model) if a.model else pull(quiet=True)
    with slipstream.load(model, device="cpu", precision="exact") as m:
        text_ids = m.tokenize(Path(a.text).read_text(encoding="utf-8"), add_special=True)
    chunk, ids = 256, text_ids[:1024]
    for name, fn in (("exact", plain), ("int8", rounded)):
        linear.DenseLinear.__call__ = fn
        try:
            with slipstream.load(model, device="cpu", ctx=chunk, precision="exact") as m:
                rows.append({"file": model.name, "text": Path(a.text).name, "variant": name,
                             "perplexity": perplexity(m.logits, ids, chunk, max_chunks=4).ppl})
        finally:
            linear.DenseLinear.__call__ = plain
    real = {"file": model.name, "text": Path(a.text).name,
            "ppl_change_pct": 100 * (rows[1]["perplexity"] / rows[0]["perplexity"] - 1),
            "perplexity_exact": rows[0]["perplexity"], "perplexity_int8": rows[1]["perplexity"]}
    ids = list(range(5, 1000, 7))[:128]
    synthetic = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.archs.split(","):
            for seed in (int(s) for s in a.seeds.split(",")):
                path = write_synth(Path(tmp) / f"{arch}-{seed}.gguf", "tiny", "Q4_K_M",
                                   n_layers=6, arch=arch, from_floats=True, std=0.08, seed=seed)
                exact, rounded_ = logits_both(path, ids, True)
                synthetic.append({"arch": arch, "seed": seed, **costs(exact, rounded_, ids, 64)})
    return {"what": "int8 activations (per block of 32, CUDA fast's and llama.cpp's q8_1) "
            "emulated on the CPU at precision exact: the default model's perplexity of prose "
            "(1024 tokens, 4 chunks of 256), and on tiny random-weight family files the "
            "perplexity of fixed ids (128 decode steps in one context, the second half of each "
            "64-id window scored) "
            "against exp(mean KL) - 1", "real_model": real, "synthetic": synthetic}


def int8_table(doc: dict) -> Table:
    t = Table(title="int8 activations emulated on the CPU (perplexity change, %)")
    for col in ("file", "seed", "ppl of fixed ids", "expected (exp KL - 1)"):
        t.add_column(col, justify="left" if col == "file" else "right")
    r = doc["real_model"]
    t.add_row(f"{r['file']} on {r['text']}", "-", f"{r['ppl_change_pct']:+.3f}", "-")
    for s in doc["synthetic"]:
        t.add_row(f"{s['arch']} tiny", str(s["seed"]), f"{s['ppl_of_ids_change_pct']:+.3f}",
                  f"{s['expected_ppl_change_pct']:+.3f}")
    return t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(common.RESULTS), help="where the JSON goes")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("skip", help="perplexity and speed with K layers skipped")
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("-f", "--file", default=str(REPO / "tests/data/prose.txt"))
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--ks", default="0,2,4,8", help="comma-separated K values (first: baseline)")
    p.add_argument("--no-bench", action="store_true", help="perplexity only, no tok/s bench")
    p.add_argument("--no-oracle", action="store_true", help="leave out the comparison with a "
                   "measured choice (each layer skipped alone, in process)")
    q = sub.add_parser("packed", help="the packed CPU layouts' perplexity and KL")
    q.add_argument("-m", "--model", help="GGUF (default: the default model)")
    q.add_argument("--text", nargs="+", default=[str(REPO / "tests/data/prose.txt"),
                                                 "calibration"],
                   help="files, or 'calibration' for the text shipped with the package")
    q.add_argument("--ctx", type=int, default=128)
    q.add_argument("--variants", nargs="*", help="labels from VARIANTS (default: all)")
    i8 = sub.add_parser("int8", help="CUDA fast's int8 activations, emulated on the CPU")
    i8.add_argument("-m", "--model", help="GGUF (default: the default model)")
    i8.add_argument("--text", default=str(REPO / "tests/data/prose.txt"))
    i8.add_argument("--archs", default="llama,mistral3,phi3,qwen3")
    i8.add_argument("--seeds", default="4,5")
    a = ap.parse_args(argv)
    head = common.provenance("cpu")
    if a.cmd == "int8":
        doc = int8_run(a)
        Console(width=160).print(int8_table(doc))
        print(f"wrote {common.write_result('int8-activations', {**head, **doc}, a.results)}")
        return
    if a.cmd == "packed":
        doc = packed_run(a)
        Console(width=200).print(packed_table(doc))
        print(f"wrote {common.write_result('packed-layouts', {**head, **doc}, a.results)}")
        return
    if a.model is None:
        from slipstream.hub.pull import pull

        a.model = str(pull(quiet=True))
    ks = [int(k) for k in a.ks.split(",")]
    rows = [skip_run(a.model, a.file, a.ctx, k, not a.no_bench) for k in ks]
    measured = None if a.no_oracle else oracle(a.model, a.file, a.ctx, ks)
    doc = {**head, "what": "perplexity and speed with K layers skipped (the K layers of highest "
           "input/output cosine similarity on the shipped calibration text, never the first or "
           "last)", "model": a.model, "text": os.path.relpath(a.file, REPO),
           "threads": torch.get_num_threads(), "rows": rows, "cosine_vs_measured_choice": measured}
    console = Console(width=160)
    console.print(skip_table(rows))
    if measured is not None:
        console.print(oracle_table(measured))
    print(f"wrote {common.write_result('layer-skip', doc, a.results)}")


if __name__ == "__main__":
    main()
