"""What the native CPU decode ops (slipstream.native, model.cpu_native) change in the decode
logits: the default model decodes a text token by token (one-token steps, the path the native
ops serve) at precision "fast" with them on and off, and both are compared with precision
"exact" (float32 dense weights) on the same tokens: mean KL divergence of the next-token
distribution, top-1 agreement, and the perplexity of the text under each.

The 4-bit layers go through each packed kind in turn: int4pack (torch's int4 kernel, bfloat16
scales; the Q8_0 head int4pair) and, where the native library builds, q4vnni (and q8vnni for the
head) with 8- and with 16-bit activations (weights.cpu_packed.Q4VNNI_ACT_BITS).

    PYTHONPATH=src python bench/cpu_native_kl.py --tokens 512 \\
        --out bench/results/DATE-cpu-native-kl
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import os  # noqa: E402

import slipstream  # noqa: E402
from slipstream.weights import cpu_packed  # noqa: E402
from slipstream.model import llama  # noqa: E402
from slipstream.hub.pull import pull_default  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "prose.txt"


def decode_logits(model, ids: list[int], native: bool) -> torch.Tensor:
    llama.CPU_NATIVE = native
    engine = model.engine
    engine.reset()
    rows = [engine.decode(torch.tensor([t])).float().clone() for t in ids]
    return torch.cat(rows)


def compare(logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> dict:
    logp, ref_logp = logits.log_softmax(-1), ref.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    nxt = torch.tensor(ids[1:])
    nll = -logp[:-1].gather(1, nxt[:, None]).mean()
    return {"mean_kl": float(kl.mean()), "top1_agreement": float(
        (logits.argmax(-1) == ref.argmax(-1)).float().mean()), "perplexity": math.exp(nll)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    path = a.model or str(pull_default(quiet=True))
    ctx = a.tokens + 8
    with torch.inference_mode():
        exact = slipstream.load(path, device="cpu", ctx=ctx, precision="exact")
        ids = exact.tokenize(TEXT.read_text())[:a.tokens]
        ref = decode_logits(exact, ids, native=False)
        exact.close()
        rows = {}
        settings = [("int4pack+int4pair", "0", 16)]
        if cpu_packed.q4vnni_available():
            settings += [("q4vnni+q8vnni 8-bit x", "1", 8), ("q4vnni+q8vnni 16-bit x", "1", 16)]
        for label, on, bits in settings:
            os.environ["SLIPSTREAM_Q4VNNI"] = on
            cpu_packed.Q4VNNI_ACT_BITS = bits
            fast = slipstream.load(path, device="cpu", ctx=ctx, precision="fast")
            rows[f"fast, {label}, torch ops"] = compare(decode_logits(fast, ids, False), ref,
                                                        ids)
            rows[f"fast, {label}, native ops"] = compare(decode_logits(fast, ids, True), ref,
                                                         ids)
            fast.close()
        rows["exact"] = compare(ref, ref, ids)
    doc = {"name": "cpu-native-kl", "model": Path(path).name, "tokens": len(ids),
           "text": TEXT.name, "rows": rows, "device": platform.processor() or "cpu",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": source_revision()}
    lines = [f"CPU decode logits against precision exact, {doc['model']}, {len(ids)} tokens of "
             f"{TEXT.name}, one-token steps ({doc['date']}, {(doc['commit']['commit'] or '')[:10]})",
             "",
             "| setting | mean KL | top-1 agreement | perplexity |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['mean_kl']:.3e} | {100 * v['top1_agreement']:.2f} % | "
              f"{v['perplexity']:.4f} |" for k, v in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    a.out.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
    main()
