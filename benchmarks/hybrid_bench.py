"""Hybrid decode on the GPU machine (issue 13): the CPU computes part of each pinned layer's FFN
while PCIe brings the rest, against whole layers over PCIe, on the same synthetic file.

    python bench/hybrid_bench.py OUTDIR [--workdir /tmp/slipstream-models] [--cases 70b,8b]
        [--threads 8,12,16] [--llamacpp 70b=FILE --llamacpp 8b=FILE]

Cases: 70b-q4k-vram24 / 70b-q4k-vram24-hybrid (the synthetic 70B Q4_K at 24 GiB) and
8b-q4k-vram4 / 8b-q4k-vram4-hybrid. Each: decode tok/s over `--tokens` greedy steps after a
warm-up (host clock around synchronised steps: every step ends in a device sync anyway), the
median of `--repeats` such runs, then greedy generation through model.generate, then
the store's CUDA events over a few more (`--stats`: copy GB/s, compute, stalls, the CPU's
seconds and GB/s), the plan's split and prediction, and VRAM reserved. The hybrid case also
sweeps the CPU's threads on the loaded model (torch.set_num_threads takes effect at once).
--llamacpp 70b=FILE: llama-bench's output on that shape from the same call; its best tg figure
over the thread counts it ran goes into that shape's cases.
Writes OUTDIR/hybrid-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import slipstream  # noqa: E402
from slipstream.hybrid.plan import default_threads, last_level_cache_bytes  # noqa: E402
from slipstream.memory.probes import steal_seconds  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402
from slipstream.hybrid.ffn import (GIL_SWITCH_S, HOST_FUSED, HOST_KIND,  # noqa: E402
                                       HOST_SIGNAL)


def decode_rate(model, tokens: int) -> float:
    engine = model.engine
    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(tokens + 3, device="cuda") + 100
    for i in range(3):  # warm-up: the ring in its steady state
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(tokens):
        engine.decode(ids[3 + i:4 + i])
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def host_load(since: dict | None = None) -> dict:
    """The machine's load average and this process's CPU seconds, and with `since` what the
    process used in between (CPU seconds over wall seconds: about 1 + the hybrid worker's
    threads busy): session 29's H100 ran one plan at 39 and at 32 tok/s on different loads,
    with nothing recorded to tell a busy host from a slow process."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    now = {"loadavg": [round(x, 2) for x in os.getloadavg()],
           "process_cpu_s": round(use.ru_utime + use.ru_stime, 3),
           "steal_s": steal_seconds(), "wall": time.perf_counter(),
           "main_thread_cpu_s": time.thread_time()}  # the caller's: the thread enqueueing
    if since is None:
        return now
    wall = now["wall"] - since["wall"]
    cpu = now["process_cpu_s"] - since["process_cpu_s"]
    out = {"loadavg_before": since["loadavg"], "loadavg_after": now["loadavg"],
           "process_cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
           "process_cores_busy": round(cpu / wall, 2) if wall > 0 else None,
           # the main thread's share of it: enqueueing CUDA work, holding the GIL the hybrid
           # worker needs between its calls (hybrid.ffn.GIL_SWITCH_S)
           "main_thread_busy": round((now["main_thread_cpu_s"] - since["main_thread_cpu_s"])
                                     / wall, 2) if wall > 0 else None}
    if now["steal_s"] is not None and since["steal_s"] is not None:
        # the hypervisor running others on this VM's cores: time the process could not have
        out["cores_stolen"] = round((now["steal_s"] - since["steal_s"]) / wall, 2) if wall else None
    return out


def host_share_rates(store, threads: int) -> dict:
    """The split layers' CPU shares run back to back on this thread, outside decode: their GB/s
    alone and beside pinned copies as long as theirs (hybrid.plan._beside_copy), next
    to the plan's probe, which reads one large weight. Tells the probe's error apart from what
    decode's chain adds (the worker's waits, the main thread)."""
    from slipstream.hybrid.plan import _beside_copy

    hosts = [store.hosts[i] for i in sorted(store.active)]
    if not hosts:
        return {}
    x = torch.randn(1, hosts[0].io.hidden)
    nbytes = sum(h.nbytes for h in hosts)

    def one() -> None:
        for h in hosts:
            h.compute(x)

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one()
        t0 = time.perf_counter()
        for _ in range(2):
            one()
        alone = 2 * nbytes / (time.perf_counter() - t0) / 1e9
        # copies for about as long as two passes over the shares at the rate alone
        total = int(55e9 * 2 * nbytes / (alone * 1e9))
        beside, copies = _beside_copy(one, nbytes, 128 << 20, total=max(total, 1 << 30))
    finally:
        torch.set_num_threads(saved)
    return {"shares_alone_gbps": round(alone, 1), "shares_beside_copy_gbps": round(beside, 1),
            "copies_beside_shares_gbps": round(copies, 1)}


def warmed_up(model, tokens: int) -> torch.Tensor:
    """A short prompt and two decode steps (the ring in its steady state); the ids of the
    `tokens` steps to time after them."""
    engine = model.engine
    engine.reset()
    engine.forward(list(range(5, 13)))
    ids = torch.arange(tokens + 2, device="cuda") + 100
    for i in range(2):
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    return ids[2:]


def breakdown(model, tokens: int) -> dict:
    """The store's events per decode token (what --stats prints)."""
    engine, store = model.engine, model.engine.layers
    ids = warmed_up(model, tokens)
    store.stats.reset()
    store.enable_timing()
    for i in range(tokens):
        engine.decode(ids[i:i + 1])
    torch.cuda.synchronize()
    store.collect()
    store.enable_timing(False)
    s, n = store.stats, tokens
    return {"compute_ms": round(s.compute_s / n * 1e3, 2),
            "stall_ms": round(s.stall_s / n * 1e3, 2),
            "h2d_busy_ms": round(s.h2d_s / n * 1e3, 2),
            "h2d_gb_per_token": round(s.h2d_bytes / n / 1e9, 3),
            "pcie_gbps_achieved": round(s.h2d_bytes / s.h2d_s / 1e9, 1) if s.h2d_s else None,
            "cpu_ms": round(s.cpu_s / n * 1e3, 2),
            "cpu_gb_per_token": round(s.cpu_bytes / n / 1e9, 3),
            "cpu_gbps_achieved": round(s.cpu_bytes / s.cpu_s / 1e9, 1) if s.cpu_s else None}


def traced(model, tokens: int, path: Path) -> dict:
    """Decode `tokens` steps under a tracer (runtime.trace: the GPU's layers, the host's
    enqueueing, the copies and the CPU worker's wait and share per split layer), save the
    trace to `path` (ui.perfetto.dev opens it) and return trace.split_timing's summary: where
    a split layer's serial path goes, and the GPU's gaps between layers."""
    from slipstream.runtime import trace

    engine, store = model.engine, model.engine.layers
    ids = warmed_up(model, tokens)
    tracer = trace.Tracer(f"hybrid_bench {path.stem}")
    trace.attach(model, tracer)
    try:
        for i in range(tokens):
            engine.decode(ids[i:i + 1])
        torch.cuda.synchronize()
        store.collect()
        for host in list(store.hosts.values())[:1]:
            host.io.close()  # the worker's last spans are recorded once it has stopped
    finally:
        trace.attach(model, None)
        store.enable_timing(False)
    tracer.write(path)
    return trace.split_timing(tracer.spans())


def generate_rate(model, tokens: int) -> float:
    """Greedy generation through model.generate (the sampler on the device, each token read
    back one step behind the next step's enqueueing), as `slipstream run` decodes: what a user
    sees, against decode_rate's back-to-back steps. Session 37's spec bench read 5.69 tok/s
    this way where decode_rate read 6.53 on the same machine, another load."""
    prompt = list(range(5, 13))
    for _ in model.generate(prompt, max_tokens=4, temperature=0):  # warm-up
        pass
    for _ in model.generate(prompt, max_tokens=tokens + 1, temperature=0):
        pass
    return model.last_stats.decode_tok_s


def with_llamacpp(row: dict, llama: dict[str, str]) -> None:
    """llama-bench's figure on the row's shape (from this call's run) into the row, as soon as
    the row is made: session 38's call ended in the 8B's cases, and the 70B's rows, written
    only at the end until then, went without it."""
    if "error" in row:
        return
    tg = llamacpp_tg(llama.get(row["name"].split("-")[0]))
    row["llamacpp_decode_tok_s"] = tg and tg["best"]
    if tg:
        row["llamacpp_decode_tok_s_by_threads"] = tg["by_threads"]
        row["ratio_to_llamacpp"] = round(row["decode_tok_s"] / tg["best"], 3)


def prefill_rate(model, n: int = 512) -> float:
    engine = model.engine
    ids = list(range(5, 5 + n))
    engine.reset()
    engine.forward(ids)  # warm-up (and the switch to whole-layer copies)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.reset()
    engine.forward(ids)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def set_threads(m, n: int) -> None:
    """torch's CPU threads and hybrid's CPU worker's, at once (both take effect at once)."""
    torch.set_num_threads(n)
    for host in m.engine.layers.hosts.values():
        host.io.threads = n


def thread_sweep(m, name: str, threads: list[int], tokens: int, trace_tokens: int = 0,
                 outdir: Path | None = None) -> dict:
    """Decode tok/s at each thread count on the loaded model, swept up and then down, the mean
    of the two kept: later runs of a sweep ran faster (session 18: plain decode 3.19, 3.60,
    then 4.44 tok/s on one layout), which a single sweep in rising order credits to the
    higher counts. With trace_tokens, each count is also traced once (on the way up, into
    OUTDIR/trace-NAME-tN.json) and its split_timing kept: whether fewer threads leave the
    host's enqueue a core (session 39's 8B, bound by it beside 15 threads)."""
    runs: dict[str, list[float]] = {str(n): [] for n in threads}
    timings: dict[str, dict] = {}
    for n in threads + threads[::-1]:
        set_threads(m, n)
        runs[str(n)].append(round(decode_rate(m, tokens), 3))
        print(json.dumps({"name": name, "threads": n, "tok_s": runs[str(n)][-1]}), flush=True)
        if trace_tokens and outdir is not None and str(n) not in timings:
            timings[str(n)] = traced(m, trace_tokens, outdir / f"trace-{name}-t{n}.json")
    out = {"decode_tok_s_by_threads": {n: round(sum(r) / len(r), 3) for n, r in runs.items()},
           "decode_tok_s_by_threads_runs": runs}
    if timings:
        out["split_timing_by_threads"] = timings
    return out


NEIGHBOUR = """
import sys, numpy as np
a = np.ones(1 << 27); b = np.empty_like(a)  # 1 GiB each: far past the caches
while True:
    np.copyto(b, a)
"""


def balance_of(store) -> dict:
    """Where the running balance (hybrid.balance) stands: split layers the CPU serves,
    each change made (pass, layers split, CPU GB/s measured, PCIe GB/s judged by), and the
    rates of its last window (PCIe's from the copies metered, memory.timeline.CopyMeter)."""
    b = getattr(store, "balance", None)
    return {"split_layers_active": len(getattr(store, "active", ()) or ()),
            "balance_changes": list(b.changes) if b is not None else None,
            "balance_cpu_gbps": round(b.cpu_gbps, 1) if b is not None and b.cpu_gbps else None,
            "balance_pcie_gbps": round(b.pcie_measured, 1)
            if b is not None and b.pcie_measured else None}


def settle(model, tokens: int) -> dict:
    """Decode `tokens` steps before timing, so that the running balance has judged (a window
    of 8 passes, a change once two windows agree) and the figures timed are those of the
    split it settles on. The rate over those steps and the balance's state after them."""
    rate = decode_rate(model, tokens)
    return {"settle_tokens": tokens, "settle_tok_s": round(rate, 3),
            **{f"settled_{k}": v for k, v in balance_of(model.engine.layers).items()}}


def under_neighbour(m, name: str, processes: int, tokens: int, rounds: int = 2) -> dict:
    """Decode while `processes` other processes stream host memory (a noisy neighbour on the
    host's cores and memory bus, as the H200's host had in session 22), with the running
    balance and without it (the plan's split held), alternately on the same load."""
    import subprocess

    store = m.engine.layers
    balance, hosts = store.balance, sorted(store.hosts)
    hogs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(processes)]
    runs: dict[str, list[float]] = {"balanced": [], "plan_split": []}
    states = []
    try:
        time.sleep(2)  # the hogs' arrays allocated and streaming
        for _ in range(rounds):
            for label in ("balanced", "plan_split"):
                store.balance = balance if label == "balanced" else None
                if label == "plan_split":
                    store.split_only(hosts)
                runs[label].append(round(decode_rate(m, tokens), 3))
                states.append({"run": label, "tok_s": runs[label][-1], **balance_of(store)})
                print(json.dumps({"name": name, "neighbour": processes} | states[-1]),
                      flush=True)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
        store.balance = balance
    return {"neighbour_processes": processes, "neighbour_runs": runs, "neighbour_states": states,
            "neighbour_tok_s": {k: round(sum(v) / len(v), 3) for k, v in runs.items()}}


def case(path: Path, name: str, budget: str, hybrid, tokens: int, threads: list[int],
         sweep: bool, prefill: bool = True, vram_layers: int | None = None,
         neighbour: int = 0, settle_tokens: int = 0, trace_tokens: int = 0,
         outdir: Path | None = None, ctx: int = 2048, repeats: int = 1) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with slipstream.load(path, device="cuda", ctx=ctx, vram_budget=budget,
                         hybrid=hybrid, vram_layers=vram_layers) as m:
        load_s = time.perf_counter() - t0
        plan = m.plan
        h = plan.hybrid
        row = {"name": name, "vram_budget": budget, "hybrid": hybrid, "ctx": ctx,
               "load_s": round(load_s, 1),
               "vram_layers_cap": vram_layers,
               "tiers": {t: plan.tiers.count(t) for t in sorted(set(plan.tiers))},
               "predicted_tok_s": round(plan.predicted_tok_s or 0, 3),
               "pcie_gbps_probe": plan.bandwidth_gbps.get("pinned")}
        if h is not None:
            row.update(host_kind=HOST_KIND, host_fused=HOST_FUSED, host_signal=HOST_SIGNAL,
                       gil_switch_s=GIL_SWITCH_S,
                       cpu_share=round(h.cpu_share, 4),
                       ffn_units_on_gpu=h.keep,
                       split_layers=len(h.layers), threads=h.threads,
                       cpu_gbps_probe=round(h.cpu_gbps, 1),
                       pcie_gbps_beside_cpu=round(h.pcie_gbps, 1),
                       plain_predicted_tok_s=round(h.plain_tok_s or 0, 3),
                       extra_ram_gib=round(h.extra_ram_bytes / 2**30, 2),
                       probe_cores_stolen=None if h.cores_stolen is None
                       else round(h.cores_stolen, 2))
        else:  # whole layers (off, or auto declining the split): nothing on the CPU
            row["cpu_share"] = 0.0
        # the links' roofline, from the rates measured at load in this run: whole layers over
        # PCIe; hybrid, the larger of the CPU's and PCIe's times for their shares
        streamed = sum(b for b, t in zip(plan.file_bytes_per_layer, plan.tiers) if t == "pinned")
        pcie = plan.bandwidth_gbps.get("pinned") or 0
        if h is None:
            link_s = streamed / (pcie * 1e9) if pcie else None
        else:
            link_s = max(h.pcie_bytes_per_token / (h.pcie_gbps * 1e9),
                         h.cpu_bytes_per_token / (h.cpu_gbps * 1e9))
        row["roofline_tok_s"] = round(1 / link_s, 3) if link_s else None
        if h is not None and h.rebalance and settle_tokens:
            row.update(settle(m, settle_tokens))
        before = host_load()
        # the median of `repeats` runs, each kept: one load of session 38's 70B read 5.79-6.52
        # tok/s across its timed runs
        runs = [round(decode_rate(m, tokens), 3) for _ in range(repeats)]
        row["decode_tok_s"] = round(statistics.median(runs), 3)
        row["decode_tok_s_runs"] = runs
        row["host_load"] = host_load(before)
        row["generate_tok_s"] = round(generate_rate(m, tokens), 3)
        if link_s:
            row["ratio_to_roofline"] = round(row["decode_tok_s"] * link_s, 3)
        row["breakdown"] = breakdown(m, max(4, tokens // 2))
        if trace_tokens and outdir is not None:
            row["split_timing"] = traced(m, trace_tokens, outdir / f"trace-{name}.json")
        if h is not None:
            row.update(balance_of(m.engine.layers))
            # the CPU's share of the split layers' FFN units as decode was timed: the share
            # packed over the layers the balance keeps split
            row["cpu_share"] = round(h.cpu_share * row["split_layers_active"] / len(h.layers), 4)
        if h is not None and neighbour:
            row.update(under_neighbour(m, name, neighbour, tokens))
        if h is not None and sweep:
            row.update(thread_sweep(m, name, threads, max(8, tokens // 2),
                                    trace_tokens if len(threads) > 1 else 0, outdir))
            set_threads(m, h.threads)
        if prefill:
            row["prefill512_tok_s"] = round(prefill_rate(m), 1)
            row["decode_after_prefill_tok_s"] = round(decode_rate(m, max(4, tokens // 2)), 3)
        row["vram_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        # what the driver counts for the process (the CUDA context and cuBLAS's handles too),
        # as llama.cpp's "max memory used" is: reserved blocks stay until the model closes
        free, total = torch.cuda.mem_get_info()
        row["vram_process_gib"] = round((total - free) / 2**30, 2)
        # what load kept of the budget for that (memory.cuda_context)
        row["vram_context_gib"] = round(m.plan.outside_allocator / 2**30, 2)
        if h is not None:  # after VRAM is read: its copies take a device buffer of their own
            row["host_share_rates"] = host_share_rates(m.engine.layers, h.threads)
    print(json.dumps(row), flush=True)
    return row


FALLBACK_LAYERS = {"70b": 42, "8b": 16}


def llamacpp_tg(path: str | None) -> dict | None:
    """llama-bench's tg figures (t/s column) by thread count, and the best of them: the
    comparison is against llama.cpp at its best thread count in this call, not at ours."""
    if not path or not Path(path).exists():
        return None
    by_threads: dict[str, float] = {}
    columns: list[str] = []
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "model":
            columns = cells
        if not re.search(r"\|\s*tg\d+", line):
            continue
        rate = re.search(r"([\d.]+)\s*±\s*[\d.]+\s*\|?\s*$", line)
        if rate is None:
            continue
        threads = cells[columns.index("threads")] if "threads" in columns else "default"
        by_threads[threads] = max(float(rate.group(1)), by_threads.get(threads, 0.0))
    if not by_threads:
        return None
    return {"best": max(by_threads.values()), "by_threads": by_threads}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--cases", default="70b,8b")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed decode runs of --tokens steps each; decode_tok_s is their median")
    ap.add_argument("--threads", default="8,10,12,13,14,15,16")
    ap.add_argument("--hybrid", default="auto", help="the hybrid cases' mode or share")
    ap.add_argument("--llamacpp", action="append", default=[],
                    help="SHAPE=FILE: llama-bench's output on that shape from this call")
    ap.add_argument("--skip-off", action="store_true", help="only the hybrid cases")
    ap.add_argument("--no-prefill", action="store_true", help="leave out pp512")
    ap.add_argument("--settle", type=int, default=40, metavar="TOKENS",
                    help="hybrid cases with a running balance: decode this many steps before "
                         "timing, so that the balance has judged")
    ap.add_argument("--neighbour", type=int, default=0, metavar="N",
                    help="hybrid cases: also decode beside N processes streaming host memory, "
                         "with the running balance and without it")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="the context the KV cache holds (llama-bench sizes its own to each "
                         "test: 16 positions for tg16, 512 for pp512)")
    ap.add_argument("--trace-tokens", type=int, default=6, metavar="N",
                    help="trace N decode steps of each case (OUTDIR/trace-CASE.json) and "
                         "record where a split layer's time goes (split_timing); 0: none")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in a.threads.split(",") if t]
    out = Path(a.outdir, "hybrid-bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)  # session 28 lost a run to a missing folder
    rows: list[dict] = []
    doc = {"device": torch.cuda.get_device_name(), "host_cpus": torch.get_num_threads(),
           "default_threads": default_threads(),
           "last_level_cache_mib": last_level_cache_bytes() >> 20,
           "env": {k: v for k, v in os.environ.items() if k.startswith("SLIPSTREAM_")},
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "torch": torch.__version__, "cases": rows}
    hybrid = a.hybrid if a.hybrid in ("auto", "on", "off") else float(a.hybrid)
    llama = dict(spec.split("=", 1) for spec in a.llamacpp)
    budgets = {"70b": "24GiB", "8b": "4GiB"}
    # in the order given: "8b,70b" has the short case done before a call's limit can cut it
    for shape in [c for c in a.cases.split(",") if c]:
        if shape not in budgets:
            raise SystemExit(f"--cases: unknown shape {shape!r} (70b or 8b)")
        budget = budgets[shape]
        path = work / f"{shape}-Q4_K.gguf"
        if not path.exists():
            write_synth(path, shape, "Q4_K")
        tag = f"{shape}-q4k-vram{budget[:-3]}"
        for name, mode in ((tag, "off"), (f"{tag}-hybrid", hybrid)):
            if mode == "off" and a.skip_off:
                continue
            # both shapes sweep the threads: the 8B's short shares (1.34 ms on an H100 host,
            # 8.7 of 15 threads' cores busy) may want fewer than the 70B's
            run = dict(sweep=True, prefill=not a.no_prefill,
                       neighbour=a.neighbour if mode != "off" else 0,
                       settle_tokens=a.settle, trace_tokens=a.trace_tokens,
                       outdir=out.parent, ctx=a.ctx, repeats=max(1, a.repeats))
            try:
                rows.append(case(path, name, budget, mode, a.tokens, threads, **run))
            except Exception as e:  # recorded, and the other cases still run
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()  # where it failed, into the call's log
                rows.append({"name": name, "vram_budget": budget, "hybrid": mode,
                             "error": f"{type(e).__name__}: {str(e)[:400]}"})
                torch.cuda.empty_cache()
                # out of memory: once more with the layer count that ran before the plans'
                # layers took one buffer each (session 9: 42 for the 70B, 16 for the 8B)
                if "out of memory" in str(e).lower() and shape in FALLBACK_LAYERS:
                    try:
                        rows.append(case(path, name, budget, mode, a.tokens, threads, **run,
                                         vram_layers=FALLBACK_LAYERS[shape]))
                    except Exception as e2:
                        print(f"{name} (fallback): {type(e2).__name__}: {e2}", flush=True)
                        torch.cuda.empty_cache()
            with_llamacpp(rows[-1], llama)
            out.write_text(json.dumps(doc, indent=1))
        # auto declined the split (it predicted no gain): the split's own figures, forced
        if mode == "auto" and rows and rows[-1].get("name") == f"{tag}-hybrid" \
                and "error" not in rows[-1] and not rows[-1].get("cpu_share"):
            try:
                rows.append(case(path, f"{tag}-hybrid-forced", budget, "on", a.tokens,
                                 threads, sweep=False, prefill=False, ctx=a.ctx))
                with_llamacpp(rows[-1], llama)
            except Exception as e:
                print(f"{tag}-hybrid-forced: {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
            out.write_text(json.dumps(doc, indent=1))
    print(f"{'case':28} {'tok/s':>7} {'pred':>7} {'share':>6} {'split':>6} {'cpu GB/s':>8} "
          f"{'pcie GB/s':>9} {'VRAM GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:28} failed: {r['error'][:80]}")
            continue
        b = r["breakdown"]
        print(f"{r['name']:28} {r['decode_tok_s']:7.3f} {r['predicted_tok_s']:7.3f} "
              f"{r.get('cpu_share', 0):6.2f} "
              f"{str(r.get('split_layers_active', '-')) + '/' + str(r.get('split_layers', '-')):>6} "
              f"{b['cpu_gbps_achieved'] or 0:8.1f} "
              f"{b['pcie_gbps_achieved'] or 0:9.1f} {r['vram_gib']:8.2f}")


if __name__ == "__main__":
    main()
