"""`slipstream bench` end to end on the plans a CPU can run: resident, streamed from disk, and
speculative on a streamed plan (the low-bit self-draft). Each reports load time and time to first
token, and a roofline from the bytes that actually move per decode token (the hybrid and CUDA
streamed plans' traffic is tested on plan objects in tests/runtime/test_bench_traffic.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import slipstream
from helpers import cpu_budget
from slipstream.synth import write_synth

pytestmark = pytest.mark.slow  # each runs a bench in its own process: seconds on 2 cores

CTX = 64
BENCH = ("bench", "--device", "cpu", "-t", "1", "-c", str(CTX), "--pp", "16", "--tg", "4",
         "--reps", "1")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_synth(tmp_path_factory.mktemp("bench") / "m.gguf", "tiny", "Q8_0", n_layers=4)


def bench(path: Path, tmp_path: Path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "slipstream", *BENCH, "-m", str(path), *flags,
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(out.read_text()), r.stdout


def check_timings(doc: dict, table: str) -> None:
    """llama.cpp's timings: the load and the first token, in the JSON and the table."""
    assert doc["load_s"] > 0 and doc["ttft_s"] > 0
    assert doc["ttft"]["test"] == "ttft16" and doc["ttft"]["seconds"][0] == \
        pytest.approx(doc["ttft_s"], abs=1e-4)
    assert re.search(r"│\s*ttft16\s*│", table) and re.search(r"│\s*load\s*│", table), table
    # where the load's time went: the phases of slipstream.load, within the load's wall time
    phases = doc["load_phases"]
    assert {"open", "tokenizer", "plan", "resident weights", "store and stages"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= doc["load_s"] + 0.01, (phases, doc["load_s"])
    assert re.search(r"│\s*load: resident weights\s*│", table), table


def test_bench_on_a_resident_plan(model_file, tmp_path):
    doc, table = bench(model_file, tmp_path)
    check_timings(doc, table)
    traffic = doc["decode_traffic"]
    assert set(traffic["bytes_per_token"]) == {"memory"} and traffic["bound_by"] == "memory"
    assert doc["roofline_decode_tok_s"] == traffic["roofline_decode_tok_s"] > 0


def test_bench_on_a_streamed_plan_counts_the_disk_reads(model_file, tmp_path):
    """Layers 1-3 read from the file every token: the roofline is the disk's, its bytes are
    the plan's, and nothing crashes on the layers the store leaves unbuilt."""
    budget = cpu_budget(model_file, packed=1, ctx=CTX)
    doc, table = bench(model_file, tmp_path, "--ram-budget", str(budget))
    check_timings(doc, table)
    plan = slipstream.plan(model_file, device="cpu", ctx=CTX,
                           placement=slipstream.Placement(ram_budget=budget), measure=False)
    assert plan.disk_layers == [1, 2, 3]
    moved = doc["decode_traffic"]["bytes_per_token"]
    assert moved["disk"] == plan.bytes_per_token("disk")
    assert moved["memory"] > moved["disk"]  # compute reads the streamed layers too
    disk_gbps = doc["decode_traffic"]["gbps"]["disk"]
    memory_bound = doc["memory_read_gbps"] * 1e9 / moved["memory"]
    assert doc["roofline_decode_tok_s"] == pytest.approx(
        min(disk_gbps * 1e9 / moved["disk"], memory_bound), rel=0.03)  # rates rounded
    assert "disk reads" in table and "decode roofline" in table


def test_bench_speculative_on_a_streamed_plan(model_file, tmp_path):
    # the Q4_0 copy of the streamed layers (5.9 MiB) comes out of the budget too
    budget = cpu_budget(model_file, packed=1, ctx=CTX) + 6_300_000
    doc, table = bench(model_file, tmp_path, "--ram-budget", str(budget),
                       "--draft-lowbit", "Q4_0", "--spec-nodes", "4", "--spec-depth", "2",
                       "-c", "160")
    check_timings(doc, table)
    assert "Q4_0" in doc["draft"], doc["draft"]
    pp, tg = doc["results"]
    assert tg["test"] == "tg4" and tg["target_passes"] >= 1
    assert tg["tokens_per_pass"] * tg["target_passes"] == pytest.approx(4)
    assert doc["decode_traffic"]["bytes_per_token"]["disk"] > 0
