"""Llama 3.x long-context RoPE: GGUF stores it as `rope_freqs` (per-frequency divisors of
theta). Our angles must equal Hugging Face's llama3 rope at every frequency."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import cpu_engine
from slipstream.modelfile.config import ModelConfig
from slipstream.model.rope import RopeTable
from slipstream.synth import write_synth

transformers = pytest.importorskip("transformers")


def hf_llama3_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                      max_position_embeddings=131072, rope_theta=base, rope_scaling=scaling)
    if getattr(cfg, "rope_parameters", None) is not None:  # transformers >= 5 keeps them here
        cfg.rope_parameters = {**scaling, "rope_theta": base}
    return LlamaRotaryEmbedding(cfg).inv_freq.float()


@pytest.mark.slow
def test_rope_freqs_match_hf_llama3(tmp_path):
    head_dim, base = 64, 500000.0
    hf_inv = hf_llama3_inv_freq(head_dim, base)
    plain = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factors = plain / hf_inv  # what llama.cpp's converter writes as rope_freqs.weight
    assert factors.max() > 7.9 and factors.min() == pytest.approx(1.0)  # scaling really applies
    cfg = ModelConfig("llama", 1, head_dim * 4, 64, 4, 4, head_dim, head_dim, 16, 131072, 1e-5,
                      base, "normal")
    table = RopeTable(cfg, 40000, "cpu", freq_factors=factors)
    pos = torch.tensor([1, 777, 32768])
    want = (pos[:, None].double() * hf_inv.double()[None, :])
    assert torch.allclose(table.cos[pos].double(), want.cos(), atol=2e-3)
    assert torch.allclose(table.sin[pos].double(), want.sin(), atol=2e-3)
    # angle at position 1 is the inverse frequency itself: a tight check of the division
    assert torch.allclose(torch.atan2(table.sin[1], table.cos[1]), hf_inv, rtol=1e-5)


def test_loader_feeds_rope_freqs_to_the_engine(tmp_path):
    path = write_synth(tmp_path / "r.gguf", "tiny", "Q8_0", rope_freqs=True)
    engine = cpu_engine(path, ctx=64)
    assert engine.weights.rope_freqs is not None
    expected = np.linspace(1.0, 8.0, engine.cfg.rope_dim // 2, dtype=np.float32)
    assert torch.equal(engine.weights.rope_freqs, torch.from_numpy(expected))
    plain = RopeTable(engine.cfg, 64, "cpu")
    assert not torch.allclose(plain.sin[10], engine.rope.sin[10])
