"""The CPU plan's decode prediction: its structure, and the probes that feed it. Timings are
the benchmarks' business; here only
what is summed, from which rates, and that the probes measure what they say."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from rich.console import Console

import slipstream
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory.planner import plan_layers
from slipstream.memory.probes import cpu_decode_rates
from slipstream.memory.setup import head_decode_bytes, layer_resident_bytes
from slipstream.memory.store import steady_heap
from slipstream.precision import Precision
from slipstream.synth import write_synth

from helpers import cpu_budget

FAST_CPU = Precision.of("fast", torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpupredict")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K_M", n_layers=6, from_floats=True,
                       std=0.08, seed=3)


def _streamed_plan():
    # 4 layers of 100 dense bytes (40 in the file); 2 resident, 2 streamed
    plan = plan_layers("cpu", [100] * 4, [40] * 4, fixed_bytes=10, budget=10 + 2 * 100 + 80)
    return dataclasses.replace(plan, head_bytes=60)


def test_cpu_token_seconds_sums_compute_head_and_rebuild():
    plan = _streamed_plan()
    assert plan.tiers == ["ram", "ram", "disk", "disk"]
    plan.bandwidth_gbps.update(ram=10.0, disk=1.0, compute=4.0, gemv=6.0, rebuild=0.5)
    parts = plan.cpu_token_seconds()
    assert set(parts) == {"compute", "head", "rebuild", "disk", "token"}
    # every layer computes, the streamed ones once rebuilt: dense bytes of all four
    assert parts["compute"] == pytest.approx(400 / 4e9)
    assert parts["head"] == pytest.approx(60 / 6e9)
    assert parts["rebuild"] == pytest.approx(80 / 0.5e9)  # the streamed layers' file bytes
    assert parts["disk"] == pytest.approx(80 / 1e9)
    # reader threads read ahead while the CPU works: the reads add nothing here
    assert parts["token"] == pytest.approx(parts["compute"] + parts["head"] + parts["rebuild"])
    assert plan.predicted_tok_s == pytest.approx(1 / parts["token"])
    text = _table_text(plan)
    assert "compute" in text and "rebuild" in text and "predicted decode" in text


def test_cpu_token_seconds_is_the_disk_where_reads_are_slower():
    plan = _streamed_plan()
    plan.bandwidth_gbps.update(compute=4.0, gemv=6.0, rebuild=0.5, disk=1e-3)
    parts = plan.cpu_token_seconds()
    assert parts["token"] == pytest.approx(80 / 1e6) == parts["disk"]


def test_cpu_prediction_needs_its_rates():
    plan = _streamed_plan()
    plan.bandwidth_gbps.update(ram=10.0, disk=1.0, rebuild=0.5)
    assert plan.cpu_token_seconds() is None and plan.predicted_tok_s is None  # no compute
    assert "predicted decode" not in _table_text(plan)
    plan.bandwidth_gbps["compute"] = 4.0
    del plan.bandwidth_gbps["rebuild"]
    assert plan.predicted_tok_s is None
    # a resident plan needs the compute rate alone; the head falls back on it without gemv
    resident = dataclasses.replace(
        plan_layers("cpu", [100] * 4, [40] * 4, fixed_bytes=10, budget=None), head_bytes=60)
    resident.bandwidth_gbps["compute"] = 4.0
    assert resident.cpu_token_seconds()["token"] == pytest.approx(460 / 4e9)


@pytest.mark.slow
def test_cpu_decode_rates_measures_a_real_layer(tiny):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    rates = cpu_decode_rates(gf, cfg, FAST_CPU, 2, layer_resident_bytes(gf, 2, FAST_CPU),
                             head_decode_bytes(gf, FAST_CPU), time_budget_s=0.05, max_reps=3)
    assert set(rates) == {"rebuild", "compute", "gemv"}
    assert all(math.isfinite(v) and v > 0 for v in rates.values())


def test_steady_heap_is_harmless():
    assert steady_heap(1 << 20) in (True, False)  # False off glibc
    assert torch.ones(8 << 20, dtype=torch.uint8).sum() == 8 << 20


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_plan_predicts_a_streamed_cpu_model(tiny, precision):
    """api.plan (what `info --plan` prints) measures the rates the prediction needs: at
    "exact" 2 layers whole and the rest rebuilt every token, at "fast" 2 layers' packed
    images in RAM and the rest's read every token."""
    plain = slipstream.plan(tiny, device="cpu", ctx=64, measure=False, precision=precision)
    # whole layers at "exact"; packed images at "fast", where a plan that streams holds those
    if precision == "fast":
        budget = cpu_budget(tiny, packed=2) + plain.file_bytes_per_layer[0] // 2
    else:
        budget = cpu_budget(tiny, whole=2, precision=precision) + \
            plain.resident_bytes_per_layer[0] // 2
    plan = slipstream.plan(tiny, device="cpu", ctx=64, precision=precision,
                           placement=slipstream.Placement(ram_budget=budget))
    held = "packed" if precision == "fast" else "ram"
    assert plan.tiers == [held] * 2 + ["disk"] * 4
    assert plan.head_bytes > 0
    parts = plan.cpu_token_seconds()
    assert parts is not None and all(v > 0 for v in parts.values())
    assert plan.predicted_tok_s == pytest.approx(1 / parts["token"])


def _table_text(plan) -> str:
    console = Console(width=200, record=True)
    console.print(plan.table())
    return console.export_text()


def test_the_ring_hides_reads_only_as_far_as_its_buffers_reach():
    """token_seconds_of_ring against cases worked by hand: 4 layers of 1 s of CPU work each,
    the last two read from disk."""
    from slipstream.memory.planner import token_seconds_of_ring

    # reads of 1 s: both are read while the first two layers compute (2 buffers): no wait
    assert token_seconds_of_ring([(1, None), (1, None), (1, 1), (1, 1)], 0, 2) == 4
    # one buffer: layer 3's read starts at layer 2's release, and the CPU waits 1 s for it
    assert token_seconds_of_ring([(1, None), (1, None), (1, 1), (1, 1)], 0, 1) == 5
    # reads of 3 s: the disk is busy all the time, 6 s per token whatever the buffers
    assert token_seconds_of_ring([(1, None), (1, None), (1, 3), (1, 3)], 0, 2) == 6
    # a head of 2 s after the last layer: the CPU's 6 s a token and the disk's 6 s overlap
    # wholly (layer 2's read runs under layer 3, the head and layers 0-1)
    assert token_seconds_of_ring([(1, None), (1, None), (1, 3), (1, 3)], 2, 2) == 6
    # and a 3 s head: the CPU's 7 s
    assert token_seconds_of_ring([(1, None), (1, None), (1, 3), (1, 3)], 3, 2) == 7
