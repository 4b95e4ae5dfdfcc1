"""Hybrid decode's plan (hybrid.plan): the split that lets CPU and PCIe finish a layer
together, its prediction, and when auto turns it on."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from slipstream.modelfile.config import ModelConfig
from slipstream.errors import BadArgument
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.hybrid.plan import (HYBRID_MAX_TOKENS, balanced_share, decode_seconds,
                                    parse_hybrid, plan_hybrid)
from slipstream.hybrid.probe import TOKEN_WIDTHS
from slipstream.memory.planner import plan_cuda
from slipstream.synth import write_synth


def test_balanced_share_makes_both_sides_finish_together():
    image, ffn, ratio, pcie, cpu = 500e6, 410e6, 1.1, 55.0, 45.0
    s = balanced_share(image, ffn, ratio, pcie, cpu)
    pcie_s = (image - s * ffn) / (pcie * 1e9)
    cpu_s = s * ffn * ratio / (cpu * 1e9)
    assert pcie_s == pytest.approx(cpu_s)
    assert balanced_share(image, 0, ratio, pcie, cpu) == 0.0
    # a hand-over on the CPU's side leaves it less
    h = 1e-3
    s2 = balanced_share(image, ffn, ratio, pcie, cpu, handover_s=h)
    assert s2 < s
    assert (image - s2 * ffn) / (pcie * 1e9) == pytest.approx(s2 * ffn * ratio / (cpu * 1e9) + h)
    assert balanced_share(image, ffn, ratio, pcie, 1e9) == 1.0  # an endless CPU takes all


def test_decode_seconds_counts_the_slower_side_and_the_handover():
    seconds, cpu_bytes, pcie_bytes = decode_seconds([100e6] * 4, [80e6] * 4, 0.5, 1.0,
                                                    50.0, 10.0)
    assert cpu_bytes == 4 * 40e6 and pcie_bytes == 4 * 60e6
    assert seconds > cpu_bytes / 10e9  # the CPU is the slower side here
    plain, _, _ = decode_seconds([100e6] * 4, [80e6] * 4, 0.0, 1.0, 50.0, 10.0)
    assert plain == pytest.approx(4 * 100e6 / 50e9)


def test_the_balanced_share_is_the_fastest_for_the_time_model():
    """The share that balance_share picks with the fixed cost and the hand-over on the CPU's
    side is the minimum of decode_seconds over all shares: the copy link is given the bytes
    it would otherwise idle through while the CPU's path pays the hand-over."""
    from slipstream.hybrid.plan import CPU_FIXED_S, HANDOVER_S

    n, image, ffn, ratio, pcie, cpu = 36, 495e6, 406e6, 1.07, 54.0, 47.0
    best = balanced_share(n * image, n * ffn, ratio, pcie, cpu, (CPU_FIXED_S + HANDOVER_S) * n)
    at = lambda s: decode_seconds([image] * n, [ffn] * n, s, ratio, pcie, cpu)[0]  # noqa: E731
    grid = [k / 200 for k in range(1, 200)]
    assert at(best) <= min(at(s) for s in grid) * (1 + 1e-9)
    # the share set for the fixed cost alone gives the CPU more, and is slower
    fixed_only = balanced_share(n * image, n * ffn, ratio, pcie, cpu, CPU_FIXED_S * n)
    assert fixed_only > best and at(fixed_only) > at(best)


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("off", "off"), ("on", "on"),
                                        ("0.4", 0.4), (1, 1.0)])
def test_parse_hybrid(value, want):
    assert parse_hybrid(value) == want


@pytest.mark.parametrize("value", ["yes", "0", "1.5", "nan", "-0.2"])
def test_parse_hybrid_refuses_what_is_not_a_mode_or_share(value):
    with pytest.raises(BadArgument, match="--hybrid"):
        parse_hybrid(value)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("hp") / "s.gguf", "tiny", "Q4_K", n_layers=6)
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


FLAT = {m: 1.0 for m in TOKEN_WIDTHS}  # a CPU kernel that costs the same at every width


def _plan(gf, cfg, pcie: float):
    from slipstream.memory.vram import layer_image_bytes

    image = [layer_image_bytes(gf, cfg, i) for i in range(cfg.n_layers)]
    plan = plan_cuda(image, image, {"kv": 1 << 20}, (1 << 20) + 4 * max(image), None)
    plan.bandwidth_gbps.update(vram=3000.0, pinned=pcie)
    return plan


def test_plan_hybrid_splits_the_pinned_layers_and_predicts_faster(synth):
    gf, cfg = synth
    plan = _plan(gf, cfg, pcie=0.05)  # a slow link: the per-layer handover is small beside it
    pinned = [i for i, t in enumerate(plan.tiers) if t == "pinned"]
    hp = plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.05, token_scaling=FLAT)
    assert hp is not None and hp.layers == pinned
    assert hp.keep == 256 and hp.cpu_share == pytest.approx(0.5)
    assert hp.predicted_tok_s > 1.05 * hp.plain_tok_s
    plan = dataclasses.replace(plan, hybrid=hp)
    assert plan.predicted_tok_s == hp.predicted_tok_s
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(plan.table())
    text = console.export_text()
    assert "hybrid CPU" in text and "50% of FFN" in text and "whole layers over PCIe" in text
    # a CPU kernel as fast on 8 tokens as on one: every small pass splits
    assert hp.max_tokens == HYBRID_MAX_TOKENS and "passes up to 8 tokens" in text
    # no probe ran here (cpu_gbps given), so no steal measured and no warning
    assert hp.cores_stolen is None and "hypervisor" not in text


def test_plan_table_warns_of_cores_stolen_while_the_cpu_was_probed(synth):
    """A host whose hypervisor takes cores (an H100 host: 1.1 stolen, hybrid at 3.9 tok/s
    against 5.2 predicted) is named in the plan table; a few stolen ticks are not."""
    from rich.console import Console

    gf, cfg = synth
    plan = _plan(gf, cfg, pcie=0.05)
    hp = plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.05, token_scaling=FLAT)
    texts = []
    for stolen in (1.13, 0.1):
        plan = dataclasses.replace(plan, hybrid=dataclasses.replace(hp, cores_stolen=stolen))
        console = Console(record=True, width=240)
        console.print(plan.table())
        texts.append(console.export_text())
    assert "the hypervisor took 1.1 cores while the CPU was probed" in texts[0]
    assert "hypervisor" not in texts[1]


def test_steal_meter_reads_the_cores_taken_over_its_span(tmp_path, monkeypatch):
    """/proc/stat's steal column (the 8th number, in 1/100 s) over the span's wall time."""
    from slipstream.memory import probes

    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 20 300 4 0 1 800 0 0\ncpu0 1 2 3\n")
    import types

    clock = iter([100.0, 102.0, 200.0, 201.0])
    monkeypatch.setattr(probes, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    with probes.StealMeter(str(stat)) as m:
        stat.write_text("cpu  10 0 20 300 4 0 1 1100 0 0\n")  # 3 s of steal in 2 s of wall
    assert m.cores == pytest.approx(1.5)
    with probes.StealMeter(str(tmp_path / "none")) as m:  # no /proc/stat: not reported
        pass
    assert m.cores is None


def test_after_promotion_is_the_split_a_new_plan_would_make(synth):
    """A draft given up promotes split layers to VRAM: the plan's split then describes the
    layers left, as planning the new tiers at the same share and rates does."""
    from slipstream.hybrid.plan import after_promotion

    gf, cfg = synth
    plan = _plan(gf, cfg, pcie=0.05)
    hp = plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.05, token_scaling=FLAT)
    plan = dataclasses.replace(plan, hybrid=hp)
    gone = hp.layers[:1]
    for i in gone:
        plan.tiers[i] = "vram"
    after = after_promotion(plan, gone)
    plan = dataclasses.replace(plan, hybrid=None)
    fresh = plan_hybrid(gf, cfg, plan, hp.cpu_share, threads=4, cpu_gbps=0.05,
                        token_scaling=FLAT)
    assert after.layers == fresh.layers == hp.layers[1:]
    assert after.cpu_bytes_per_token == fresh.cpu_bytes_per_token < hp.cpu_bytes_per_token
    assert after.pcie_bytes_per_token == fresh.pcie_bytes_per_token
    assert after.plain_tok_s == pytest.approx(fresh.plain_tok_s)
    assert after.predicted_tok_s == pytest.approx(fresh.predicted_tok_s)
    assert after.predicted_tok_s > hp.predicted_tok_s  # one layer fewer to move
    plan = dataclasses.replace(plan, hybrid=hp)
    for i in hp.layers:
        plan.tiers[i] = "vram"
    assert after_promotion(plan, hp.layers) is None


def test_the_widest_split_pass_is_where_the_cpu_stops_paying():
    from slipstream.hybrid.plan import hybrid_max_tokens

    image, ffn = [1000 << 20] * 10, [700 << 20] * 10
    share, args = 0.5, dict(cpu_ratio=1.0, pcie_gbps=50.0, cpu_gbps=50.0)
    # one token: the CPU reads 350 MiB a layer while PCIe copies 650, against 1000 whole
    assert hybrid_max_tokens(image, ffn, share, scaling=FLAT, **args) == 8
    # the CPU's side costs r times one token's: it loses once r * 350 MiB (+ the fixed and
    # hand-over costs) take longer than 1000 MiB over PCIe
    steep = {1: 1.0, 2: 1.9, 4: 3.6, 8: 7.0}
    assert hybrid_max_tokens(image, ffn, share, scaling=steep, **args) == 2
    # decode keeps its split even where no width pays
    assert hybrid_max_tokens(image, ffn, share, scaling={1: 1.0, 2: 9.0}, cpu_ratio=1.0,
                             pcie_gbps=50.0, cpu_gbps=5.0) == 1


def test_the_cpu_kernel_is_timed_at_each_width():
    from slipstream.hybrid.probe import cpu_token_scaling

    scaling = cpu_token_scaling(1, rows=512, cols=1024, reps=2, widths=(1, 2, 8))
    assert list(scaling) == [1, 2, 8] and scaling[1] == 1.0
    assert all(r > 0 for r in scaling.values())


def test_auto_stays_off_where_the_cpu_would_not_help(synth):
    gf, cfg = synth
    plan = _plan(gf, cfg, pcie=55.0)
    assert plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.5, token_scaling=FLAT) is None
    forced = plan_hybrid(gf, cfg, plan, "on", threads=4, cpu_gbps=0.5, token_scaling=FLAT)
    assert forced is not None and forced.predicted_tok_s < forced.plain_tok_s
    assert plan_hybrid(gf, cfg, plan, "off", threads=4, cpu_gbps=50.0, token_scaling=FLAT) is None
    given = plan_hybrid(gf, cfg, plan, 1.0, threads=4, cpu_gbps=50.0, token_scaling=FLAT)
    assert given.keep == 256  # each side keeps at least one block of units


@pytest.fixture(scope="module")
def wide_ffn(tmp_path_factory):
    """Layers with 16 blocks of FFN units, so that a share lands where the balance puts it."""
    from slipstream.synth import SynthShape

    shape = SynthShape(hidden=256, ffn=4096, n_layers=6, n_heads=4, n_kv_heads=2, vocab=1024,
                       context=2048, rope_base=10000.0)
    path = write_synth(tmp_path_factory.mktemp("hpw") / "w.gguf", shape, "Q4_K")
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


def test_auto_stays_off_where_fixed_costs_outweigh_each_layers_cpu_work(wide_ffn):
    """A link just slow enough that the time model predicts a gain, but each layer's share
    of CPU work is below the fixed costs every split layer pays (the H200's 8B: 0.4 ms of
    work a layer, predicted 45 tok/s, measured 20 against 29 whole): auto declines, "on"
    still splits."""
    from slipstream.hybrid.plan import CPU_FIXED_S, GPU_LAYER_S, HANDOVER_S, MIN_CPU_LAYER_S
    from slipstream.memory.vram import layer_image_bytes

    gf, cfg = wide_ffn
    image = layer_image_bytes(gf, cfg, 0)
    plan = _plan(gf, cfg, pcie=55.0)
    split = sum(t == "pinned" for t in plan.tiers)
    # a layer's copy: 1.5x what the chain pays per split layer besides the CPU's work (its
    # fixed costs, and its part of the GPU's compute of the layers that do not split)
    chain = CPU_FIXED_S + HANDOVER_S + GPU_LAYER_S * (len(plan.tiers) - split) / split
    gbps = image / (1.5 * chain) / 1e9
    plan = _plan(gf, cfg, pcie=gbps)
    forced = plan_hybrid(gf, cfg, plan, "on", threads=4, cpu_gbps=gbps, token_scaling=FLAT)
    assert forced is not None and forced.predicted_tok_s > 1.05 * forced.plain_tok_s
    per_layer = forced.cpu_bytes_per_token / len(forced.layers) / (gbps * 1e9)
    assert per_layer < MIN_CPU_LAYER_S
    assert plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=gbps,
                       token_scaling=FLAT) is None


def test_cli_refuses_a_bad_hybrid_value_before_loading():
    r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", "/nonexistent.gguf",
                        "--hybrid", "2", "-p", "hi"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert "--hybrid '2' is invalid" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_auto_is_off_at_exact_precision_and_a_given_mode_stays():
    from slipstream.runtime.build import hybrid_mode as _hybrid_mode

    assert _hybrid_mode("auto", "exact") == "off"
    assert _hybrid_mode("auto", "fast") == "auto"
    assert _hybrid_mode("0.5", "exact") == 0.5 and _hybrid_mode("on", "exact") == "on"


def test_stats_table_shows_the_cpu_share():
    from rich.console import Console

    from slipstream.cli import breakdown_table
    from slipstream.memory.protocol import StoreStats
    from slipstream.runtime.generate import GenerationStats

    gen = GenerationStats()
    gen.prompt_tokens, gen.generated_tokens, gen.prefill_s, gen.decode_s = 8, 8, 0.5, 2.0
    store = StoreStats(layers_streamed=640, compute_s=1.5, stall_s=0.2, h2d_s=1.6,
                       h2d_bytes=84 * 10**9, cpu_s=1.2, cpu_bytes=60 * 10**9)
    console = Console(record=True, width=160)
    console.print(breakdown_table(gen, store, "cuda"))
    text = console.export_text()
    assert "hybrid CPU share" in text and "50.0" in text  # 60 GB in 1.2 s
    store.cpu_s = 0.0
    console.print(breakdown_table(gen, store, "cuda"))
    assert console.export_text().count("hybrid CPU share") == 0  # export_text clears


def test_the_cpu_probe_reads_a_weight_larger_than_the_last_level_cache(monkeypatch):
    """The H100/H200 hosts' 300 MiB L3 served part of a 402 MB probe weight: the probe read
    95 GB/s where decode's shares ran at 69. The weight is three times the cache (capped), in
    whole 64-row blocks, never smaller than asked."""
    from slipstream.hybrid import probe as hybrid_plan

    monkeypatch.setattr(hybrid_plan, "last_level_cache_bytes", lambda: 300 << 20)
    rows = hybrid_plan.probe_rows(16384, 8192)
    assert rows % 64 == 0 and rows * 8192 * 6 / 8 >= 3 * (300 << 20)
    assert rows * 8192 * 6 / 8 < 3 * (300 << 20) + 64 * 8192
    monkeypatch.setattr(hybrid_plan, "last_level_cache_bytes", lambda: 1 << 20)
    assert hybrid_plan.probe_rows(16384, 8192) == 16384
    monkeypatch.setattr(hybrid_plan, "last_level_cache_bytes", lambda: 64 << 30)
    capped = hybrid_plan.probe_rows(64, 8192) * 8192 * 6 / 8
    assert capped <= hybrid_plan.PROBE_MAX_BYTES + 64 * 8192  # the cap, up to a whole block


def test_this_hosts_last_level_cache_is_read():
    from slipstream.hybrid.probe import last_level_cache_bytes

    assert (1 << 20) <= last_level_cache_bytes() <= (4 << 30)


def test_the_cpu_probe_weight_repeats_a_random_tile_with_q4k_scales_in_every_run():
    """The probe weight is drawn for PROBE_TILE row blocks and repeated: every row block
    exists, the array is contiguous, and every run of every block (the repeated ones too)
    starts with Q4_K's d and dmin at 0.01."""
    import torch

    from slipstream.hybrid import probe
    from slipstream.weights.cpu import vnni

    rows, cols = (probe.PROBE_TILE * 2 + 3) * vnni.Q4V_ROWS, 512
    probe._q4vnni_weight.cache_clear()
    try:
        w = probe._q4vnni_weight(rows, cols)
    finally:
        probe._q4vnni_weight.cache_clear()
    blocks = -(-rows // vnni.Q4V_ROWS)
    assert w.packed.shape == (blocks, cols // 32, vnni.Q4V_KS_RECORD_BYTES)
    assert w.packed.is_contiguous()
    runs = w.packed.view(blocks, cols // 32 // vnni.Q4V_KS_RUN, -1)
    heads = runs[..., :4 * vnni.Q4V_ROWS].contiguous().view(torch.float16)
    assert torch.all(heads == torch.tensor(0.01, dtype=torch.float16))
    assert torch.equal(w.packed[probe.PROBE_TILE], w.packed[0])  # repeated, not redrawn
    assert not torch.equal(w.packed[1], w.packed[0])  # random within the tile
