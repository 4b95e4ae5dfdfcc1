"""Host memory shared by hybrid decode's two paths: the CPU kernel's GB/s and the pinned copy's,
each alone and both at once, by CPU thread count, over buffers far past the host's caches; and
the start-up probe's figures (hybrid.plan.cpu_packed_gbps) beside them.

    python bench/hybrid_bus.py OUTDIR [--threads 8,10,12,14,15,16] [--gib 1.5] [--seconds 1]

Why: session 29's H100 host carried 126-130 GB/s in all during every q4vnni decode of the 70B,
split 76.8 + 53.3 in one call (5.77 tok/s) and 83.9 + 42.3 in the next (4.88) at nearly the same
CPU share, while the start-up probe had read 110-131 GB/s on the CPU and 54 over PCIe at the same
time (bench/results/2026-12-05-session29.md). Whether the probe's small buffers flatter both
rates, and how many threads leave the copies their link, is what this measures; the kind is
hybrid.ffn.HOST_KIND's (SLIPSTREAM_HYBRID_KIND). Without CUDA only the CPU's column runs.
Prints a table; writes OUTDIR/hybrid-bus.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.hybrid.plan import _host_matmul, cpu_packed_gbps  # noqa: E402
from slipstream.provenance import cpu_name, source_revision  # noqa: E402
from slipstream.hybrid.ffn import HOST_KIND  # noqa: E402

CHUNK = 256 << 20  # one copy: a few layers' GPU share of a 70B, as the ring moves them
COLS = 8192


def cpu_alone(one, nbytes: int, seconds: float) -> float:
    one()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one()
        n += 1
    return nbytes * n / (time.perf_counter() - t0) / 1e9


def queue_copies(hosts, dev, count: int):
    """`count` copies cycling over the distinct pinned chunks, on a side stream; its events."""
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for i in range(count):
            dev.copy_(hosts[i % len(hosts)], non_blocking=True)
        end.record(stream)
    return start, end


def copy_alone(hosts, dev, seconds: float, link_gbps: float = 55.0) -> float:
    count = max(len(hosts), int(seconds * link_gbps * 1e9 / CHUNK))
    start, end = queue_copies(hosts, dev, count)
    end.synchronize()
    return CHUNK * count / (start.elapsed_time(end) / 1e3) / 1e9


def together(one, nbytes: int, hosts, dev, seconds: float, link_gbps: float = 55.0
             ) -> tuple[float, float]:
    count = max(len(hosts), int(seconds * link_gbps * 1e9 / CHUNK))
    start, end = queue_copies(hosts, dev, count)
    n, t0 = 0, time.perf_counter()
    while not end.query() or n < 2:
        one()
        n += 1
    cpu_s = time.perf_counter() - t0
    end.synchronize()
    return nbytes * n / cpu_s / 1e9, CHUNK * count / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--threads", default="8,10,12,14,15,16")
    ap.add_argument("--gib", type=float, default=1.5, help="each path's buffers, in GiB")
    ap.add_argument("--seconds", type=float, default=1.0)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    # the CPU's weight: rows for about --gib of packed bytes (q4vnni's probe scale included)
    _, bytes_16_rows = _host_matmul(16, COLS, 1)
    rows = max(16, int(a.gib * 2**30 / (bytes_16_rows / 16)) // 16 * 16)
    one, nbytes = _host_matmul(rows, COLS, 1)
    hosts, dev = [], None
    if cuda:
        hosts = [torch.empty(CHUNK, dtype=torch.uint8).pin_memory()
                 for _ in range(max(2, int(a.gib * 2**30 // CHUNK)))]
        for h in hosts:
            h.fill_(1)  # touched: its pages are real
        dev = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    rows_out = []
    saved = torch.get_num_threads()
    print(f"{'threads':>7} {'cpu alone':>9} {'copy alone':>10} {'cpu with':>9} {'copy with':>9} "
          f"{'sum':>6} {'probe cpu':>9} {'probe copy':>10}  (GB/s, kind {HOST_KIND})")
    for n in [int(t) for t in a.threads.split(",") if t]:
        torch.set_num_threads(n)
        row = {"threads": n, "cpu_alone_gbps": round(cpu_alone(one, nbytes, a.seconds), 1)}
        if cuda:
            row["copy_alone_gbps"] = round(copy_alone(hosts, dev, a.seconds), 1)
            c, p = together(one, nbytes, hosts, dev, a.seconds)
            row.update(cpu_with_copy_gbps=round(c, 1), copy_with_cpu_gbps=round(p, 1),
                       sum_gbps=round(c + p, 1))
            pc, pp = cpu_packed_gbps(n, beside_copy=True)  # what a load would plan with
            row.update(probe_cpu_gbps=round(pc, 1), probe_copy_gbps=round(pp or 0, 1))
        torch.set_num_threads(saved)
        rows_out.append(row)
        cells = [row.get(k) for k in ("cpu_alone_gbps", "copy_alone_gbps", "cpu_with_copy_gbps",
                                      "copy_with_cpu_gbps", "sum_gbps", "probe_cpu_gbps",
                                      "probe_copy_gbps")]
        print(f"{n:7d} " + " ".join(f"{c if c is not None else '-':>9}" for c in cells),
              flush=True)
    doc = {"what": "host memory shared by hybrid decode's CPU kernel and the pinned copy",
           "kind": HOST_KIND, "cpu_weight_bytes": nbytes, "pinned_bytes": CHUNK * len(hosts),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "cpu": cpu_name(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "torch": torch.__version__, "rows": rows_out}
    a.outdir.mkdir(parents=True, exist_ok=True)
    (a.outdir / "hybrid-bus.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
