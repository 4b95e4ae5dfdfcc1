"""Hybrid decode's plan (memory.hybrid_plan): the split that lets CPU and PCIe finish a layer
together, its prediction, and when auto turns it on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slipstream.config import ModelConfig
from slipstream.errors import BadArgument
from slipstream.gguf_file import GGUFFile
from slipstream.memory.hybrid_plan import (balanced_share, decode_seconds, parse_hybrid,
                                           plan_hybrid)
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
    hp = plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.05)
    assert hp is not None and hp.layers == pinned
    assert hp.keep == 256 and hp.cpu_share == pytest.approx(0.5)
    assert hp.predicted_tok_s > 1.05 * hp.plain_tok_s
    plan.hybrid = hp
    assert plan.predicted_tok_s == hp.predicted_tok_s
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(plan.table())
    text = console.export_text()
    assert "hybrid CPU" in text and "50% of FFN" in text and "whole layers over PCIe" in text


def test_auto_stays_off_where_the_cpu_would_not_help(synth):
    gf, cfg = synth
    plan = _plan(gf, cfg, pcie=55.0)
    assert plan_hybrid(gf, cfg, plan, "auto", threads=4, cpu_gbps=0.5) is None
    forced = plan_hybrid(gf, cfg, plan, "on", threads=4, cpu_gbps=0.5)
    assert forced is not None and forced.predicted_tok_s < forced.plain_tok_s
    assert plan_hybrid(gf, cfg, plan, "off", threads=4, cpu_gbps=50.0) is None
    given = plan_hybrid(gf, cfg, plan, 1.0, threads=4, cpu_gbps=50.0)
    assert given.keep == 256  # each side keeps at least one block of units


def test_cli_refuses_a_bad_hybrid_value_before_loading():
    r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", "/nonexistent.gguf",
                        "--hybrid", "2", "-p", "hi"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert "--hybrid '2' is invalid" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_auto_is_off_at_exact_precision_and_a_given_mode_stays():
    from slipstream.api import _hybrid_mode

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
