"""CPU streaming: the plan's predicted decode rate against the measured one (the aim:
within 25% at --ram-budget 300MiB).

Each repetition runs, in fresh processes and one after the other (so the shared machine's load
falls on both alike), a run between two predictions, whose mean (seconds per token, part by
part) is the run's predicted rate; each prediction serves the runs on both sides of it:

    predicted  `slipstream info --plan --ram-budget B --device cpu` (api.plan, which it prints):
               the tok/s of its caption, with the parts it sums (compute, head, rebuild, disk;
               "rebuild" is making the streamed layers: views into their packed images at
               precision "fast");
    measured   `slipstream run -m MODEL --ram-budget B --device cpu -n N --stats --temp 0
               --trace FILE`: the decode rate of its summary line (1000 / its ms/tok), the
               run's own prediction (the plan it prints, measured in that process just before
               the load), and from the trace the median decode token's compute and rebuild ms.

Predicted and measured parts sit side by side, so a wrong rate shows as the part it mispredicts.
The probes' rates depend on the process's allocator state and on the machine's load at the
time; see memory.probes.cpu_decode_rates and memory.store.steady_heap.

The medians over the repetitions are compared (ratio = predicted / measured; 1.25 and 0.8 are
the acceptance's bounds), and each repetition's own ratio is listed too.

    python benchmarks/stream_predict.py --reps 5 --out stream-predict-cpu
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.provenance import source_revision  # noqa: E402

PY = sys.executable
PROMPT = "Once upon a time, in a small village by the sea,"  # greedy: 32 tokens, no end

PREDICT = """
import json, sys
from slipstream import api
p = api.plan(sys.argv[1], device="cpu", placement=api.Placement(ram_budget=sys.argv[2]))
parts = p.cpu_token_seconds()
print(json.dumps({"tok_s": p.predicted_tok_s, "parts_s": parts, "gbps": p.bandwidth_gbps,
                  "tiers": {t: p.tiers.count(t) for t in sorted(set(p.tiers))},
                  "head_bytes": p.head_bytes}))
"""

# the run's summary line and --stats rows (README: `... | generated N tok, decode X ms (Y tok/s,
# Z ms/tok) | ...`); the plan's caption: `... = Z ms/token, Y tok/s`, wrapped to the table
SUMMARY = re.compile(r"generated (\d+) tok, decode ([\d.]+) ms \(([\d.]+) tok/s, ([\d.]+) ms/tok\)")
RUN_PREDICTED = re.compile(r"predicted decode:.*?= (\d+) ms/token,\s+([\d.]+) tok/s", re.S)
STATS_ROW = re.compile(r"│ (compute|build streamed layers)\s*│\s*([\d.]+) │")


def predict(model: str, budget: str) -> dict:
    r = subprocess.run([PY, "-c", PREDICT, model, budget], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def bracket(before: dict, after: dict) -> dict:
    """The prediction for a run between two: their mean seconds per token, part by part (the
    probes take a second, the run ten; on a shared machine whose load drifts, the two
    predictions around a run say more about its conditions than either alone)."""
    keys = (before["parts_s"] or {}).keys() & (after["parts_s"] or {}).keys()
    parts = {k: (before["parts_s"][k] + after["parts_s"][k]) / 2 for k in keys}
    token = parts.get("token") or (1 / before["tok_s"] + 1 / after["tok_s"]) / 2
    return {"tok_s": 1 / token, "parts_s": parts or None, "before": before, "after": after}


def measure(model: str, budget: str, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        cmd = [PY, "-m", "slipstream", "run", "-m", model, "--ram-budget", budget, "--device",
               "cpu", "-n", str(tokens), "--stats", "--temp", "0", "-p", PROMPT,
               "--trace", str(trace)]
        env = dict(os.environ, COLUMNS="250")  # one line per table row and caption
        load = os.getloadavg()[0]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        parts = decode_parts(json.loads(trace.read_text())) if r.returncode == 0 else None
    if r.returncode != 0:
        raise SystemExit(f"run exited {r.returncode}: {r.stderr[-800:]}")
    m = SUMMARY.search(r.stderr)
    if m is None:
        raise SystemExit(f"no summary line in: {r.stderr[-800:]}")
    # tok/s from ms/tok, which the line prints with more digits (both count the decode steps
    # after the first token, which the prefill gives)
    out = {"generated": int(m.group(1)), "decode_ms": float(m.group(2)),
           "summary_tok_s": float(m.group(3)), "ms_per_tok": float(m.group(4)),
           "tok_s": round(1e3 / float(m.group(4)), 3),
           "loadavg_1m_before": load, "loadavg_1m_after": os.getloadavg()[0]}
    p = RUN_PREDICTED.search(r.stderr)
    out["run_predicted_tok_s"] = float(p.group(2)) if p else None
    # --stats: ms per token over prefill and decode tokens together (its own title says so)
    out["stats_ms_per_token"] = {k: float(v) for k, v in STATS_ROW.findall(r.stderr)}
    out["trace_decode_ms"] = parts
    return out


def decode_parts(trace: dict) -> dict[str, float]:
    """Median ms per decode token of the trace's compute and rebuild spans, and of the token
    spans themselves (the first token, which holds the prefill, left out)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    tokens = sorted((e for e in events if e["cat"] == "token"), key=lambda e: e["ts"])[1:]
    per: dict[str, list[float]] = {"token": [], "compute": [], "rebuild": []}
    for t in tokens:
        inside = [e for e in events if t["ts"] <= e["ts"] < t["ts"] + t["dur"]]
        per["token"].append(t["dur"] / 1e3)
        for k in ("compute", "rebuild"):
            per[k].append(sum(e["dur"] for e in inside if e["cat"] == k) / 1e3)
    return {k: round(statistics.median(v), 2) for k, v in per.items() if v}


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def summarize(reps: list[dict]) -> dict:
    pred = statistics.median(r["predicted"]["tok_s"] for r in reps)
    meas = statistics.median(r["measured"]["tok_s"] for r in reps)
    own = [r["measured"]["run_predicted_tok_s"] for r in reps
           if r["measured"]["run_predicted_tok_s"]]
    ratios = [r["ratio"] for r in reps]
    return {"predicted_tok_s": round(pred, 3), "measured_tok_s": round(meas, 3),
            "ratio": round(pred / meas, 3), "within_25pct": 0.8 <= pred / meas <= 1.25,
            "run_predicted_tok_s": round(statistics.median(own), 3) if own else None,
            "run_ratio": round(statistics.median(own) / meas, 3) if own else None,
            "rep_ratios": ratios,
            "reps_within_25pct": sum(0.8 <= x <= 1.25 for x in ratios)}


def table(result: dict) -> str:
    s, reps = result["summary"], result["reps"]
    lines = [f"CPU streaming, predicted against measured decode ({result['date']}, "
             f"{(result['commit'] or '?')[:10]}, tree {(result['tree'] or '?')[:10]}, "
             f"{result['machine']['cpu']}, {result['machine']['cores']} cores, "
             f"OMP_NUM_THREADS={result['machine']['omp_num_threads']}, load average "
             f"{result['loadavg_1m']['min']:.1f}-{result['loadavg_1m']['max']:.1f})",
             f"model {Path(result['model']).name}, --ram-budget {result['ram_budget']}, "
             f"-n {result['tokens']}, greedy; {len(reps)} repetitions",
             *([f"note: {result['note']}"] if result.get("note") else []), "",
             "| rep | predicted tok/s (info --plan, before and after) | compute + head ms "
             "| rebuild (views) ms | disk ms | measured tok/s (run) | compute ms "
             "| rebuild (views) ms | run's own prediction | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(reps):
        p, m = r["predicted"], r["measured"]
        parts = p["parts_s"] or {}
        ms = {k: v * 1e3 for k, v in parts.items()}
        own = m["run_predicted_tok_s"]
        tr = m["trace_decode_ms"] or {}
        compute = ms.get("compute", 0) + ms.get("head", 0)
        lines.append(f"| {i + 1} | {p['tok_s']:.2f} | {compute:.0f}"
                     f" | {ms.get('rebuild', 0):.0f} | {ms.get('disk', 0):.0f} | {m['tok_s']:.2f}"
                     f" | {tr.get('compute', 0):.0f} | {tr.get('rebuild', 0):.0f}"
                     f" | {own if own is not None else '-'} | {r['ratio']:.2f} |")
    lines += ["", "measured compute and rebuild: the run's --trace spans, median ms per decode "
              "token (compute there is every layer's host time; the head, sampling, the waits "
              "for disk reads and the rest of a token are outside it)"]
    lines += ["", f"medians: predicted {s['predicted_tok_s']:.2f} tok/s, measured "
              f"{s['measured_tok_s']:.2f} tok/s, ratio {s['ratio']:.2f} "
              f"({'within' if s['within_25pct'] else 'NOT within'} 25%); the run's own "
              f"prediction {s['run_predicted_tok_s']} (ratio {s['run_ratio']}); "
              f"{s['reps_within_25pct']} of {len(reps)} repetitions within 25% on their own"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: slipstream's default)")
    ap.add_argument("--ram-budget", default="300MiB")
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="PREFIX: writes PREFIX.json and PREFIX.txt")
    ap.add_argument("--note", default=None, help="a line recorded with the results (what ran)")
    a = ap.parse_args()
    if a.model is None:
        from slipstream.hub.pull import pull

        a.model = str(pull(quiet=True))
    measure(a.model, a.ram_budget, 4)  # warm-up: page cache, .pyc files
    reps = []
    after = predict(a.model, a.ram_budget)
    for i in range(a.reps):
        before = after
        m = measure(a.model, a.ram_budget, a.tokens)
        after = predict(a.model, a.ram_budget)
        p = bracket(before, after)
        reps.append({"predicted": p, "measured": m, "ratio": round(p["tok_s"] / m["tok_s"], 3)})
        print(f"rep {i + 1}: predicted {p['tok_s']:.2f} tok/s, measured {m['tok_s']:.2f} tok/s "
              f"(run's own prediction {m['run_predicted_tok_s']})", file=sys.stderr)
    loads = [r["measured"][k] for r in reps for k in ("loadavg_1m_before", "loadavg_1m_after")]
    rev = source_revision()
    result = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": rev["commit"], "tree": rev["tree"], "machine": machine(),
              "model": a.model, "ram_budget": a.ram_budget, "tokens": a.tokens,
              "prompt": PROMPT, "loadavg_1m": {"min": min(loads), "max": max(loads)},
              "statistic": "median over repetitions of each side's tok/s", "note": a.note,
              "summary": summarize(reps), "reps": reps}
    text = table(result)
    print(text)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(a.out + ".txt").write_text(text)


if __name__ == "__main__":
    main()
