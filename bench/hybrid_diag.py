"""Where a split layer's time goes beyond its bytes (issue 13): on the H200 the 70B's hybrid
decode token was its CPU shares' busy time plus about 1.1 ms a split layer
(bench/results/2026-12-03-s2*-hybrid-bench-h200-*.json), 36 layers and 40 ms a token.

    python bench/hybrid_diag.py OUTDIR [--model 70b.gguf] [--rounds 3] [--tokens 32]

Part 1, no model: the CPU share's chain (hybrid.ffn.HostFFN.compute) on random int4
weights of the 70B's shapes at its share, from a worker thread as in decode: its two kernels
alone, the whole chain back to back, and the chain with a pause between calls (as the GPU's
work between split layers leaves it), which shows what waking the CPU's threads costs.
Part 2, with --model: the 70B at 24 GiB, hybrid auto, decoded in alternating rounds on one load
with each setting: the worker's OpenMP team kept awake between split layers (HostIO.keep_warm)
or left to sleep, and the fused wait-and-add (kernels.wait_host_add) against the wait, copy and
add. (Session 24's first call also tried the interpreter's switch interval at 0.2 ms against
the default 5 ms: 3.88 against 4.30 tok/s.)
Writes OUTDIR/hybrid-diag.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def _int4_linear(rows: int, cols: int, seed: int):
    from slipstream.weights.cpu_packed import INT4_GROUP, Int4PackLinear, _pack_int4

    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    scale_zeros = torch.full((cols // INT4_GROUP, rows, 2), 0.01, dtype=torch.bfloat16)
    return Int4PackLinear(_pack_int4(u), scale_zeros, rows)


def _in_worker(fn, threads: int):
    """Run fn in a fresh thread with `threads` torch threads (as HostIO's worker), return its
    result."""
    out: list = []

    def run() -> None:
        torch.set_num_threads(threads)
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def chain_costs(hidden: int, units: int, threads: int, reps: int = 40) -> dict:
    """Part 1 (module doc): milliseconds per call, medians of `reps`."""
    from slipstream.hybrid.ffn import HostFFN, _omp_touch

    gate_up = _int4_linear(2 * units, hidden, 1)
    down = _int4_linear(hidden, units, 2)
    ffn = HostFFN(gate_up, down, io=None)
    x = torch.randn(1, hidden)
    xb, mid = x.to(torch.bfloat16), torch.randn(1, units).to(torch.bfloat16)
    out = torch.empty(1, hidden)

    def timed(fn, pause_s: float = 0.0, between=None) -> float:
        """Median ms of fn, each call after time.sleep(pause_s) or `between()` (untimed)."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if between is not None:
                between()
            elif pause_s:
                time.sleep(pause_s)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e3, 3)

    def measure() -> dict:
        row = {"gate_up_kernel_ms": timed(lambda: gate_up.kernel(xb)),
               "down_kernel_ms": timed(lambda: down.kernel(mid)),
               "chain_ms": timed(lambda: out.copy_(ffn.compute(x)))}
        for pause in (0.0002, 0.001):
            row[f"chain_after_{pause * 1e3:g}ms_pause_ms"] = timed(
                lambda: out.copy_(ffn.compute(x)), pause)
        touch = _omp_touch()
        if touch is not None:  # the same 1 ms pause, the team kept awake (HostIO.keep_warm)
            def warm_pause() -> None:
                end = time.perf_counter() + 0.001
                while time.perf_counter() < end:
                    touch(threads)

            row["chain_after_1ms_kept_warm_ms"] = timed(lambda: out.copy_(ffn.compute(x)),
                                                        between=warm_pause)
        return row

    row = _in_worker(measure, threads)
    nbytes = gate_up.nbytes + down.nbytes
    row.update(threads=threads, hidden=hidden, units=units, weight_mb=round(nbytes / 1e6, 1),
               kernels_gbps=round(nbytes / (row["gate_up_kernel_ms"] + row["down_kernel_ms"])
                                  / 1e6, 1),
               chain_gbps=round(nbytes / row["chain_ms"] / 1e6, 1))
    return row


def _ios(m) -> list:
    return list({id(h.io): h.io for h in m.engine.layers.hosts.values()}.values())


def decode_ab(path: Path, budget: str, hybrid, rounds: int, tokens: int) -> dict:
    """Part 2 (module doc)."""
    import slipstream
    from hybrid_bench import breakdown, decode_rate

    default_interval = sys.getswitchinterval()
    settings = {
        "fused_add_kept_warm": dict(fused=True, warm=True, interval=default_interval),
        "fused_add_team_sleeps": dict(fused=True, warm=False, interval=default_interval),
        "copy_then_add_kept_warm": dict(fused=False, warm=True, interval=default_interval),
    }
    t0 = time.perf_counter()
    with slipstream.load(path, device="cuda", ctx=2048, vram_budget=budget, hybrid=hybrid) as m:
        h = m.plan.hybrid
        row = {"load_s": round(time.perf_counter() - t0, 1), "hybrid": hybrid,
               "cpu_share": round(h.cpu_share, 4) if h else None,
               "split_layers": len(h.layers) if h else 0,
               "predicted_tok_s": round(m.plan.predicted_tok_s or 0, 3),
               "cpu_gbps_probe": round(h.cpu_gbps, 1) if h else None}
        decode_rate(m, 8)  # the first passes after a load ran slower in every session
        runs: dict[str, list[float]] = {k: [] for k in settings}
        try:
            for r in range(rounds):
                order = list(settings) if r % 2 == 0 else list(settings)[::-1]
                for name in order:
                    s = settings[name]
                    for io in _ios(m):
                        io.fused_add, io.keep_warm = s["fused"], s["warm"]
                    sys.setswitchinterval(s["interval"])
                    runs[name].append(round(decode_rate(m, tokens), 3))
                    print(json.dumps({"setting": name, "round": r, "tok_s": runs[name][-1]}),
                          flush=True)
            fused_ok = all(io.fused_add for io in _ios(m)) if settings else None
        finally:
            sys.setswitchinterval(default_interval)
            for io in _ios(m):
                io.fused_add = io.keep_warm = True
        row["fused_add_stayed_on"] = fused_ok
        row["runs"] = runs
        row["tok_s"] = {k: round(statistics.mean(v), 3) for k, v in runs.items()}
        row["breakdown_fused_add"] = breakdown(m, 16)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from slipstream.hybrid.plan import default_threads
    from slipstream.provenance import source_revision

    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--model", help="the 70B Q4_K file for part 2")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--hybrid", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--units", type=int, default=14336, help="the CPU's FFN units (70B: 0.5)")
    ap.add_argument("--threads", type=int, default=0, help="0: the default")
    a = ap.parse_args()
    threads = a.threads or default_threads()
    rev = source_revision()
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": rev.get("commit"), "tree": rev.get("tree"), "torch": torch.__version__,
           "switch_interval_default": sys.getswitchinterval()}
    out["chain"] = chain_costs(a.hidden, a.units, threads)
    print(json.dumps(out["chain"]), flush=True)
    if a.model:
        hybrid = a.hybrid if a.hybrid in ("auto", "on", "off") else float(a.hybrid)
        out["decode"] = decode_ab(Path(a.model), a.budget, hybrid, a.rounds, a.tokens)
    Path(a.outdir).mkdir(parents=True, exist_ok=True)
    (Path(a.outdir) / "hybrid-diag.json").write_text(json.dumps(out, indent=1))
    c = out["chain"]
    print(f"chain at {c['threads']} threads, {c['weight_mb']} MB: kernels "
          f"{c['gate_up_kernel_ms'] + c['down_kernel_ms']:.3f} ms ({c['kernels_gbps']} GB/s), "
          f"chain {c['chain_ms']} ms ({c['chain_gbps']} GB/s), after 0.2/1 ms pauses "
          f"{c['chain_after_0.2ms_pause_ms']} / {c['chain_after_1ms_pause_ms']} ms, after 1 ms "
          f"kept warm {c.get('chain_after_1ms_kept_warm_ms')} ms")
    for k, v in out.get("decode", {}).get("tok_s", {}).items():
        print(f"{k:28} {v:7.3f} tok/s  {out['decode']['runs'][k]}")


if __name__ == "__main__":
    main()
