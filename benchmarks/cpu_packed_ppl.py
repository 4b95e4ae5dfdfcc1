"""What the packed CPU linears (weights.cpu_packed) cost in perplexity (issue 13: "formats
mapped with rounding are not bit-exact: measure their perplexity cost").

The default model (SmolLM2-135M-Instruct, Q4_1 matrices, a Q8_0 tied head) is loaded on the CPU
with precision "exact" (float32 dense weights, bit-identical to the GGUF dequantizer: the
reference), and its layers' linears are then swapped, in this script, for ones built from the
same GGUF bytes:

    int4pack   Q4_1 -> torch's int4 CPU kernel: scale and zero rounded to bfloat16, and the
               activations and outputs in bfloat16 (the mapping's only rounding)
    int4pair   Q8_0 on the same int4 kernel, each 8-bit code as two nibbles: the block scale
               rounded to bfloat16, as int4pack's
    int8pack   per-row requantization to int8 against one bfloat16 scale per row
    dequant    DequantLinear: the GGUF codes and float32 scales, exact weights

The same is done on the model re-encoded as Q8_0 (`quant.requantize`, every matrix), as Q6_K
and as Q4_K (ffn_down; the 576-wide matrices fall back to Q8_0), with "auto" giving Q6_K
int8pack, Q4_K int4pack and Q8_0 int4pair. Each re-encoding has its own exact reference, so the table separates a mapping's cost
from the format's.
"fast" (float16 dense: today's CPU default) is measured for scale. The head (the tied Q8_0
embedding) stays float32 dense except in the "head ..." variants: it is a fifth of the default
model's weights, so a CPU decode path would pack it too.

Perplexity is scored as `slipstream perplexity` scores it (runtime.perplexity: chunks of --ctx
tokens, each in a fresh context, the second half scored) on tests/data/prose.txt and the
calibration text shipped with the package. A few hundred scored tokens give a perplexity that
is deterministic but covers little text, so the mean KL divergence from the reference's
next-token distribution and the top-1 agreement over every position are kept too.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/cpu_packed_ppl.py \\
        --out bench/results/2026-11-30-s7-cpu-packed-ppl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # this checkout's slipstream, whatever is pip-installed

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

# (label, source model, precision, layout of the layers' linears (None: the loader's), layout
# of the head (None: the loader's))
VARIANTS = [("Q4_1 exact (f32 dense)", "q4_1", "exact", None, None),
            ("Q4_1 fast (f16 dense)", "q4_1", "fast", None, None),
            ("Q4_1 int4pack", "q4_1", "exact", "int4pack", None),
            ("Q4_1 int4pack, head int4pair", "q4_1", "exact", "int4pack", "int4pair"),
            ("Q4_1 int4pack, head int8pack", "q4_1", "exact", "int4pack", "int8pack"),
            ("Q4_1 int8pack", "q4_1", "exact", "int8pack", None),
            ("Q4_1 dequant", "q4_1", "exact", "dequant", None),
            ("Q8_0 exact (f32 dense)", "q8_0", "exact", None, None),
            ("Q8_0 fast (f16 dense)", "q8_0", "fast", None, None),
            ("Q8_0 int4pair", "q8_0", "exact", "int4pair", None),
            ("Q8_0 int8pack", "q8_0", "exact", "int8pack", None),
            ("Q8_0 dequant", "q8_0", "exact", "dequant", None),
            ("Q6_K/Q8_0 exact (f32 dense)", "q6_k", "exact", None, None),
            ("Q6_K/Q8_0 auto", "q6_k", "exact", "auto", None),
            ("Q6_K/Q8_0 dequant", "q6_k", "exact", "dequant", None),
            ("Q4_K/Q8_0 exact (f32 dense)", "q4_k", "exact", None, None),
            ("Q4_K/Q8_0 auto", "q4_k", "exact", "auto", None),
            # hybrid's SLIPSTREAM_HYBRID_KIND=auto-f16: q4vnni with Q4_K's scales and zeros
            # rounded to float16 (5 bits a weight, not 6)
            ("Q4_K/Q8_0 auto-f16", "q4_k", "exact", "auto-f16", None),
            ("Q4_K/Q8_0 dequant", "q4_k", "exact", "dequant", None)]
# How each source is made from the model: (type, fallback for rows that are not whole blocks)
SOURCES = {"q8_0": ("Q8_0", None),
           # K-quant blocks are 256 wide: only ffn_down (1536 wide) takes Q6_K, the 576-wide
           # matrices fall back to Q8_0, as llama.cpp's quantizer would do
           "q6_k": ("Q6_K", "Q8_0"),
           # Q4_K onto int4pack (scale and min rounded to bfloat16): ffn_down again, with the
           # 576-wide matrices in Q8_0 (int4pair, whose cost the Q8_0 rows measure alone)
           "q4_k": ("Q4_K", "Q8_0")}


def _meta() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                                  text=True, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    dirty = git("status", "--porcelain")
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": git("rev-parse", "HEAD"),
            "working_tree_dirty": None if dirty is None else bool(dirty),
            "machine": f"{cpu}, {os.cpu_count()} cores, {platform.machine()}",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def swap_linears(model, kind: str) -> dict:
    """Replace every layer's linears of a loaded CPU model by cpu_packed ones of `kind`, built
    from the model's own GGUF bytes. The layer objects are the ones the model's resident store
    hands to the forward pass, so changing their fields changes what it multiplies by. A group
    (q/k/v, gate/up) stays fused where pack_group fuses it; the head is left as loaded."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.model.layer_spec import spec_for
    from slipstream.weights.cpu_packed import pack_group
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
    from slipstream.weights.cpu_packed import pack_linear
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


def run(a: argparse.Namespace) -> dict:
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
        if a.out:  # a shared machine can end a long run: keep what is done
            Path(a.out + ".partial.json").write_text(json.dumps(rows, indent=1) + "\n")
    tmp.cleanup()
    base = {r["source"]: r for r in rows if r["kind"] is None and r["precision"] == "exact"}
    for r in rows:
        b = base.get(r["source"])
        if b is not None:
            r["ppl_change_vs_exact_pct"] = round(100 * (r["perplexity"] / b["perplexity"] - 1), 4)
    return {**_meta(), "what": "perplexity cost of weights.cpu_packed layouts (issue 13)",
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


def table(doc: dict) -> Table:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the default model)")
    ap.add_argument("--text", nargs="+", default=[str(REPO / "tests/data/prose.txt"),
                                                  "calibration"],
                    help="files, or 'calibration' for the text shipped with the package")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--variants", nargs="*", help="labels from VARIANTS (default: all)")
    ap.add_argument("--note", help="recorded in the JSON as is")
    ap.add_argument("--out", help="path stem: writes STEM.json and STEM.txt")
    a = ap.parse_args()
    doc = run(a)
    if a.note:
        doc["note"] = a.note
    console = Console(width=200, record=True)
    console.print(table(doc))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(a.out + ".txt").write_text(console.export_text())
        Path(a.out + ".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
