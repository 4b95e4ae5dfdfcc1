"""What a mixture of experts takes in VRAM (memory.vram, from the GGUF index, no GPU needed):
every expert's packed planes counted in a resident layer, and a budget short of them refused
with the numbers (memory.setup). tests/gpu/test_moe_gpu.py compares the count with what a
GPU load allocates."""

from __future__ import annotations

import math

import pytest

from slipstream.errors import BudgetTooSmall
from slipstream.memory import setup
from slipstream.memory.budget import fmt_bytes
from slipstream.memory.vram import (_expert_linears, layer_vram_bytes, packed_planes,
                                    vram_reserve)
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth


def _open(tmp_path, arch: str, quant: str):
    path = write_synth(tmp_path / f"{arch}.gguf", "tiny", quant, n_layers=2, arch=arch)
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


@pytest.mark.parametrize("arch,quant", [("mixtral", "Q8_0"), ("qwen3moe", "Q4_K_M"),
                                        ("gpt-oss", "MXFP4")])
def test_resident_layer_counts_every_expert(tmp_path, arch, quant):
    """The stacked expert weights' planes: Q8_0's planes are GGUF's size, so a layer holds at
    least its expert tensors' bytes; gate and up are one stack where their formats agree,
    and every expert's rows are in it."""
    gf, cfg = _open(tmp_path, arch, quant)
    exps = [gf.tensors[f"blk.0.{p}.weight"] for p in ("ffn_gate_exps", "ffn_up_exps",
                                                      "ffn_down_exps")]
    stacked = _expert_linears(gf, cfg, 0)
    assert sum(r for _, r, _, _ in stacked) == sum(math.prod(t.shape[:2]) for t in exps)
    same = exps[0].ggml_type == exps[1].ggml_type
    assert len(stacked) == (2 if same else 3)
    planes = sum(sum(packed_planes(q, r, c)) for q, r, c, _ in stacked)
    assert planes >= 0.99 * sum(t.n_bytes for t in exps)
    router = cfg.n_experts * cfg.hidden * 4
    assert layer_vram_bytes(gf, cfg, 0) >= planes + router
    if arch == "gpt-oss":  # biases: (n_experts, rows) float32 each
        assert all(b for *_, b in stacked)


def test_budget_short_of_the_experts_names_the_need(tmp_path):
    gf, cfg = _open(tmp_path, "mixtral", "Q8_0")
    vram = [layer_vram_bytes(gf, cfg, i) for i in range(cfg.n_layers)]
    per_stage = dict(graph_bucket=256, kv_layers=cfg.n_layers, holds_embedding=True,
                     holds_head=True)
    reserve = vram_reserve(gf, cfg, 256, 2, 512, True, False, **per_stage)
    need = sum(vram) + sum(reserve.values())
    with pytest.raises(BudgetTooSmall) as err:
        setup._refuse_experts_outside_vram(gf, cfg, vram, 1 << 20, None, 256, 2, 512, False,
                                           per_stage)
    msg = str(err.value)
    assert f"{fmt_bytes(need)} in all" in msg and f"against {fmt_bytes(1 << 20)}" in msg
    assert f"take {fmt_bytes(sum(vram))} (experts included)" in msg
    with pytest.raises(BudgetTooSmall, match=f"vram_layers=1: .* all {cfg.n_layers} of its"):
        setup._refuse_experts_outside_vram(gf, cfg, vram, 1 << 40, 1, 256, 2, 512, False,
                                           per_stage)
