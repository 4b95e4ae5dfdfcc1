"""Experts whose gate and up projections are stored as one tensor, `ffn_gate_up_exps`
(n_experts, 2 * expert_ffn, hidden), each expert's gate rows then its up rows, as newer
llama.cpp conversions write them (llama.cpp's create_tensor_gate_up_exps; build_moe_ffn takes
the first half as the gate).

`synth --fused-experts` writes the weights of the same file written with them apart, which
the byte comparison below checks against the split file itself. The two files must then give
the same logits bit for bit, in every family with experts, at both precisions; the fused file
must match llama.cpp (which reads the fused tensor for deepseek2 and gemma4) within 1e-3 on a
float32 copy; and the plan must count the same bytes per expert for both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import cpu_engine, file_config
from llamacpp_ref import unname
from slipstream.errors import BadArgument
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary
F32_REL_TOL = 1e-3
F32_DECISIVE_GAP = 5e-3


def _pair(d, arch: str, n_layers: int = 2, quant: str = "Q8_0"):
    """(split, fused) files of `arch`, the same seed."""
    return [write_synth(d / f"{arch}-{tag}.gguf", "tiny", quant, n_layers=n_layers, arch=arch,
                        seed=3, from_floats=quant == "Q8_0", std=0.15, fused_experts=fused)
            for tag, fused in (("split", False), ("fused", True))]


def _bytes(gf: GGUFFile, name: str) -> np.ndarray:
    t = gf.tensors[name]
    return np.asarray(gf.tensor_bytes(name)).reshape(int(t.shape[0]), -1)


def test_a_fused_file_holds_the_split_files_gate_then_up_per_expert(tmp_path):
    split, fused = _pair(tmp_path, "qwen3moe")
    a, b = GGUFFile(split), GGUFFile(fused)
    assert "blk.1.ffn_gate_up_exps.weight" not in a.tensors
    assert "blk.1.ffn_gate_exps.weight" not in b.tensors
    assert "blk.1.ffn_up_exps.weight" not in b.tensors
    assert tuple(b.tensors["blk.1.ffn_gate_up_exps.weight"].shape) == (16, 512, 256)
    for i in range(2):
        gate, up = (_bytes(a, f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up"))
        np.testing.assert_array_equal(_bytes(b, f"blk.{i}.ffn_gate_up_exps.weight"),
                                      np.concatenate([gate, up], axis=1))
        np.testing.assert_array_equal(_bytes(a, f"blk.{i}.ffn_down_exps.weight"),
                                      _bytes(b, f"blk.{i}.ffn_down_exps.weight"))
    assert (file_config(split).fused_experts, file_config(fused).fused_experts) == (False, True)
    a.close()
    b.close()


def test_fused_experts_are_refused_without_experts(tmp_path):
    with pytest.raises(BadArgument, match="--fused-experts .* no experts"):
        write_synth(tmp_path / "l.gguf", "tiny", "Q8_0", arch="llama", fused_experts=True)


def test_cli_writes_fused_experts(tmp_path):
    from slipstream.cli import main

    out = tmp_path / "f.gguf"
    assert main(["synth", "--shape", "tiny", "--arch", "qwen3moe", "--layers", "1",
                 "--quant", "Q8_0", "--fused-experts", "-o", str(out)]) == 0
    assert "blk.0.ffn_gate_up_exps.weight" in GGUFFile(out).tensors


def _logits(path, precision: str, decode: bool, ids: list[int] = IDS) -> torch.Tensor:
    engine = cpu_engine(path, precision=precision)
    if not decode:
        return engine.forward(ids, all_logits=True)
    return torch.cat([engine.forward(ids[:4], all_logits=True)]
                     + [engine.forward(ids[i:i + 1]) for i in range(4, len(ids))])


def test_fused_and_split_files_decode_identically(tmp_path):
    """The fast tier's check: Qwen3-MoE at the default precision, prefill then decode."""
    split, fused = _pair(tmp_path, "qwen3moe", n_layers=2)
    assert torch.equal(_logits(split, "fast", True, IDS[:8]),
                       _logits(fused, "fast", True, IDS[:8]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss", "glm4moe", "deepseek2",
                                  "deepseek2-lite", "gemma4-moe"])
def test_fused_and_split_files_give_identical_logits(tmp_path, arch):
    split, fused = _pair(tmp_path, arch, n_layers=3)
    for precision in ("exact", "fast"):
        for decode in (False, True):
            a, b = _logits(split, precision, decode), _logits(fused, precision, decode)
            assert torch.equal(a, b), (arch, precision, decode, (a - b).abs().max())


@pytest.mark.slow
def test_fused_q4k_file_gives_the_split_files_logits_at_fast(tmp_path):
    """Q4_K experts (packed q4vnni decode copies: gate and up packed as one group from the
    fused tensor's halves) decode as the split file's do."""
    split, fused = _pair(tmp_path, "qwen3moe", n_layers=2, quant="Q4_K")
    assert torch.equal(_logits(split, "fast", True), _logits(fused, "fast", True))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek2", "gemma4-moe"])
def test_fused_file_matches_llamacpp(tmp_path, arch):
    """llama.cpp reads ffn_gate_up_exps for deepseek2 and gemma4 (not for qwen3moe, mixtral,
    gpt-oss or glm4moe, whose fused files only slipstream reads): measured 1.2e-6 (gemma4-moe)
    on the float32 copy, prefill, and decode one token at a time."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import assert_matches, llamacpp_logits
    from slipstream.quant.requantize import requantize

    _, fused = _pair(tmp_path, arch, n_layers=4)
    unname(fused, arch)
    f32 = requantize(fused, tmp_path / "f32.gguf", "F32")
    assert "blk.1.ffn_gate_up_exps.weight" in GGUFFile(f32).tensors
    ref = llamacpp_logits(f32, IDS)
    assert_matches(_logits(fused, "exact", False), ref, F32_REL_TOL, F32_DECISIVE_GAP)
    assert_matches(_logits(fused, "exact", True), ref, F32_REL_TOL, F32_DECISIVE_GAP)


def test_the_plan_counts_the_same_expert_bytes_either_way(tmp_path):
    """memory.expert_plan sizes an expert from its projections, whichever tensors hold them:
    the same RAM, read and dense bytes for both files, and the same slots at one budget."""
    from slipstream.memory.expert_plan import (expert_dense_bytes, expert_file_bytes,
                                               expert_ram_bytes)
    from slipstream.precision import Precision

    split, fused = _pair(tmp_path, "deepseek2", n_layers=2)
    cpu = torch.device("cpu")
    counts = []
    for path in (split, fused):
        gf, cfg = GGUFFile(path), file_config(path)
        counts.append([(expert_ram_bytes(gf, cfg, 1, Precision.of(p, cpu)),
                        expert_dense_bytes(gf, cfg, 1, Precision.of(p, cpu)),
                        expert_file_bytes(gf, cfg, 1)) for p in ("exact", "fast")])
        gf.close()
    assert counts[0] == counts[1]
    gf = GGUFFile(split)
    per_expert = sum(gf.tensors[f"blk.1.ffn_{p}_exps.weight"].n_bytes
                     for p in ("gate", "up", "down")) // 16
    gf.close()
    assert counts[0][0][2] == per_expert
