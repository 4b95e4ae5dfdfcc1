"""The fused decode kernels on a sliding-window layer's ring (model.ring): linear slot n at
n mod the ring's slots. decode_attention over a ring that has wrapped gives the fp64 oracle's
result over the full cache's window, and the very bits it gives on that full cache (the same
values, loaded from other addresses, in the same order); the ring's slots outside the window
hold NaN, so a read of one shows. rope_and_cache(ring=True) writes position pos at pos mod
the ring and nowhere else.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs them in Triton's interpreter.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from slipstream.kernels.attention import decode_attention, reference_decode_attention
from slipstream.kernels.rope import rope_and_cache
from slipstream.model.rope import RopeTable
from slipstream.modelfile.config import ModelConfig

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda")
ATTN_TOL = 3e-3  # fp16 cache, as tests/gpu/test_attention_kernels.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def _ring_of(full: torch.Tensor, pos: int, window: int, ring: int) -> torch.Tensor:
    """The ring a layer's writes of linear slots 0..pos leave: slot j at j mod ring, the
    last write winning; the slots outside the window NaN."""
    out = torch.full((full.shape[0], ring, full.shape[2]), float("nan"), dtype=full.dtype)
    for j in range(max(0, pos + 1 - window), pos + 1):
        out[:, j % ring] = full[:, j]
    return out


@pytest.mark.parametrize("window,ring", [(32, 40), (100, 164)])
@pytest.mark.parametrize("pos,span", [(0, 256), (31, 256), (39, 256), (40, 256), (71, 256),
                                      (200, 256), (1000, 1024), (3000, 4096)])
def test_decode_attention_on_a_wrapped_ring(window, ring, pos, span):
    n_kv, group, d, dtype = 2, 4, 64, torch.float16
    k_full = torch.randn(n_kv, span, d).to(dtype)
    v_full = torch.randn(n_kv, span, d).to(dtype)
    k_full[:, pos + 1:] = float("nan")
    v_full[:, pos + 1:] = float("nan")
    k_ring = _ring_of(k_full, pos, window, ring)
    v_ring = _ring_of(v_full, pos, window, ring)
    q = torch.randn(n_kv * group, d).to(dtype)
    scale = 1 / math.sqrt(d)
    p = torch.tensor([pos], device=DEVICE)
    out = decode_attention(q.to(DEVICE), k_ring.to(DEVICE), v_ring.to(DEVICE), p, scale,
                           group, span=span, window=window)
    ref = reference_decode_attention(q, k_full, v_full, pos, scale, group, window=window)
    assert not out.isnan().any()
    assert _rel(out, ref) < ATTN_TOL
    # the torch oracle reads the ring as the kernel does (linear slot n at n mod ring)
    ring_ref = reference_decode_attention(q, k_ring, v_ring, pos, scale, group, window=window)
    assert torch.equal(ring_ref, ref)
    on_full = decode_attention(q.to(DEVICE), k_full.to(DEVICE), v_full.to(DEVICE), p, scale,
                               group, span=span, window=window)
    assert torch.equal(out, on_full)


def test_decode_attention_refuses_a_ring_shorter_than_its_window():
    k = torch.zeros(1, 40, 64, dtype=torch.float16, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="ring of 40 slots cannot hold a window of 50"):
        decode_attention(torch.zeros(1, 64, device=DEVICE), k, k, pos, 1.0, 1, span=256,
                         window=50)


@pytest.mark.parametrize("pos", [3, 40, 123])
def test_rope_and_cache_writes_a_ring_at_pos_mod_its_slots(pos):
    n_heads, n_kv, d, ring = 4, 2, 64, 40
    cfg = ModelConfig(architecture="llama", n_layers=1, hidden=n_heads * d, ffn=1,
                      n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, rope_dim=d, vocab_size=1,
                      context_length=256, norm_eps=1e-5, rope_base=10000.0,
                      rope_style="normal")
    rope = RopeTable(cfg, 256, DEVICE)
    qkv = torch.randn(1, (n_heads + 2 * n_kv) * d).to(DEVICE)
    p = torch.tensor([pos], device=DEVICE)
    k_full = torch.zeros(n_kv, 256, d, dtype=torch.float16, device=DEVICE)
    v_full = torch.zeros_like(k_full)
    k_ring = torch.zeros(n_kv, ring, d, dtype=torch.float16, device=DEVICE)
    v_ring = torch.zeros_like(k_ring)
    q_full = rope_and_cache(qkv, rope.cos, rope.sin, k_full, v_full, p, n_heads, n_kv, d,
                            "normal")
    q_ring = rope_and_cache(qkv, rope.cos, rope.sin, k_ring, v_ring, p, n_heads, n_kv, d,
                            "normal", ring=True)
    assert torch.equal(q_ring, q_full)
    assert torch.equal(k_ring[:, pos % ring], k_full[:, pos]) and k_full[:, pos].any()
    assert torch.equal(v_ring[:, pos % ring], v_full[:, pos])
    others = torch.ones(ring, dtype=torch.bool, device=DEVICE)
    others[pos % ring] = False
    assert not k_ring[:, others].any() and not v_ring[:, others].any()
    if pos >= ring:  # without the flag a position past the cache writes nothing
        k_plain = torch.zeros_like(k_ring)
        rope_and_cache(qkv, rope.cos, rope.sin, k_plain, torch.zeros_like(k_ring), p, n_heads,
                       n_kv, d, "normal")
        assert not k_plain.any()
