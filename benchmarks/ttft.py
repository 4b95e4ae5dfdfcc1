"""Time to first token, from a cold process: slipstream's CLI against llama-cpp-python.

Each case is a fresh process, timed from spawn to the first byte on stdout (the first token, for
`run`) and to its exit. Three cases, as a new user meets them:

    help   `slipstream --help`                   | `python -c "import llama_cpp"` (every
                                                 |  llama-cpp-python command pays it; it ships
                                                 |  no llama-cli)
    info   `slipstream info -m MODEL`            | `Llama(MODEL, vocab_only=True)`: the
                                                 |  metadata and vocabulary, no weights
    run    `slipstream run -m MODEL -p Hello -n 1` | `Llama(MODEL, n_ctx=CTX)` + one streamed
                                                 |  token of "Hello"

Both sides get the same context (--ctx), threads (--threads) and greedy sampling. Runs alternate
(slipstream, llama-cpp-python, slipstream, ...) so that the shared machine's load falls on both
alike; one untimed warm-up of each case first puts the model in the page cache for both. The
median of --reps runs is reported, with the load average around each run, since the machine is
shared. slipstream's own summary line splits its `run` into imports, load and prompt. The
children write their bytecode (PYTHONDONTWRITEBYTECODE is dropped for them): an installed
package has its .pyc files, and a source tree compiled again at every start would time the
compiler.

--serve: the servers instead, `slipstream serve` against `python -m llama_cpp.server` (its
[server] extra: sse-starlette, starlette-context) on the same file, threads and context, each
warmed by two requests: the time from a streamed /v1/completions request of a 64-token prompt
to the first chunk carrying text, alternating the servers, median of --reps. Each request's
prompt starts with a word of its own, so neither server reuses a cached prefix of an earlier
one. Written by common.write_result (RESULTS/<date>-ttft-serve-cpu.json).

    python benchmarks/ttft.py --reps 5 --profile --out ttft-cpu
    python benchmarks/ttft.py --serve --reps 10
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
import time
from pathlib import Path

PY = sys.executable
PROMPT = "Hello"

LLAMA_INFO = """
import sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(f"{len(m.metadata)} metadata keys, vocab {m.n_vocab()}", flush=True)
"""

LLAMA_RUN = """
import sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
          verbose=False)
for c in m(sys.argv[4], max_tokens=1, temperature=0.0, stream=True):
    sys.stdout.write(c["choices"][0]["text"])
    sys.stdout.flush()
print()
"""


def cases(model: str, ctx: int, threads: int) -> dict[str, dict[str, list[str]]]:
    s = [PY, "-m", "slipstream"]
    return {
        "help": {"slipstream": s + ["--help"],
                 "llama-cpp-python": [PY, "-c", "import llama_cpp"]},
        "info": {"slipstream": s + ["info", "-m", model],
                 "llama-cpp-python": [PY, "-c", LLAMA_INFO, model]},
        "run": {"slipstream": s + ["run", "-m", model, "-p", PROMPT, "-n", "1", "--temp", "0",
                                   "--device", "cpu", "--ctx", str(ctx), "-t", str(threads)],
                "llama-cpp-python": [PY, "-c", LLAMA_RUN, model, str(ctx), str(threads),
                                     PROMPT]},
    }


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The children's environment: this one's, bytecode written (see the module doc)."""
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def timed(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Seconds from spawn to the first stdout byte and to exit; stderr kept for the phases."""
    import tempfile

    env = child_env(env)
    load_before = os.getloadavg()[0]
    # stderr to a file, not a pipe: -X importtime writes more than a pipe holds, and a child
    # blocked on a full stderr pipe would never write the stdout byte waited for here
    with tempfile.TemporaryFile() as errf:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=env)
        first = p.stdout.read(1)
        t_first = time.perf_counter() - t0
        out = first + p.stdout.read()
        rc = p.wait()
        errf.seek(0)
        err = errf.read()
    t_exit = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {rc}: {err.decode()[-500:]}")
    return {"first_byte_s": round(t_first if first else t_exit, 4), "exit_s": round(t_exit, 4),
            "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
            "stdout_head": out[:60].decode(errors="replace"),
            "stderr_tail": err.decode(errors="replace")[-300:],
            "import_s": import_seconds(err.decode(errors="replace"))}


def import_seconds(stderr: str) -> dict[str, float]:
    """Cumulative import seconds of torch and llama_cpp from `python -X importtime`'s lines
    (`import time: self | cumulative | name`), where the run printed them."""
    out = {}
    for m in re.finditer(r"import time:\s+\d+ \|\s+(\d+) \| (torch|llama_cpp)$", stderr,
                         re.MULTILINE):
        out[m.group(2)] = int(m.group(1)) / 1e6
    return out


def evict(path: str) -> None:
    """Drop the file's pages from the page cache (POSIX_FADV_DONTNEED: clean pages, no root
    needed), and those of the images slipstream keeps beside it (a resident CPU model's
    packed copies, which the next load maps), so the next run reads them from disk as a first
    run after a reboot would."""
    from slipstream.hub.store import written_beside

    for p in [Path(path), *written_beside(Path(path))]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cache_runs(model: str, ctx: int, threads: int, reps: int, engines: list[str]) -> dict:
    """`run -n 1` with a cold cache, then a warm one, alternating the engines, `reps` times.
    Cold: the model file out of the page cache and, for slipstream, an empty cache folder
    (SLIPSTREAM_CACHE; what it derives from a model, the tokenizer, is built again) holding
    only the native library built for this machine (built once per machine, not per model).
    Warm: the same command again. Each under -X importtime, so torch's import is measured in
    the run it is part of."""
    import shutil
    import tempfile

    from slipstream.hub.store import cache_dir

    plan = cases(model, ctx, threads)["run"]
    runs: dict[str, dict[str, list[dict]]] = {e: {"cold": [], "warm": []} for e in engines}
    for _ in range(reps):
        for engine in engines:
            cmd = [PY, "-X", "importtime", *plan[engine][1:]]
            env = dict(os.environ)
            tmp = None
            if engine == "slipstream":
                tmp = Path(tempfile.mkdtemp(prefix="ttft-cache-"))
                if (cache_dir() / "native").is_dir():
                    (tmp / "native").symlink_to(cache_dir() / "native")
                env["SLIPSTREAM_CACHE"] = str(tmp)
            try:
                evict(model)
                runs[engine]["cold"].append(timed(cmd, env))
                runs[engine]["warm"].append(timed(cmd, env))
            finally:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
            for state in ("cold", "warm"):
                r = runs[engine][state][-1]
                print(f"run/{state:4} {engine:17} {r['first_byte_s']:7.3f} s "
                      f"(torch import {r['import_s'].get('torch', 0):.2f} s)", file=sys.stderr)
    rows = []
    for state in ("cold", "warm"):
        row: dict = {"cache": state}
        for engine in engines:
            rs = runs[engine][state]
            first = statistics.median(r["first_byte_s"] for r in rs)
            row[engine] = {"first_token_s": round(first, 3)}
            loads = [p["load_s"] for p in (phases(r["stderr_tail"]) for r in rs) if p]
            if loads:  # slipstream's own summary line: the load alone
                row[engine]["load_s"] = round(statistics.median(loads), 3)
            torch_s = [r["import_s"]["torch"] for r in rs if "torch" in r["import_s"]]
            if torch_s:
                t = statistics.median(torch_s)
                row[engine]["torch_import_s"] = round(t, 3)
                row[engine]["first_token_less_torch_import_s"] = round(
                    statistics.median(r["first_byte_s"] - r["import_s"].get("torch", 0.0)
                                      for r in rs), 3)
        rows.append(row)
    return {"rows": rows, "runs": runs}


def cache_table(c: dict, engines: list[str]) -> list[str]:
    head = "| cache | " + " | ".join(
        f"{e} first token | {e} torch import | {e} less torch import | {e} load"
        if e == "slipstream" else f"{e} first token" for e in engines) + " |"
    lines = [head, "|---|" + "|".join("---:|---:|---:|---:" if e == "slipstream" else "---:"
                                      for e in engines) + "|"]
    for r in c["rows"]:
        cells = []
        for e in engines:
            v = r[e]
            cells.append(f"{v['first_token_s']:.2f} s")
            if e == "slipstream":
                cells += [f"{v.get('torch_import_s', float('nan')):.2f} s",
                          f"{v.get('first_token_less_torch_import_s', float('nan')):.2f} s",
                          f"{v.get('load_s', float('nan')):.2f} s"]
        lines.append(f"| {r['cache']} | " + " | ".join(cells) + " |")
    return lines


def phases(stderr: str) -> dict | None:
    """slipstream's summary line: `load X s | prompt N tok in Y ms ...`."""
    m = re.search(r"load ([\d.]+) s \| prompt \d+ tok in ([\d.]+) ms", stderr)
    return {"load_s": float(m.group(1)), "prompt_s": float(m.group(2)) / 1e3} if m else None


PROFILE = """
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from slipstream import api
t2 = time.perf_counter()
torch.set_num_threads(int(sys.argv[3]))
pr = cProfile.Profile()
pr.enable()
t3 = time.perf_counter()
m = api.load(sys.argv[1], device="cpu", ctx=int(sys.argv[2]))
t4 = time.perf_counter()
list(m.generate("Hello", max_tokens=1, temperature=0))
t5 = time.perf_counter()
pr.disable()
st = pstats.Stats(pr, stream=io.StringIO())
top = sorted(((v[3], f"{k[0].split('/src/')[-1]}:{k[1]}({k[2]})") for k, v in st.stats.items()
              if "/slipstream/" in k[0]), reverse=True)[:25]
print(json.dumps({"import_torch_s": t1 - t0, "import_slipstream_api_s": t2 - t1,
                  "load_s_under_cprofile": t4 - t3, "first_token_s": t5 - t4,
                  "cumulative_s_by_function": [[round(c, 3), f] for c, f in top]}))
"""


def profile(model: str, ctx: int, threads: int) -> dict:
    """Where slipstream's `run` spends its time, in-process: the imports, the load, the first
    token, and cProfile's cumulative seconds of slipstream's own functions in the load."""
    r = subprocess.run([PY, "-c", PROFILE, model, str(ctx), str(threads)], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def versions() -> dict:
    v = {}
    for name in ("torch", "llama_cpp", "huggingface_hub"):
        r = subprocess.run([PY, "-c", f"import {name}; print({name}.__version__)"],
                           capture_output=True, text=True)
        v[name] = r.stdout.strip() or None
    return v

# --serve: the servers' time to first token --------------------------------------------------

SERVE_PROMPT_TOKENS = 64
LEADS = ("Amber", "Birch", "Cedar", "Delta", "Ember", "Falcon", "Garnet", "Harbor", "Indigo",
         "Juniper", "Kestrel", "Lantern", "Meadow", "Nimbus", "Orchid", "Pebble", "Quartz",
         "Raven", "Saffron", "Thistle", "Umber", "Violet", "Willow", "Yarrow", "Zephyr")
PASSAGE = ("tells the story of a small harbor town where the fishing boats come home at dusk, "
           "the lighthouse keeper writes down the weather in a worn notebook, and the children "
           "race along the sea wall to count the gulls before the lamps are lit along the "
           "quay, while the old ferry waits at the pier for the morning tide and the baker")


def serve_prompts(model: str, n: int) -> list[str]:
    """n prompts of SERVE_PROMPT_TOKENS tokens (slipstream's tokenizer; the servers' usage
    counts are checked against it), each starting with a word of its own."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.modelfile.tokenizer_cache import load_tokenizer

    tok = load_tokenizer(GGUFFile(model), None)
    out = []
    for i in range(n):
        ids = tok.encode(f"{LEADS[i % len(LEADS)]} {i} {PASSAGE}")[:SERVE_PROMPT_TOKENS]
        text = tok.decode(ids)
        if len(tok.encode(text)) != SERVE_PROMPT_TOKENS:
            raise SystemExit(f"prompt {i} does not come back as {SERVE_PROMPT_TOKENS} tokens")
        out.append(text)
    return out


def start_servers(model: str, ctx: int, threads: int, logs: Path) -> dict:
    """Both servers on free loopback ports: {name: (process, url)}, once each answers."""
    import socket

    import httpx

    def port() -> int:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return sk.getsockname()[1]

    ports = {"slipstream": port(), "llama-cpp-python": port()}
    cmds = {"slipstream": [PY, "-m", "slipstream", "serve", "-m", model, "--device", "cpu",
                           "--ctx", str(ctx), "-t", str(threads), "--host", "127.0.0.1",
                           "--port", str(ports["slipstream"])],
            "llama-cpp-python": [PY, "-m", "llama_cpp.server", "--model", model, "--n_ctx",
                                 str(ctx), "--n_threads", str(threads), "--n_threads_batch",
                                 str(threads), "--host", "127.0.0.1", "--port",
                                 str(ports["llama-cpp-python"]), "--verbose", "False"]}
    procs = {}
    for name, cmd in cmds.items():
        log = (logs / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env=child_env()), f"http://127.0.0.1:{ports[name]}")
    deadline = time.monotonic() + 300
    for name, (proc, url) in procs.items():
        while True:
            if proc.poll() is not None:
                stop_servers(procs)
                raise SystemExit(f"{name}'s server exited {proc.returncode}: "
                                 f"{(logs / f'{name}.log').read_text()[-1500:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                stop_servers(procs)
                raise SystemExit(f"{name}'s server did not answer within 300 s")
            time.sleep(0.3)
    return procs


def stop_servers(procs: dict) -> None:
    for proc, _ in procs.values():
        proc.terminate()
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def first_text_s(url: str, prompt: str) -> tuple[float, str]:
    """Seconds from sending a streamed completion of `prompt` to the first chunk with text."""
    import httpx

    body = {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
                if text:
                    return time.perf_counter() - t0, text
    raise SystemExit(f"{url}: no text in the stream")


def prompt_tokens(url: str, prompt: str) -> int:
    """The server's own count of the prompt's tokens (a plain request's usage)."""
    import httpx

    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": prompt,
                                                   "max_tokens": 1, "temperature": 0.0},
                   timeout=120)
    r.raise_for_status()
    return int(r.json()["usage"]["prompt_tokens"])


def serve_case(model: str, ctx: int, threads: int, reps: int) -> dict:
    """The figures of --serve (see the module doc)."""
    import tempfile

    prompts = serve_prompts(model, reps + 2)
    with tempfile.TemporaryDirectory(prefix="ttft-serve-") as logs:
        procs = start_servers(model, ctx, threads, Path(logs))
        try:
            counts = {n: prompt_tokens(url, prompts[0]) for n, (_, url) in procs.items()}
            for n, (_, url) in procs.items():  # warm: the first requests' one-time costs
                first_text_s(url, prompts[1])
            runs: dict[str, list[dict]] = {n: [] for n in procs}
            for i in range(reps):
                for n, (_, url) in procs.items():
                    load = os.getloadavg()[0]
                    s, text = first_text_s(url, prompts[i + 2])
                    runs[n].append({"ttft_s": round(s, 4), "first_text": text,
                                    "loadavg_1m_before": load})
                    print(f"serve {n:17} {s:7.3f} s", file=sys.stderr)
        finally:
            stop_servers(procs)
    med = {n: statistics.median(r["ttft_s"] for r in rs) for n, rs in runs.items()}
    ratio = med["slipstream"] / med["llama-cpp-python"]
    return {"prompt_tokens": SERVE_PROMPT_TOKENS, "prompt_tokens_by_server": counts,
            "threads": threads, "ctx": ctx, "reps": reps, "model": model,
            "statistic": "median seconds from sending a streamed /v1/completions request to "
                         "the first chunk with text, warm servers, alternating",
            "ttft_s": {n: round(v, 4) for n, v in med.items()}, "ratio": round(ratio, 3),
            "meets_1_2x": ratio <= 1.2, "runs": runs,
            "loadavg_1m": [r["loadavg_1m_before"] for rs in runs.values() for r in rs],
            "versions": versions()}


def write_serve(a, doc: dict) -> None:
    import common

    path = common.write_result("ttft-serve", {**common.provenance("cpu"), **doc})
    t = doc["ttft_s"]
    print(f"server time to first token, {SERVE_PROMPT_TOKENS}-token prompt, median of "
          f"{a.reps}: slipstream {t['slipstream']:.3f} s, llama-cpp-python "
          f"{t['llama-cpp-python']:.3f} s, ratio {doc['ratio']:.2f} (target <= 1.2); "
          f"prompt tokens counted by the servers {doc['prompt_tokens_by_server']}; {path}")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: slipstream's default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=4096, help="slipstream's default for this model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="PREFIX: writes PREFIX.json and PREFIX.txt")
    ap.add_argument("--profile", action="store_true", help="also break slipstream's run down "
                    "in-process (imports, load, first token; cProfile of the load)")
    ap.add_argument("--cache-only", action="store_true", help="only the cold/warm cache "
                    "table of `run -n 1` (and torch's import in it)")
    ap.add_argument("--serve", action="store_true", help="only the servers' time to first "
                    "token (see the module doc)")
    a = ap.parse_args()
    if a.model is None:
        from slipstream.hub.pull import pull

        a.model = str(pull(quiet=True))
    if a.serve:
        return write_serve(a, serve_case(a.model, a.ctx, a.threads, a.reps))
    have_llama = subprocess.run([PY, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    engines = ["slipstream"] + (["llama-cpp-python"] if have_llama else [])
    cache = cache_runs(a.model, a.ctx, a.threads, a.reps, engines)
    if a.cache_only or not have_llama:
        return write_cache_only(a, cache, engines, have_llama)
    plan = cases(a.model, a.ctx, a.threads)
    runs: dict[str, dict[str, list[dict]]] = {c: {e: [] for e in v} for c, v in plan.items()}
    for case, engines in plan.items():
        for cmd in engines.values():
            timed(cmd)  # warm-up: page cache, .pyc files
        for _ in range(a.reps):
            for engine, cmd in engines.items():
                runs[case][engine].append(timed(cmd))
                print(f"{case:5} {engine:17} {runs[case][engine][-1]['first_byte_s']:7.3f} s",
                      file=sys.stderr)
    rows = []
    for case, engines in runs.items():
        med = {e: statistics.median(r["first_byte_s"] for r in rs) for e, rs in engines.items()}
        ratio = med["slipstream"] / med["llama-cpp-python"]
        row = {"case": case, "slipstream_s": round(med["slipstream"], 3),
               "llama_cpp_python_s": round(med["llama-cpp-python"], 3),
               "ratio": round(ratio, 2), "meets_1_5x": ratio <= 1.5}
        ph = [p for p in (phases(r["stderr_tail"]) for r in engines["slipstream"]) if p]
        if ph:
            load = statistics.median(p["load_s"] for p in ph)
            prompt = statistics.median(p["prompt_s"] for p in ph)
            row["slipstream_phases_s"] = {"load": round(load, 3), "prompt": round(prompt, 3),
                                          "imports_and_rest": round(med["slipstream"] - load
                                                                    - prompt, 3)}
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    loads = [r[k] for e in runs.values() for rs in e.values() for r in rs
             for k in ("loadavg_1m_before", "loadavg_1m_after")]
    result = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "working_tree_modified": bool(dirty.strip()),
              "machine": machine(), "versions": versions(), "model": a.model,
              "ctx": a.ctx, "threads": a.threads, "reps": a.reps, "prompt": PROMPT,
              "statistic": "median seconds from process spawn to the first byte on stdout",
              "loadavg_1m": {"min": min(loads), "max": max(loads)},
              "commands": plan, "rows": rows, "runs": runs, "run_by_cache": cache}
    if a.profile:
        result["profile"] = profile(a.model, a.ctx, a.threads)
    lines = [f"time to first token, cold process, median of {a.reps} "
             f"({result['date']}, {commit[:10]}{' +changes' if dirty.strip() else ''}, "
             f"{result['machine']['cpu']}, {result['machine']['cores']} cores, load average "
             f"{min(loads):.1f}-{max(loads):.1f}, ctx {a.ctx}, {a.threads} thread(s))",
             "", "| case | slipstream | llama-cpp-python | ratio (target <= 1.5) |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['slipstream_s']:.2f} s | "
                     f"{r['llama_cpp_python_s']:.2f} s | {r['ratio']:.2f} |")
    lines += ["", "run -n 1 by cache state (cold: the model out of the page cache, "
              "slipstream's derived caches empty), medians:", ""] + cache_table(cache, engines)
    for r in rows:
        if "slipstream_phases_s" in r:
            p = r["slipstream_phases_s"]
            lines.append(f"\nslipstream {r['case']}: imports and start-up "
                         f"{p['imports_and_rest']:.2f} s, load {p['load']:.2f} s, prompt "
                         f"{p['prompt']:.2f} s (its summary line, medians)")
    if a.profile:
        p = result["profile"]
        lines += ["", f"slipstream run, in-process: import torch {p['import_torch_s']:.2f} s, "
                  f"import slipstream.api {p['import_slipstream_api_s']:.2f} s, load "
                  f"{p['load_s_under_cprofile']:.2f} s (under cProfile), first token "
                  f"{p['first_token_s']:.2f} s; cumulative seconds in the load:"]
        lines += [f"  {c:6.3f}  {f}" for c, f in p["cumulative_s_by_function"][:16]]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(a.out + ".txt").write_text(text)


def write_cache_only(a, cache: dict, engines: list[str], have_llama: bool) -> None:
    """The cold/warm table alone (--cache-only, or llama-cpp-python not importable)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    loads = [r[k] for e in cache["runs"].values() for rs in e.values() for r in rs
             for k in ("loadavg_1m_before", "loadavg_1m_after")]
    result = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "machine": machine(), "versions": versions(),
              "model": a.model, "ctx": a.ctx, "threads": a.threads, "reps": a.reps,
              "env": {k: v for k, v in os.environ.items() if k.startswith("SLIPSTREAM_")},
              "llama_cpp_python": "compared" if have_llama else "not importable: slipstream alone",
              "loadavg_1m": {"min": min(loads), "max": max(loads)}, "run_by_cache": cache}
    lines = [f"run -n 1, time to first token by cache state, median of {a.reps} "
             f"({result['date']}, {commit[:10]}, {result['machine']['cpu']}, load average "
             f"{min(loads):.1f}-{max(loads):.1f}, {a.threads} thread(s))"
             + ("" if have_llama else "; llama-cpp-python not importable"), ""]
    text = "\n".join(lines + cache_table(cache, engines)) + "\n"
    print(text)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(a.out + ".txt").write_text(text)


if __name__ == "__main__":
    main()
