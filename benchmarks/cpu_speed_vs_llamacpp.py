"""CPU decode and prefill of the default model against llama.cpp's llama-bench, back to back on
the same machine, alternating (llama.cpp, slipstream, llama.cpp, ...) so that the shared
machine's load falls on both (issue 13's CPU acceptance: decode >= 1.0x, prefill ahead).

    python bench/cpu_speed_vs_llamacpp.py --llama-build /tmp/llama.cpp/build \
        [--threads 2] [--reps 3] [--rounds 2] --out bench/results/DATE-cpu-speed-vs-llamacpp

llama.cpp: `llama-bench -p 512 -n 128` (CPU build of the llama-cpp-python 0.3.36 tree that
../shared/anchors/fetch_llamacpp.sh fetches); slipstream: `slipstream bench --device cpu`
(pp512, tg128). Reuses bench/llamacpp_compare.py's speed(); writes OUT.json and OUT.txt.

--baseline-src DIR (another checkout's src/, e.g. a `git worktree` of an older commit) adds that
tree's `slipstream bench` to every round, right after this tree's, so that a before/after
ratio is measured under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llamacpp_compare import DEFAULT_MODEL, loadavg, speed  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402


def baseline_speed(src: Path, model: Path, reps: int, work: Path) -> dict:
    """`slipstream bench` of the checkout whose package is `src`, as speed() runs this one's."""
    jf = work / "baseline_bench.json"
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-m", "slipstream.cli", "bench", "-m", str(model),
                    "--device", "cpu", "--reps", str(reps), "--json", str(jf)], check=True,
                   capture_output=True, text=True, env=env, cwd=src.parent)
    sj = json.loads(jf.read_text())
    return {"tests": {r["test"]: {"tok_s": r["tok_s"], "tok_s_std": r["tok_s_std"]}
                      for r in sj["results"]},
            "commit": sj.get("commit"), "loadavg_after": loadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-build", type=Path, required=True)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="another checkout's src/, timed after this one in every round")
    a = ap.parse_args()
    model = a.model or DEFAULT_MODEL
    work = Path(tempfile.mkdtemp(prefix="cpu_speed_"))
    rounds = []
    for _ in range(a.rounds):
        r = speed(a.llama_build, model, a.threads, a.reps, work)
        if a.baseline_src is not None:
            r["baseline"] = baseline_speed(a.baseline_src.resolve(), model, a.reps, work)
        rounds.append(r)
    summary = {}
    for test in ("pp512", "tg128"):
        lc = statistics.median(r["llama"][test]["tok_s"] for r in rounds)
        sl = statistics.median(r["slipstream"][test]["tok_s"] for r in rounds)
        summary[test] = {"llama_cpp_tok_s": round(lc, 1), "slipstream_tok_s": round(sl, 1),
                         "ratio": round(sl / lc, 3)}
        if a.baseline_src is not None:
            bl = statistics.median(r["baseline"]["tests"][test]["tok_s"] for r in rounds)
            summary[test].update(baseline_tok_s=round(bl, 1),
                                 baseline_ratio=round(bl / lc, 3),
                                 speedup_over_baseline=round(sl / bl, 3))
    doc = {"name": "cpu-speed-vs-llamacpp", "model": Path(model).name, "threads": a.threads,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "machine": f"{platform.machine()}, {platform.processor() or ''}".strip(", "),
           "summary": summary, "rounds": rounds}
    if a.baseline_src is not None:
        doc["baseline_src"] = str(a.baseline_src)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"CPU speed, {Path(model).name}, {a.threads} threads, {a.rounds} rounds x "
             f"{a.reps} reps, medians over rounds ({doc['date']}, {doc.get('commit', '')[:10]})",
             "", "| test | llama.cpp tok/s | slipstream tok/s | ratio |", "|---|---:|---:|---:|"]
    for test, s in summary.items():
        lines.append(f"| {test} | {s['llama_cpp_tok_s']} | {s['slipstream_tok_s']} | "
                     f"{s['ratio']} |")
    if a.baseline_src is not None:
        base = rounds[0]["baseline"].get("commit") or ""
        lines += ["", f"baseline (before), {a.baseline_src} at {base[:10]}, in the same rounds:",
                  "", "| test | llama.cpp tok/s | baseline tok/s | ratio | this tree / baseline |",
                  "|---|---:|---:|---:|---:|"]
        for test, s in summary.items():
            lines.append(f"| {test} | {s['llama_cpp_tok_s']} | {s['baseline_tok_s']} | "
                         f"{s['baseline_ratio']} | {s['speedup_over_baseline']} |")
    lines.append("")
    for test in summary:  # the spread a shared machine's load leaves, round by round
        who = "llama.cpp / slipstream" + (" / baseline" if a.baseline_src else "")
        lines.append(f"{test} per round, {who}: " + "; ".join(
            f"{r['llama'][test]['tok_s']:.1f} / {r['slipstream'][test]['tok_s']:.1f}"
            + (f" / {r['baseline']['tests'][test]['tok_s']:.1f}" if a.baseline_src else "")
            for r in rounds))
    lines.append("load average per round (before / between / after"
                 + (" / after the baseline" if a.baseline_src else "") + "): " + "; ".join(
        f"{r['loadavg_before']} / {r['loadavg_between']} / {r['loadavg_after']}"
        + (f" / {r['baseline']['loadavg_after']}" if a.baseline_src else "") for r in rounds))
    a.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
