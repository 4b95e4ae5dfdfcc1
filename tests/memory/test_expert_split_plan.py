"""The CUDA plan of a mixture of experts whose VRAM budget holds the dense part but not every
expert (memory.expert_split_plan): arithmetic on fake sizes, then the sizes of synth files
through memory.setup's CUDA planning (free VRAM faked: no GPU needed)."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from slipstream.errors import BudgetTooSmall
from slipstream.memory import setup
from slipstream.memory.budget import fmt_bytes
from slipstream.memory.expert_split_plan import ExpertSizes, plan_expert_split, spread
from slipstream.memory.vram import (_expert_linears, expert_vram_bytes, layer_dense_vram_bytes,
                                    layer_vram_bytes, packed_planes)
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth

MiB = 1 << 20


class _Cfg:
    """The two fields plan_expert_split reads."""

    def __init__(self, n_layers: int, n_experts: int):
        self.n_layers, self.n_experts = n_layers, n_experts


def _sizes(n_layers=4, dense=100 * MiB, expert=10 * MiB, ram=12 * MiB, first_dense=False):
    moe = [not (first_dense and i == 0) for i in range(n_layers)]
    # planes under 1 MiB each: one rounding of 512 B (and the map's) per layer's stack
    planes = [expert // 16] * 16
    return ExpertSizes(dense_vram=[dense] * n_layers,
                       expert_planes=[planes if m else [] for m in moe],
                       expert_ram=[ram if m else 0 for m in moe],
                       cold_staging=3 * ram, read_bytes=ram // 2)


def test_budget_short_of_the_dense_part_names_both_numbers():
    sizes, reserve = _sizes(), {"KV cache": 50 * MiB, "activations": 30 * MiB}
    need = 4 * 100 * MiB + 80 * MiB
    with pytest.raises(BudgetTooSmall) as err:
        plan_expert_split(sizes, _Cfg(4, 8), reserve, need - 1, None, [0] * 4, "m.gguf")
    msg = str(err.value)
    assert f"{need - 1} < {need} bytes" in msg
    assert fmt_bytes(need) in msg and "m.gguf" in msg and "--vram-budget" in msg
    # exactly the dense part: a plan with no expert in VRAM, every one on the CPU
    plan = plan_expert_split(sizes, _Cfg(4, 8), reserve, need, None, [0] * 4)
    assert plan.vram_expert_slots == [0] * 4 and plan.expert_slots == [8] * 4


def test_slots_spread_evenly_over_the_layers_with_experts():
    sizes, reserve = _sizes(first_dense=True), {"KV cache": 20 * MiB}
    dense = 4 * 100 * MiB + 20 * MiB
    # room for 7 whole experts and most of an 8th: 7 over the 3 layers with experts
    plan = plan_expert_split(sizes, _Cfg(4, 8), reserve, dense + 79 * MiB, None, [0] * 4)
    assert plan.vram_expert_slots == [0, 3, 2, 2]
    assert plan.expert_slots == [0, 5, 6, 6]  # the rest in RAM (no RAM budget)
    assert plan.expert_layers == (1, 2, 3)
    assert plan.tiers == ["vram"] * 4 and not plan.streamed_layers and not plan.graphs
    # each layer's slot stacks, and 512 B for its expert-id -> slot map
    assert plan.resident_bytes_per_layer == [100 * MiB, 130 * MiB + 512, 120 * MiB + 512,
                                             120 * MiB + 512]
    # a budget past every expert caps each layer at its experts
    plan = plan_expert_split(sizes, _Cfg(4, 8), reserve, dense + 1000 * MiB, None, [0] * 4)
    assert plan.vram_expert_slots == [0, 8, 8, 8] and plan.expert_slots == [0, 0, 0, 0]


def test_the_allocators_rounding_of_large_stacks_costs_a_slot():
    """One plane of 6 MiB per expert: 2 slots are 12 MiB, one allocation rounded up to 2 MiB
    steps (14 MiB with 2 + 6 = 8 more bytes); a budget of exactly 3 experts' planes and the
    maps holds 2 slots where the rounding does not fit."""
    sizes = ExpertSizes(dense_vram=[0, 0], expert_planes=[[6 * MiB + 8]] * 2,
                        expert_ram=[MiB] * 2, cold_staging=0, read_bytes=0)
    plan = plan_expert_split(sizes, _Cfg(2, 4), {}, 3 * (6 * MiB + 8) + 1024, None, [0] * 2)
    assert plan.vram_expert_slots == [1, 1]
    assert sum(plan.resident_bytes_per_layer) <= plan.budget


def test_ram_budget_holds_some_of_the_rest_and_the_file_the_others():
    sizes, reserve = _sizes(), {}
    budget = 4 * 100 * MiB + 4 * (10 * MiB + 512)  # one expert per layer in VRAM, the maps
    # RAM: the cold expert's staging (36 MiB) and 10 experts of 12 MiB
    plan = plan_expert_split(sizes, _Cfg(4, 8), reserve, budget, 36 * MiB + 10 * 12 * MiB + 5,
                             [0] * 4)
    assert plan.vram_expert_slots == [1] * 4
    assert plan.expert_slots == [3, 3, 2, 2]
    # a RAM budget past the staging alone: every expert not in VRAM is read from the file
    plan = plan_expert_split(sizes, _Cfg(4, 8), reserve, budget, 10 * MiB, [0] * 4)
    assert plan.expert_slots == [0] * 4
    # a layer whose experts all fit gives its share of RAM to the others
    plan = plan_expert_split(sizes, _Cfg(4, 2), reserve, budget, 36 * MiB + 4 * 12 * MiB,
                             [0] * 4)
    assert plan.expert_slots == [1] * 4


def test_spread_caps_and_gives_the_remainder_to_the_first_layers():
    assert spread(10, [1, 2, 3], 4, 8) == [0, 4, 3, 3]
    assert spread(30, [0, 1], 2, 8) == [8, 8]


def test_table_shows_experts_in_vram_ram_and_disk():
    sizes = _sizes()
    plan = plan_expert_split(sizes, _Cfg(4, 8), {"KV cache": MiB}, 4 * 100 * MiB + MiB
                             + 6 * 10 * MiB + 4 * 512, 36 * MiB + 8 * 12 * MiB, [0] * 4)
    out = io.StringIO()
    Console(file=out, width=200).print(plan.table())
    text = out.getvalue()
    assert "0-1: 2 in VRAM, 2 in RAM, 4 on disk (of 8)" in text
    assert "2-3: 1 in VRAM, 2 in RAM, 5 on disk (of 8)" in text


def _open(tmp_path, arch: str, quant: str):
    path = write_synth(tmp_path / f"{arch}.gguf", "tiny", quant, n_layers=2, arch=arch)
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "Q4_K_M"), ("gpt-oss", "MXFP4")])
def test_one_expert_and_the_dense_part_add_up_to_the_layer(tmp_path, arch, quant):
    """A layer's dense part and its experts, each counted apart, are the resident layer's
    count less the stacks' allocator rounding."""
    gf, cfg = _open(tmp_path, arch, quant)
    for fused in (False, True):
        whole = layer_vram_bytes(gf, cfg, 0, fused)
        dense = layer_dense_vram_bytes(gf, cfg, 0, fused)
        experts = cfg.n_experts * expert_vram_bytes(gf, cfg, 0, fused)
        stacked = sum(sum(packed_planes(q, r, c, fused)) + 4 * b
                      for q, r, c, b in _expert_linears(gf, cfg, 0))
        assert experts == stacked
        assert dense + experts <= whole <= dense + experts + 8 * MiB


def test_setup_splits_a_cuda_budget_short_of_the_experts(tmp_path, monkeypatch):
    """memory.setup's CUDA planning: a budget that holds the model whole plans every expert
    in VRAM; one short of the experts splits them; one short of the dense part fails naming
    it (free VRAM faked at 64 GiB)."""
    gf, cfg = _open(tmp_path, "qwen3moe", "Q4_K_M")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    dev = torch.device("cuda")
    p = Precision.of("fast", dev)

    def plan(vram, ram=None):
        return setup.plan_for(gf, cfg, dev, p, 256, ram, vram, prefill_chunk=512,
                              graph_bucket=256)

    whole = plan(None)
    assert whole.vram_expert_slots is None and not whole.streamed_layers
    need = sum(whole.resident_bytes_per_layer) + whole.fixed_bytes
    split = plan(need - cfg.n_layers * layer_vram_bytes(gf, cfg, 0, True) // 4)
    assert split.vram_expert_slots is not None and not split.graphs
    assert all(0 < v < cfg.n_experts for v in split.vram_expert_slots)
    assert [v + r for v, r in zip(split.vram_expert_slots, split.expert_slots)] == \
        [cfg.n_experts] * cfg.n_layers
    used = sum(split.resident_bytes_per_layer) + split.fixed_bytes
    assert used <= split.budget
    with pytest.raises(BudgetTooSmall, match="dense part"):
        plan(split.fixed_bytes)
    with pytest.raises(BudgetTooSmall, match="vram_layers=1"):
        setup.plan_for(gf, cfg, dev, p, 256, None, split.budget, prefill_chunk=512,
                       graph_bucket=256, vram_layers=1)


def test_stats_show_the_vram_hit_rate_and_the_cpu_share():
    """`run --stats` of a split model (a resident store): the CPU's experts as a row, the
    share of routed pairs served from VRAM, the syncs and the swaps in the caption."""
    from slipstream.cli import breakdown_table
    from slipstream.memory.protocol import StoreStats
    from slipstream.runtime.generate import GenerationStats

    gen = GenerationStats(prompt_tokens=8, generated_tokens=8, prefill_s=0.5, decode_s=2.0)
    store = StoreStats(cpu_s=1.2, cpu_bytes=6 * 10**9, expert_vram_pairs=300,
                       expert_cpu_pairs=100, expert_syncs=768, expert_swaps=5,
                       expert_swap_bytes=21 * 10**6)
    assert store.expert_vram_rate == 0.75
    console = Console(record=True, width=200)
    console.print(breakdown_table(gen, store, "cuda"))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "experts on the CPU" in text and "5.0" in text  # 6 GB in 1.2 s
    assert "VRAM hit rate 75.0% (300 routed pairs on the GPU, 100 on the CPU)" in text
    assert "768 host syncs" in text and "5 swaps into VRAM (21.0 MB)" in text
    assert StoreStats().expert_vram_rate is None


def test_staging_counts_each_layout_once_and_the_pairs_buffer():
    """A split prefill's staging (weights.expert_stream): STAGING_SLOTS slots per layout of
    expert, shared by the layers of that layout, the pass's (row, expert) outputs, and its
    slot writes beyond the swaps' (which never run beside them)."""
    from slipstream.memory.expert_split_plan import staging_vram_bytes
    from slipstream.memory.vram import write_transient
    from slipstream.weights.expert_stream import STAGING_SLOTS, STAGING_WRITE_ELEMENTS

    class Cfg:
        n_experts_used, hidden = 8, 2048

    a, b = [2 * MiB, 4 * MiB], [6 * MiB]  # whole 2 MiB blocks: no allocator rounding
    # (qtype, rows, cols, bias rows) per stack: Q8_0 (8), a gate/up wider than one write
    la = ((8, 4096, 2048, 0), (8, 2048, 2048, 0))
    lb = ((8, 1536, 2048, 0), (8, 2048, 768, 0))
    sizes = ExpertSizes(dense_vram=[0] * 4, expert_planes=[[], a, a, b],
                        expert_ram=[0, 1, 1, 1], cold_staging=0, read_bytes=0,
                        layouts=[(), la, la, lb])
    pairs = 512 * 8 * 2048 * 4  # 32 MiB
    covered = 1 << 40  # slot writes reserved already beyond any staging write
    assert staging_vram_bytes(sizes, Cfg(), 512, slot_writes=covered) == \
        STAGING_SLOTS * 12 * MiB + pairs
    assert staging_vram_bytes(sizes, Cfg(), 512, slots=2, slot_writes=covered) == \
        2 * 12 * MiB + pairs
    # the largest write: la's gate/up, STAGING_WRITE_ELEMENTS // 2048 of its 4096 rows
    rows = STAGING_WRITE_ELEMENTS // 2048
    assert rows < 4096
    write = write_transient(8, rows, 2048)
    assert write == max(write_transient(q, min(r, STAGING_WRITE_ELEMENTS // c), c)
                        for q, r, c, _ in la + lb)
    base = STAGING_SLOTS * 12 * MiB + pairs
    assert staging_vram_bytes(sizes, Cfg(), 512) == base + write
    assert staging_vram_bytes(sizes, Cfg(), 512, slot_writes=write // 2) == \
        base + write - write // 2
    # no layouts given: layers alike where their planes are (and no write counted)
    plain = ExpertSizes(dense_vram=[0] * 3, expert_planes=[a, a, b], expert_ram=[1] * 3,
                        cold_staging=0, read_bytes=0)
    assert staging_vram_bytes(plain, Cfg(), 512) == base
    empty = ExpertSizes(dense_vram=[0], expert_planes=[[]], expert_ram=[0], cold_staging=0,
                        read_bytes=0)
    assert staging_vram_bytes(empty, Cfg(), 512) == 0


def test_split_plan_reserves_the_staging(tmp_path, monkeypatch):
    """memory.setup's split plan holds the staging in its reserve, counted from the file's
    expert planes (memory.vram.expert_planes) and the prefill chunk (at most the context)."""
    from slipstream.memory.vram import alloc_bytes, expert_planes, write_transient
    from slipstream.weights.expert_stream import STAGING_SLOTS

    gf, cfg = _open(tmp_path, "qwen3moe", "Q4_K_M")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    dev = torch.device("cuda")
    p = Precision.of("fast", dev)
    whole = setup.plan_for(gf, cfg, dev, p, 256, None, None, prefill_chunk=512,
                           graph_bucket=256)
    need = sum(whole.resident_bytes_per_layer) + whole.fixed_bytes
    split = setup.plan_for(gf, cfg, dev, p, 256, None,
                           need - cfg.n_layers * layer_vram_bytes(gf, cfg, 0, True) // 4,
                           prefill_chunk=512, graph_bucket=256)
    assert split.vram_expert_slots is not None
    layouts = {tuple(expert_planes(gf, cfg, i, True)) for i in range(cfg.n_layers)}
    want = sum(alloc_bytes(STAGING_SLOTS * q) for planes in layouts for q in planes) \
        + alloc_bytes(256 * cfg.n_experts_used * cfg.hidden * 4)
    # plus the staging's slot writes beyond the swaps' ("expert slot writes")
    assert want <= split.reserve["expert staging"] <= \
        want + max(write_transient(*w[:3]) for w in _expert_linears(gf, cfg, 0, False))
    assert sum(split.resident_bytes_per_layer) + split.fixed_bytes <= split.budget


def test_stats_show_the_streamed_prefill():
    """`run --stats`: a prefill's streamed experts, their bytes and pairs in the caption; the
    VRAM hit rate over every routed pair, streamed ones included."""
    from slipstream.cli import breakdown_table
    from slipstream.memory.protocol import StoreStats
    from slipstream.runtime.generate import GenerationStats

    gen = GenerationStats(prompt_tokens=8, generated_tokens=8, prefill_s=0.5, decode_s=2.0)
    store = StoreStats(expert_vram_pairs=100, expert_cpu_pairs=100, expert_syncs=8,
                       expert_streamed=42, expert_stream_bytes=110 * 10**6,
                       expert_stream_pairs=200)
    assert store.expert_vram_rate == 0.25
    console = Console(record=True, width=200)
    console.print(breakdown_table(gen, store, "cuda"))
    text = " ".join(console.export_text().split())
    assert "prefill streamed 42 experts to the GPU (110.0 MB, 200 routed pairs)" in text
