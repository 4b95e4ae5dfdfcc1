"""Soak `slipstream serve`: many small requests from clients that honour Retry-After.

    python benchmarks/serve_soak.py                             # 10k requests, 8 clients
    python benchmarks/serve_soak.py --requests 500 --time-limit 120  # a short run

Starts a server on the default model (CPU) with a small wait queue (`--max-queue 4`), so that
8 clients overflow it and get 503 + Retry-After; a client then sleeps what Retry-After says
and sends the same request again. Requests rotate over chat and completions, streamed and not,
with a few prompts and small max_tokens (4), so the soak measures the server (HTTP, queue,
validation, memory) more than the model.

Every answer is checked: a 200 must be a well-formed OpenAI body (or an SSE stream of JSON
chunks ending in `data: [DONE]`) with usage consistent with max_tokens; a 503 must carry a
Retry-After; anything else counts as a failure. The server's RSS is sampled throughout; its
growth is measured from the end of the warm-up to the end.

Figures (JSON and a text table, in benchmarks/results): requests done, 5xx other than the
Retry-After 503s, invalid bodies, 503s honoured, RSS at warm-up end / end / max and the growth,
latency p50/p95 (first send to final answer, Retry-After waits included, and of the answered
attempt alone). Exits 1 when a check fails (5xx, invalid body, RSS growth >= 50 MB).

`--time-limit S` stops sending new requests after S seconds (the figures then say how many ran),
for machines that cannot run the whole soak in the time they have. SIGTERM or Ctrl-C does the
same at once: the requests in flight finish, and the figures of what ran are written.

`-t N` sets the server's torch threads (recorded with the figures, with this process's nice
level): on a small shared machine, `-t 1` leaves a core to the clients and to other work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

# benchmarks/ on the path whoever loads this file (the tests load its client by path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import percentile, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Give three tips for learning to cook.",
    "List the planets.",
    "Why do we need sleep?",
]
KINDS = ("chat", "completion", "chat-stream", "completion-stream")
RSS_LIMIT_MB = 50
MAX_ATTEMPTS = 100  # a request retried this often after 503s counts as failed


@dataclass
class Outcome:
    index: int
    kind: str
    status: int  # the final answer's status (0: transport error)
    latency_s: float  # first send to final answer, Retry-After waits included
    attempt_s: float  # the answered attempt alone
    retries: int  # 503s honoured before the answer
    error: str | None = None  # why the answer is not valid (None: valid)


def check_body(kind: str, body: dict, max_tokens: int) -> str | None:
    """None if `body` is a valid non-streamed answer of this kind, else what is wrong."""
    chat = kind.startswith("chat")
    try:
        assert body["object"] == ("chat.completion" if chat else "text_completion"), "object"
        assert isinstance(body["id"], str) and body["id"], "id"
        choice, = body["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str), "text"
        if chat:
            assert choice["message"]["role"] == "assistant", "role"
        assert choice["finish_reason"] in ("stop", "length"), "finish_reason"
        u = body["usage"]
        assert 1 <= u["completion_tokens"] <= max_tokens, "completion_tokens"
        assert u["prompt_tokens"] >= 1, "prompt_tokens"
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], "total_tokens"
        if choice["finish_reason"] == "length":
            assert u["completion_tokens"] == max_tokens, "length before max_tokens"
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        return f"invalid body ({e}): {json.dumps(body)[:200]}"
    return None


def check_stream(kind: str, lines: list[str]) -> str | None:
    """None if the SSE lines are JSON chunks ending in [DONE] with one finish_reason."""
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return f"stream does not end in [DONE]: {data[-3:]}"
    finishes = []
    try:
        for d in data[:-1]:
            chunk = json.loads(d)
            if "error" in chunk:
                return f"error in stream: {d[:200]}"
            assert chunk["object"] == ("chat.completion.chunk" if kind.startswith("chat")
                                       else "text_completion"), "object"
            for c in chunk["choices"]:
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        return f"invalid stream chunk ({e})"
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"stream finish reasons {finishes}"
    return None


def request_for(i: int, max_tokens: int) -> tuple[str, str, dict]:
    kind = KINDS[i % len(KINDS)]
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict = {"max_tokens": max_tokens, "temperature": 0.7, "seed": i}
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    if kind.endswith("stream"):
        body["stream"] = True
    return kind, path, body


def one(client: httpx.Client, url: str, i: int, max_tokens: int) -> Outcome:
    kind, path, body = request_for(i, max_tokens)
    t0 = time.perf_counter()
    retries = 0
    while True:
        ta = time.perf_counter()
        try:
            if body.get("stream"):
                with client.stream("POST", url + path, json=body) as r:
                    lines = list(r.iter_lines()) if r.status_code == 200 else []
                    if r.status_code != 200:
                        r.read()
            else:
                r = client.post(url + path, json=body)
        except httpx.HTTPError as e:
            now = time.perf_counter()
            return Outcome(i, kind, 0, now - t0, now - ta, retries, f"{type(e).__name__}: {e}")
        now = time.perf_counter()
        if r.status_code in (429, 503):
            after = r.headers.get("retry-after")
            if after is None or not after.isdigit():
                return Outcome(i, kind, r.status_code, now - t0, now - ta, retries,
                               f"{r.status_code} without a Retry-After: {r.text[:200]}")
            retries += 1
            if retries >= MAX_ATTEMPTS:
                return Outcome(i, kind, r.status_code, now - t0, now - ta, retries,
                               f"still {r.status_code} after {retries} attempts")
            time.sleep(int(after))  # honour it: the server said when a slot is likely free
            continue
        if r.status_code != 200:
            return Outcome(i, kind, r.status_code, now - t0, now - ta, retries,
                           f"status {r.status_code}: {r.text[:200]}")
        try:
            error = (check_stream(kind, lines) if body.get("stream")
                     else check_body(kind, r.json(), max_tokens))
        except ValueError as e:
            error = f"body is not JSON ({e}): {r.text[:200]}"
        return Outcome(i, kind, 200, now - t0, now - ta, retries, error)


class RssSampler(threading.Thread):
    """Samples the server's RSS every `every_s` seconds (and on demand with `now()`)."""

    def __init__(self, pid: int, every_s: float = 1.0):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def now(self) -> int:
        rss = self.proc.memory_info().rss
        self.samples.append((time.monotonic(), rss))
        return rss

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.now()
            except psutil.Error:
                return


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkstemp(prefix="serve-soak-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "slipstream", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--device", "cpu", "--max-queue", str(args.max_queue)]
    if args.model:
        cmd += ["-m", args.model]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, 600)
    return proc, url, log


def run_soak(url: str, sampler: RssSampler, args, stop: threading.Event
             ) -> tuple[list[Outcome], dict]:
    """Warm-up requests first (not counted), then `args.requests` from args.concurrency
    threads, each taking the next index until the count or the time limit is reached, or
    `stop` is set."""
    with httpx.Client(timeout=httpx.Timeout(300, connect=10)) as c:
        for i in range(args.warmup):
            o = one(c, url, -1 - i, args.max_tokens)
            if o.error:
                sys.exit(f"warm-up request failed: {o.error}")
    rss_start = sampler.now()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    next_index = [0]
    t0 = time.monotonic()
    stop_at = t0 + args.time_limit if args.time_limit else float("inf")

    def worker() -> None:
        with httpx.Client(timeout=httpx.Timeout(300, connect=10)) as c:
            while True:
                with lock:
                    i = next_index[0]
                    if (i >= args.requests or time.monotonic() >= stop_at
                            or stop.is_set()):
                        return
                    next_index[0] += 1
                o = one(c, url, i, args.max_tokens)
                with lock:
                    outcomes.append(o)
                    n = len(outcomes)
                if n % args.progress_every == 0:
                    print(f"{n} requests, {time.monotonic() - t0:.0f} s, RSS "
                          f"{sampler.now() / 2**20:.1f} MiB", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    rss_end = sampler.now()
    return sorted(outcomes, key=lambda o: o.index), {"wall_s": wall, "rss_start": rss_start,
                                                     "rss_end": rss_end}


def summarize(outcomes: list[Outcome], run: dict, sampler: RssSampler) -> dict:
    valid = [o for o in outcomes if o.error is None]
    lat = [o.latency_s for o in valid]
    att = [o.attempt_s for o in valid]
    rss_max = max(r for t, r in sampler.samples) if sampler.samples else run["rss_end"]
    growth = (run["rss_end"] - run["rss_start"]) / 1e6
    by_kind = {k: sum(1 for o in outcomes if o.kind == k) for k in KINDS}
    return {
        "requests": len(outcomes), "valid": len(valid),
        "status_5xx": sum(1 for o in outcomes if o.status >= 500),
        "invalid_bodies": sum(1 for o in outcomes if o.status == 200 and o.error),
        "other_failures": sum(1 for o in outcomes if o.status != 200 and o.error),
        "retry_after_503s_honoured": sum(o.retries for o in outcomes),
        "requests_that_waited": sum(1 for o in outcomes if o.retries),
        "by_kind": by_kind,
        "wall_s": round(run["wall_s"], 1),
        "requests_per_s": round(len(outcomes) / run["wall_s"], 2) if run["wall_s"] else None,
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "latency_max_s": max(lat) if lat else None,
        "answered_attempt_p50_s": percentile(att, 50),
        "answered_attempt_p95_s": percentile(att, 95),
        "rss_warm_mb": round(run["rss_start"] / 1e6, 1),
        "rss_end_mb": round(run["rss_end"] / 1e6, 1),
        "rss_max_mb": round(rss_max / 1e6, 1),
        "rss_growth_mb": round(growth, 1),
    }


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_dirty() -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln[3:] for ln in out.splitlines()]


def table(doc: dict) -> str:
    f, c = doc["results"], doc["config"]
    rows = [
        ("date", doc["date"]), ("commit", f"{doc['commit']} (+ uncommitted changes to "
                                          f"{len(doc['uncommitted'])} files) at the start"
                                          + (f"; HEAD was {doc['commit_at_end'][:7]} at the "
                                             f"end" if doc.get("commit_at_end") else "")),
        ("machine", doc["machine"]), ("model", f"{doc['model']} on {doc['device']}"),
        ("load", f"{c['requests']} requests asked, concurrency {c['concurrency']}, max_tokens "
                 f"{c['max_tokens']}, server --max-queue {c['max_queue']}, server threads "
                 f"{c.get('threads') or 'torch default'}, nice {c.get('nice', 0)}"
                 + (f", time limit {c['time_limit_s']} s" if c["time_limit_s"] else "")),
        ("requests done", f"{f['requests']} ({f['valid']} valid) in {f['wall_s']} s, "
                          f"{f['requests_per_s']} req/s"),
        ("5xx", f["status_5xx"]), ("invalid bodies", f["invalid_bodies"]),
        ("other failures", f["other_failures"]),
        ("503 + Retry-After honoured", f"{f['retry_after_503s_honoured']} (by "
                                       f"{f['requests_that_waited']} requests)"),
        ("latency p50 / p95 / max", f"{f['latency_p50_s']:.3f} / {f['latency_p95_s']:.3f} / "
                                    f"{f['latency_max_s']:.3f} s (Retry-After waits included)"),
        ("answered attempt p50 / p95", f"{f['answered_attempt_p50_s']:.3f} / "
                                       f"{f['answered_attempt_p95_s']:.3f} s"),
        ("server RSS warm / end / max", f"{f['rss_warm_mb']} / {f['rss_end_mb']} / "
                                        f"{f['rss_max_mb']} MB"),
        ("RSS growth", f"{f['rss_growth_mb']} MB (limit {RSS_LIMIT_MB} MB)"),
        ("verdict", doc["verdict"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=4,
                   help="the server's wait queue: below the concurrency, so 503s happen")
    p.add_argument("--warmup", type=int, default=50, help="requests before RSS is measured")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="send no new request after S seconds")
    p.add_argument("-m", "--model", help="GGUF (default: the default model)")
    p.add_argument("-t", "--threads", type=int, default=None, help="the server's threads")
    p.add_argument("--progress-every", type=int, default=250)
    p.add_argument("--out", help="JSON path (a .txt table is written next to it)")
    args = p.parse_args()

    stop = threading.Event()  # SIGTERM / Ctrl-C: send nothing more, write what ran

    def on_signal(signum, frame) -> None:
        print(f"signal {signum}: no new requests; finishing those in flight", flush=True)
        stop.set()

    # the tree the server runs is the one at its start: commits made during a long soak are not
    # in it, so the figures name the start's commit and changes (and the end's, if it moved)
    commit, uncommitted = git_head(), git_dirty()
    proc, url, log = start_server(args)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        health = httpx.get(url + "/health", timeout=10).json()
        outcomes, run = run_soak(url, sampler, args, stop)
        alive = proc.poll() is None
    finally:
        sampler.stop.set()
        proc.terminate()
        proc.wait(30)
    figures = summarize(outcomes, run, sampler)
    failed = [o for o in outcomes if o.error]
    checks = {"no 5xx": figures["status_5xx"] == 0,
              "no invalid bodies": figures["invalid_bodies"] == 0,
              "no other failures": figures["other_failures"] == 0,
              f"RSS growth < {RSS_LIMIT_MB} MB": figures["rss_growth_mb"] < RSS_LIMIT_MB,
              "server alive at the end": alive}
    verdict = ("pass" if all(checks.values()) else
               "FAIL: " + ", ".join(k for k, v in checks.items() if not v))
    if figures["requests"] < args.requests:  # the run was cut short: say so, and why
        why = ("a signal ended the run" if stop.is_set() else
               f"the --time-limit of {args.time_limit:.0f} s ended the run")
        verdict += f" on {figures['requests']} of the {args.requests} requests asked ({why})"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    doc = {"bench": "serve_soak", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": commit, "uncommitted": uncommitted,
           **({"commit_at_end": git_head()} if git_head() != commit else {}),
           "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
                      f"Linux {platform.release()}, load avg "
                      f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
           "model": health.get("model"), "device": health.get("device"),
           "ctx": health.get("ctx"),
           "config": {"requests": args.requests, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "max_queue": args.max_queue,
                      "warmup": args.warmup, "time_limit_s": args.time_limit,
                      "threads": args.threads, "nice": os.nice(0),
                      "kinds": list(KINDS), "temperature": 0.7},
           "results": figures, "checks": checks, "verdict": verdict,
           "failures": [asdict(o) for o in failed[:50]],
           "rss_samples_mb": [round(r / 1e6, 1) for _, r in sampler.samples[::10]]}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{date}-serve-soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    text = table(doc)
    out.with_suffix(".txt").write_text(text)
    print(text + f"wrote {out} and {out.with_suffix('.txt').name}")
    log.unlink(missing_ok=True)
    return 0 if verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
