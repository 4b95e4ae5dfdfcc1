"""Loopback load on `slipstream serve`: latency, time to first token, tokens/s, errors.

    python benchmarks/serve_load.py                 # starts a server on the default model (CPU)
    python benchmarks/serve_load.py --url http://127.0.0.1:8080
    python benchmarks/serve_load.py --requests 32 --concurrency 4 --max-tokens 32 --out FILE.json

Sends `--requests` streamed requests from `--concurrency` client threads, alternating
/v1/chat/completions and /v1/completions over a few prompts (temperature 0.7, seeded, so runs
are comparable). The server runs one generation at a time, so latency includes queueing: with
4 clients a request waits for about 3 others. Figures:

- latency: request sent to `data: [DONE]` received;
- TTFT: request sent to the first chunk carrying text (queueing + prefill + one token);
- tokens/s aggregate: completion tokens of all requests over the wall time of the load;
- tokens/s per request: (completion tokens - 1) / (last byte - first text), the decode rate a
  client sees once its generation runs.

Writes JSON (device, date, commit, config, figures) to `--out` (default
benchmarks/results/<date>-serve-load-<device>.json) and exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of France, and what is it known for?",
    "Give three tips for learning to cook.",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system.",
    "Why do we need sleep?",
    "Tell me a short story about a robot who learns to paint.",
]


@dataclass
class Result:
    index: int
    endpoint: str
    status: int
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    decode_tok_s: float | None
    error: str | None = None


def one_request(client: httpx.Client, url: str, i: int, max_tokens: int) -> Result:
    chat = i % 2 == 0
    prompt = PROMPTS[i % len(PROMPTS)]
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                else {"prompt": prompt})
    t0 = time.perf_counter()
    t_first = None
    tokens = 0
    done = False
    try:
        with client.stream("POST", url + endpoint, json=body) as r:
            if r.status_code != 200:
                return Result(i, endpoint, r.status_code, time.perf_counter() - t0, None, 0,
                              None, r.read().decode(errors="replace")[:300])
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    text = c["delta"].get("content") if chat else c.get("text")
                    if text and t_first is None:
                        t_first = time.perf_counter()
    except Exception as e:  # counted as an error, the load goes on
        return Result(i, endpoint, 0, time.perf_counter() - t0, None, 0, None,
                      f"{type(e).__name__}: {e}")
    t_end = time.perf_counter()
    if not done:
        return Result(i, endpoint, 200, t_end - t0, None, tokens, None, "no [DONE] line")
    rate = (tokens - 1) / (t_end - t_first) if t_first and tokens > 1 and t_end > t_first \
        else None
    return Result(i, endpoint, 200, t_end - t0, t_first - t0 if t_first else None, tokens, rate)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkstemp(prefix="serve-load-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "slipstream", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--device", args.device, "--max-queue", str(max(16, args.concurrency))]
    if args.model:
        cmd += ["-m", args.model]
    if args.ctx:
        cmd += ["--ctx", str(args.ctx)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, 300)
    return proc, url, log


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, seconds: float) -> None:
    """Return once the server at `url` answers /health 200; exit with its log's tail if it
    dies or is not healthy within `seconds` (serve_soak.py uses it too)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server was not healthy within {seconds:g} s:\n{log.read_text()[-3000:]}")


def git_commit() -> str | None:
    from slipstream.provenance import source_revision

    return source_revision()["commit"]


def run_load(url: str, n: int, concurrency: int, max_tokens: int) -> tuple[list[Result], float]:
    local = threading.local()

    def task(i: int) -> Result:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=httpx.Timeout(600, connect=10))
        return one_request(local.client, url, i, max_tokens)

    with httpx.Client(timeout=600) as c:  # warm-up, not counted
        one_request(c, url, 0, 4)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(task, range(n)))
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    rates = [r.decode_tok_s for r in ok if r.decode_tok_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests_ok": len(ok), "errors": len(results) - len(ok), "wall_s": wall_s,
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "completion_tokens": tokens, "tokens_per_s_aggregate": tokens / wall_s,
        "tokens_per_s_per_request_p50": percentile(rates, 50),
        "requests_per_s": len(ok) / wall_s,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="device of a server this script starts")
    p.add_argument("-m", "--model", help="GGUF for a server this script starts (default model)")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--out", help="JSON path (default benchmarks/results/<date>-serve-load-<dev>.json)")
    args = p.parse_args()

    load_at_start = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    proc = log = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        proc, url, log = start_server(args)
    try:
        health = httpx.get(url + "/health", timeout=10).json()
        results, wall = run_load(url, args.requests, args.concurrency, args.max_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            log.unlink(missing_ok=True)
    figures = summarize(results, wall)

    device = health.get("device", "unknown")
    t = Table(title=f"serve load on {device}",
              caption=f"{health.get('model')}: {args.requests} requests, {args.concurrency} "
                      f"concurrent, max_tokens {args.max_tokens}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name, fmt in [("latency p50 (s)", "latency_p50_s"), ("latency p95 (s)", "latency_p95_s"),
                      ("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p95 (s)", "ttft_p95_s"),
                      ("tokens/s aggregate", "tokens_per_s_aggregate"),
                      ("tokens/s per request p50", "tokens_per_s_per_request_p50"),
                      ("requests/s", "requests_per_s"),
                      ("completion tokens", "completion_tokens"), ("wall (s)", "wall_s"),
                      ("errors", "errors")]:
        v = figures[fmt]
        t.add_row(name, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(t)
    for r in results:
        if r.error:
            Console(stderr=True).print(f"[red]request {r.index} ({r.endpoint}): {r.status} "
                                       f"{r.error}[/red]", highlight=False)

    date = time.strftime("%Y-%m-%d", time.gmtime())
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" /
                                           f"{date}-serve-load-{device.split(':')[0]}.json")
    doc = {"bench": "serve_load", "device": device, "model": health.get("model"),
           "ctx": health.get("ctx"), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": git_commit(), "host_cpus": os.cpu_count(),
           "loadavg_1m_at_start": load_at_start,  # other jobs share the CPU: context for noise
           "config": {"requests": args.requests, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "temperature": 0.7, "stream": True,
                      "server": "started by this script" if proc else "--url"},
           "results": figures, "requests": [asdict(r) for r in results]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 1 if figures["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
