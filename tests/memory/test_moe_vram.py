"""What a mixture of experts takes in VRAM (memory.vram, from the GGUF index, no GPU needed):
every expert's packed planes counted in a resident layer (a budget short of them splits the
experts with the CPU: tests/memory/test_expert_split_plan.py). tests/gpu/test_moe_gpu.py
compares the count with what a GPU load allocates."""

from __future__ import annotations

import math

import pytest

from slipstream.memory.vram import _expert_linears, layer_vram_bytes, packed_planes
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
