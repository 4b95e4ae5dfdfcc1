"""A mutation fuzzer for GGUF loading: every damaged file must end in a SlipstreamError or load
and generate finite logits.

Valid seed files (small `slipstream.synth` models of several kinds, and optionally the default
SmolLM2 model) are parsed into a document (metadata entries, tensor infos, data), mutated, and
written back: metadata values, types, lengths and keys (the hyper-parameters and tokenizer keys
above all), tensor infos (type, shape, offset, name, count), the header counts, raw length and
type fields, truncation, byte flips and splices. Structured mutations can lay the data section
out again so that the file stays consistent and the deeper checks are reached. Loud mutations
damage one tensor the model reads (an absurd block scale, norm or bias; a rename to a near
name): such a file must be refused, or load with a warning that names the tensor.

Each case runs in a worker process under an address-space limit (RLIMIT_AS) and a timeout kept
by the parent: first what `load()` does before it allocates (GGUFFile, ModelConfig, Tokenizer,
ChatTemplate, the layer shapes, the tensor formats); a file that passes all of that, and a
sampled fraction of the others, then goes through `slipstream.load(path, device="cpu", ctx=64)`,
generates 2 tokens and has its logits checked. Outcomes:

    clean     a SlipstreamError (the file was refused with a message)
    ok        loaded, generated, finite logits
    uncaught  any other exception
    crash     the worker died by a signal
    hang      the case ran past the timeout
    memory    MemoryError / allocation failure, or the worker's peak RSS grew past the limit
    nan       loaded and generated, but the logits are not finite
    silent    a loud mutation (an absurd scale, norm or bias; a near rename) loaded with no
              error or warning naming the tensor it damaged

    python tests/fuzz/fuzz_gguf.py --cases 2000 --jobs 2                      # a quick run
    python tests/fuzz/fuzz_gguf.py --cases 100000 --out fuzz-100k.json   # the long run
    python tests/fuzz/fuzz_gguf.py --seed 1 --repro 1234 --write bad.gguf    # one case's file

A case is a pure function of (--seed, case number, seed files), so any case can be rebuilt.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
# FUZZ_GGUF_SRC: fuzz another copy of slipstream's sources (an older commit, for comparison)
SRC = Path(os.environ.get("FUZZ_GGUF_SRC") or REPO / "src")
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from slipstream.modelfile import validate  # noqa: E402

# the document and the mutations, beside this file; re-exported for the tests that use them
from gguf_doc import KV, TI, Doc, parse, relayout, serialize  # noqa: E402,F401
from gguf_mutations import (LOUD, Seed, _seed_objs, load_seed, loud_names,  # noqa: E402,F401
                            make_case, make_seeds)
from gguf_check import (_current_rss, _mem_error, _peak_rss,  # noqa: E402,F401
                        _reset_peak_rss, check_file)

BAD = ("uncaught", "crash", "hang", "memory", "nan", "silent")
OUTCOMES = ("clean", "ok") + BAD + ("harness",)  # harness: the fuzzer's own failure

def worker_main(args: argparse.Namespace) -> None:
    """Read case numbers from stdin, answer one JSON line each on stdout."""
    limit = int(args.mem_limit_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    seeds = [load_seed(n, Path(p), w) for n, p, w in json.loads(args.seeds)]
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    path = tmp / "case.gguf"
    # the answers go through a copy of fd 1; fd 1 itself (anything the code under test
    # prints, from Python or C) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # FUZZ_GGUF_INJECT="12:hang,13:crash,14:rss,15:uncaught": faults for testing the harness
    inject = dict(x.split(":") for x in os.environ.get("FUZZ_GGUF_INJECT", "").split(",") if x)
    check_file(seeds[0].path, full=True)  # warm up: imports, first load
    # What the warm-up made lives on: moved out of the collector's sight, so that the
    # gc.collect() before each case costs ~1 ms instead of ~35 (torch makes many objects).
    gc.collect()
    gc.freeze()
    resettable = _reset_peak_rss()
    base = _peak_rss()
    out.write(json.dumps({"ready": True, "base_rss": base}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            case = int(line)
            rng = random.Random(f"{args.seed}:{case}:mode")
            try:
                s, data, cls, desc = make_case(seeds, args.seed, case)
            except Exception as e:  # the fuzzer's own bug: reported, not counted as slipstream's
                out.write(json.dumps({"outcome": "harness", "case": case,
                                      "message": f"make_case: {type(e).__name__}: {e}"}) + "\n")
                out.flush()
                continue
            path.write_bytes(data)
            size = len(data)
            del data  # the case's own bytes are not what is measured
            full = rng.random() < args.full_fraction
            gc.collect()
            rss_now = _current_rss()
            if resettable:
                _reset_peak_rss()
            peak_before = _peak_rss()
            t0 = time.perf_counter()
            fault = inject.get(str(case))
            if fault == "hang":
                time.sleep(3600)
            elif fault == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif fault == "rss":
                blob = bytearray(args.mem_growth_mib * 2**20 + 2**28)
                blob[::4096] = b"x" * len(blob[::4096])
                del blob
            res = check_file(path, full, expect=loud_names(cls, desc)) \
                if fault != "uncaught" else {
                "outcome": "uncaught", "stage": "validate", "error": "ValueError",
                "message": "injected"}
            res.update(case=case, seed_file=s.name, cls=cls, desc=desc[:300], full=full,
                       size=size, seconds=round(time.perf_counter() - t0, 4))
            # The case's growth: its peak above the RSS it started from. With the peak mark
            # reset before each case that is exact; without it (no clear_refs), growth is seen
            # only when the case sets a new peak for the process, and a worker whose peak
            # drifts past half the limit is replaced, so that no growth past the limit can
            # hide under an earlier peak.
            peak = _peak_rss()
            growth = peak - rss_now if resettable or peak > peak_before else 0
            res["peak_growth_mib"] = growth >> 20
            limit = args.mem_growth_mib * 2**20
            if growth > limit and res["outcome"] in ("clean", "ok"):
                res["clean_outcome"] = res["outcome"]
                res.update(outcome="memory", message=f"peak RSS grew {growth >> 20} MiB during "
                                                     f"the case (limit {args.mem_growth_mib} MiB)")
            res.pop("traceback", None) if res["outcome"] in ("clean", "ok") else None
            retire = (_current_rss() if resettable else peak) - base > limit // 2
            if retire:
                res["retire"] = True  # the parent starts a fresh worker
            out.write(json.dumps(res, default=str) + "\n")
            out.flush()
            if retire:
                break
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


# -- the parent -------------------------------------------------------------------------------

class Worker:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.buf = b""

    def start(self, timeout: float) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.buf = b""
        self.eof = False
        ready = self.read(timeout)
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"fuzz worker did not start: {ready}")

    def read(self, timeout: float) -> dict | None:
        """One JSON line, or None on timeout / EOF (check self.proc.poll())."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.eof = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"outcome": "crash", "message": f"garbled answer {line[:200]!r}"}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc = None


def fuzz(cases: int, seed: int = 0, jobs: int = 1, full_fraction: float = 0.05,
         smollm: Path | None = None, mem_limit_gib: float = 6.0, mem_growth_mib: int = 1024,
         timeout: float = 60.0, time_limit: float | None = None, start: int = 0,
         workdir: Path | None = None, progress: Callable[[str], None] | None = None,
         checkpoint: Path | None = None, resume: dict | None = None,
         only: str | None = None) -> dict:
    """Run cases start..start+cases over `jobs` workers; returns the report (counts by outcome,
    by mutation class and by error class, and every bad case). `resume`: a partial report of
    the same run (written every 2000 cases to `checkpoint`) to carry on from."""
    t0 = time.time()
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-seeds-")) if own else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = make_seeds(workdir, smollm, only)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seed", str(seed),
            "--seeds", json.dumps(seeds), "--full-fraction", str(full_fraction),
            "--mem-limit-gib", str(mem_limit_gib), "--mem-growth-mib", str(mem_growth_mib)]
    seed_info = [{"name": n, "weight": w, "bytes": os.path.getsize(p)} for n, p, w in seeds]
    source = source_state()
    counts: Counter = Counter()
    by_class: dict[str, Counter] = defaultdict(Counter)
    by_seed: dict[str, Counter] = defaultdict(Counter)
    errors: Counter = Counter()
    stages: Counter = Counter()
    bad: list[dict] = []
    extra = Counter()
    lock = threading.Lock()
    end = start + cases
    done = [0]
    completed: set[int] = set()  # case numbers done beyond `through`
    through = [start]  # every case below this is done
    elapsed_before = 0.0
    if resume is not None:
        if resume["seed"] != seed or resume["first_case"] != start:
            raise SystemExit("--resume: the report is of another run (seed or first case)")
        counts.update(resume["counts"])
        extra.update({k: resume[k] for k in ("full_loads", "accepted_by_validation",
                                             "clean_nonfinite_logits", "loaded_with_warning")
                      if k in resume})
        stages.update(resume["by_outcome_stage"])
        errors.update(resume["clean_error_classes"])
        for k, v in resume["by_mutation"].items():
            by_class[k].update(v)
        for k, v in resume["by_seed_file"].items():
            by_seed[k].update(v)
        bad.extend(resume["bad_cases"])
        done[0] = resume["cases"]
        through[0] = resume["completed_through"]
        completed.update(resume["completed_beyond"])
        elapsed_before = resume["elapsed_s"]
    next_case = [through[0]]
    deadline = None if time_limit is None else t0 + time_limit

    def record(res: dict) -> None:
        with lock:
            done[0] += 1
            if isinstance(res.get("case"), int):
                completed.add(res["case"])
                while through[0] in completed:
                    completed.discard(through[0])
                    through[0] += 1
            o = res["outcome"]
            counts[o] += 1
            by_class[res.get("cls", "?").split("+")[0]][o] += 1
            by_seed[res.get("seed_file", "?")][o] += 1
            stages[f"{o}:{res.get('stage', '?')}"] += 1
            if o == "clean":
                errors[res.get("error", "?")] += 1
            if res.get("full"):
                extra["full_loads"] += 1
            if res.get("accepted"):
                extra["accepted_by_validation"] += 1
            if res.get("nonfinite"):
                extra["clean_nonfinite_logits"] += 1
            if res.get("warnings") and o in ("ok", "nan"):
                extra["loaded_with_warning"] += 1
            if o in BAD or o == "harness":
                bad.append(res)
                if progress:
                    progress(f"BAD case {res.get('case')} [{o}] {res.get('seed_file')} "
                             f"{res.get('desc', '')[:120]} -> {res.get('error', '')}: "
                             f"{res.get('message', '')[:200]}")
            if progress and done[0] % 500 == 0:
                progress(f"{done[0]} cases, {time.time() - t0:.0f}s: {dict(counts)}")
            if checkpoint is not None and done[0] % 2000 == 0:
                _write_json(checkpoint, {**report(), "partial": True})

    def take() -> int | None:
        with lock:
            while next_case[0] in completed:  # done before a resume
                next_case[0] += 1
            if next_case[0] >= end or (deadline is not None and time.time() > deadline):
                return None
            next_case[0] += 1
            return next_case[0] - 1

    def run_worker() -> None:
        try:
            serve()
        except Exception as e:  # never lose cases silently: the report says so
            record({"outcome": "harness", "message": f"worker thread: {type(e).__name__}: {e}"})

    def serve() -> None:
        w = Worker(argv)
        w.start(max(timeout, 120.0))
        try:
            while (case := take()) is not None:
                try:
                    w.proc.stdin.write(f"{case}\n".encode())
                    w.proc.stdin.flush()
                except BrokenPipeError:  # it died after its last answer: a fresh one
                    w.kill()
                    w.start(max(timeout, 120.0))
                    w.proc.stdin.write(f"{case}\n".encode())
                    w.proc.stdin.flush()
                res = w.read(timeout)
                if res is None:
                    rc = w.proc.poll()
                    if rc is None and w.eof:  # it closed its output: it is exiting
                        try:
                            rc = w.proc.wait(30)
                        except subprocess.TimeoutExpired:
                            rc = None
                    if rc is None:
                        res = {"outcome": "hang", "message": f"no answer in {timeout:.0f}s"}
                    elif rc < 0:
                        res = {"outcome": "crash", "message": f"worker died by signal {-rc}"}
                    else:
                        res = {"outcome": "crash", "message": f"worker exited with {rc}"}
                    res["case"] = case
                    try:
                        s_file, _, cls, desc = make_case(_seed_objs(seeds), seed, case)
                        res.update(seed_file=s_file.name, cls=cls, desc=desc[:300])
                    except Exception as e:
                        res.update(desc=f"(make_case failed: {type(e).__name__})")
                    w.kill()
                    record(res)
                    w.start(max(timeout, 120.0))
                    continue
                record(res)
                if w.proc.poll() is not None or res.get("retire"):
                    w.kill()
                    w.start(max(timeout, 120.0))
        finally:
            w.kill()

    def report() -> dict:
        return {
            "seed": seed, "cases": done[0], "first_case": start, "requested_cases": cases,
            "source": source,
            "completed_through": through[0], "completed_beyond": sorted(completed),
            "elapsed_s": round(elapsed_before + time.time() - t0, 1), "jobs": jobs,
            "full_fraction": full_fraction, "mem_limit_gib": mem_limit_gib,
            "mem_growth_mib": mem_growth_mib, "timeout_s": timeout,
            "seeds": seed_info,
            "counts": {o: counts.get(o, 0) for o in OUTCOMES},
            "bad_total": sum(counts.get(o, 0) for o in BAD),
            "harness_errors": counts.get("harness", 0),
            **dict(extra),
            "by_outcome_stage": dict(sorted(stages.items())),
            "by_mutation": {k: dict(v) for k, v in sorted(by_class.items())},
            "by_seed_file": {k: dict(v) for k, v in sorted(by_seed.items())},
            "clean_error_classes": dict(errors.most_common()),
            "bad_cases": bad[:200],
        }

    threads = [threading.Thread(target=run_worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if own:
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()
    with lock:
        return report()


def source_state() -> dict:
    """What was fuzzed: the repository's commit and a hash of slipstream's sources as they
    were (the working tree may differ from the commit)."""
    h = hashlib.sha256()
    for f in sorted((SRC / "slipstream").rglob("*.py")):
        h.update(str(f.relative_to(SRC)).encode() + b"\0" + f.read_bytes())
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                                capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"src": str(SRC), "commit": commit, "src_sha256": h.hexdigest()[:16]}


def format_table(report: dict) -> str:
    """The report as a short text table: outcomes, then outcomes by mutation class and by
    seed file, then the clean errors by class."""
    cols = [o for o in OUTCOMES if o != "harness" or report["counts"].get(o)]
    rate = report["cases"] / max(report["elapsed_s"], 1e-9)
    src = report.get("source", {})
    lines = [f"GGUF mutation fuzzer (tests/fuzz/fuzz_gguf.py): seed {report['seed']}, cases "
             f"{report['first_case']}..{report['first_case'] + report['cases'] - 1}, "
             f"{report['cases']} cases in {report['elapsed_s']:.0f} s ({rate:.1f} cases/s, "
             f"{report['jobs']} worker(s)); sources {src.get('commit', '?')[:10]} "
             f"+ tree {src.get('src_sha256', '?')}",
             f"bad (uncaught, crash, hang, memory, nan, silent): {report['bad_total']}; "
             f"loaded with a warning: {report.get('loaded_with_warning', 0)}; cases put "
             f"through load() whatever the checks said (sampled): "
             f"{report.get('full_loads', 0)}; refused at generation by NonFiniteLogits (counted "
             f"clean): {report.get('clean_nonfinite_logits', 0)}", ""]

    def table(title: str, rows: dict[str, dict]) -> None:
        w = max([len(title)] + [len(k) for k in rows])
        lines.append(f"{title:<{w}}  " + "  ".join(f"{c:>8}" for c in cols) + f"  {'total':>8}")
        for k, v in rows.items():
            lines.append(f"{k:<{w}}  " + "  ".join(f"{v.get(c, 0):>8}" for c in cols)
                         + f"  {sum(v.values()):>8}")
        lines.append("")

    table("outcome", {"all cases": report["counts"]})
    table("mutation class", report["by_mutation"])
    table("seed file", report["by_seed_file"])
    lines.append("clean errors by class: " + ", ".join(
        f"{k} {v}" for k, v in report["clean_error_classes"].items()))
    for b in report["bad_cases"][:20]:
        lines.append(f"BAD case {b.get('case')} [{b['outcome']}] {b.get('seed_file')} "
                     f"{b.get('cls')}: {b.get('desc')} -> {b.get('error', '')}: "
                     f"{b.get('message', '')[:200]}")
    return "\n".join(lines).rstrip() + "\n"


def _write_json(path: Path, obj: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--full-fraction", type=float, default=0.05,
                    help="fraction of refused files also put through load() (accepted files "
                         "always are)")
    ap.add_argument("--only", default=None, help="fuzz this seed file alone (e.g. smollm2)")
    ap.add_argument("--smollm", default=None,
                    help="path of the default model to use as a rare seed, or 'auto' (the "
                         "cached copy, if any)")
    ap.add_argument("--mem-limit-gib", type=float, default=6.0, help="RLIMIT_AS of a worker")
    ap.add_argument("--mem-growth-mib", type=int, default=1024,
                    help="peak-RSS growth of a worker over its warmed-up size that counts as a "
                         "memory blow-up")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (a hang)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop taking new cases after this many seconds")
    ap.add_argument("--out", default=None, help="write the JSON report here (and a partial one "
                                                "every 2000 cases)")
    ap.add_argument("--resume", action="store_true",
                    help="carry on from the partial report in --out (same --seed, --start)")
    ap.add_argument("--workdir", default=None, help="keep the seed files here")
    ap.add_argument("--repro", type=int, default=None, help="rebuild this case's file")
    ap.add_argument("--write", default=None, help="with --repro: where to write it")
    ap.add_argument("--table-from", default=None,
                    help="write the .txt table of this JSON report next to it, and print it")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seeds", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.table_from:
        report = json.loads(Path(args.table_from).read_text())
        text = format_table(report)
        Path(args.table_from).with_suffix(".txt").write_text(text)
        print(text, end="")
        return
    smollm = None
    if args.smollm == "auto":
        from slipstream.hub.pull import default_model_path

        cand = default_model_path()
        smollm = cand if cand.exists() else None
    elif args.smollm:
        smollm = Path(args.smollm)
    if args.repro is not None:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fuzz-seeds-"))
        seeds = _seed_objs(make_seeds(workdir, smollm, args.only))
        s, data, cls, desc = make_case(seeds, args.seed, args.repro)
        out = Path(args.write or f"fuzz-case-{args.seed}-{args.repro}.gguf")
        out.write_bytes(data)
        print(f"case {args.repro}: seed file {s.name}, {cls}: {desc}\nwritten to {out}")
        res = check_file(out, full=True, expect=loud_names(cls, desc))
        print(json.dumps(res, indent=1, default=str))
        return
    report = fuzz(args.cases, args.seed, args.jobs, args.full_fraction, smollm,
                  args.mem_limit_gib, args.mem_growth_mib, args.timeout, args.time_limit,
                  args.start, Path(args.workdir) if args.workdir else None,
                  progress=lambda m: print(m, flush=True),
                  checkpoint=Path(args.out) if args.out else None,
                  resume=json.loads(Path(args.out).read_text()) if args.resume else None,
                  only=args.only)
    if args.out:
        _write_json(Path(args.out), report)
        Path(args.out).with_suffix(".txt").write_text(format_table(report))
    summary = {k: report[k] for k in ("cases", "elapsed_s", "counts", "bad_total")}
    print(json.dumps(summary, indent=1))
    for b in report["bad_cases"][:20]:
        print(f"BAD case {b.get('case')} [{b['outcome']}] {b.get('seed_file')} {b.get('cls')}: "
              f"{b.get('desc')} -> {b.get('error', '')}: {b.get('message', '')[:200]}")


if __name__ == "__main__":
    main()
