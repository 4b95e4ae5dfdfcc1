"""CPU decode and prefill of the default model against llama.cpp's llama-bench, back to back on
the same machine, alternating (llama.cpp, slipstream, llama.cpp, ...) so that the shared
machine's load falls on both (issue 13's CPU acceptance: decode >= 1.0x, prefill ahead).

    python bench/cpu_speed_vs_llamacpp.py --llama-build /tmp/llama.cpp/build \
        [--threads 2] [--reps 3] [--rounds 2] --out bench/results/DATE-cpu-speed-vs-llamacpp

llama.cpp: `llama-bench -p 512 -n 128` (CPU build of the llama-cpp-python 0.3.36 tree that
../shared/anchors/fetch_llamacpp.sh fetches); slipstream: `slipstream bench --device cpu`
(pp512, tg128). Reuses bench/llamacpp_compare.py's speed(); writes OUT.json and OUT.txt.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llamacpp_compare import DEFAULT_MODEL, speed  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-build", type=Path, required=True)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    model = a.model or DEFAULT_MODEL
    work = Path(tempfile.mkdtemp(prefix="cpu_speed_"))
    rounds = [speed(a.llama_build, model, a.threads, a.reps, work) for _ in range(a.rounds)]
    summary = {}
    for test in ("pp512", "tg128"):
        lc = statistics.median(r["llama"][test]["tok_s"] for r in rounds)
        sl = statistics.median(r["slipstream"][test]["tok_s"] for r in rounds)
        summary[test] = {"llama_cpp_tok_s": round(lc, 1), "slipstream_tok_s": round(sl, 1),
                         "ratio": round(sl / lc, 3)}
    doc = {"name": "cpu-speed-vs-llamacpp", "model": Path(model).name, "threads": a.threads,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "machine": f"{platform.machine()}, {platform.processor() or ''}".strip(", "),
           "summary": summary, "rounds": rounds}
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"CPU speed, {Path(model).name}, {a.threads} threads, {a.rounds} rounds x "
             f"{a.reps} reps, medians over rounds ({doc['date']}, {doc.get('commit', '')[:10]})",
             "", "| test | llama.cpp tok/s | slipstream tok/s | ratio |", "|---|---:|---:|---:|"]
    for test, s in summary.items():
        lines.append(f"| {test} | {s['llama_cpp_tok_s']} | {s['slipstream_tok_s']} | "
                     f"{s['ratio']} |")
    lines.append("")
    for test in summary:  # the spread a shared machine's load leaves, round by round
        lines.append(f"{test} per round, llama.cpp / slipstream: " + "; ".join(
            f"{r['llama'][test]['tok_s']:.1f} / {r['slipstream'][test]['tok_s']:.1f}"
            for r in rounds))
    lines.append("load average per round (before / between / after): " + "; ".join(
        f"{r['loadavg_before']} / {r['loadavg_between']} / {r['loadavg_after']}" for r in rounds))
    a.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
