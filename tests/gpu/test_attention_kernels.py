"""Decode attention and fused RoPE + KV-cache write against plain torch references.

decode_attention is checked against fp64 softmax attention over slots 0..pos, with GQA, for
head dims 64 and 128, groups 1/3/4/8 and positions at the edges of a split and of a span bucket.
Cache slots past pos hold NaN, so any read of them shows up in the result. rope_and_cache is
checked against `RopeTable.apply` plus the cache writes the model does today, for both pairings.
The CUDA-graph tests capture one launch, move the position in device memory and replay.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the same checks in Triton's interpreter
(the interpreter's tl.dot mangles bf16, so bf16 attention is left to the GPU there).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from slipstream.modelfile.config import ModelConfig
from slipstream.kernels.attention import (
    decode_attention,
    plan,
    reference_decode_attention,
)
from slipstream.kernels.rope import rope_and_cache
from slipstream.model.rope import RopeTable

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CACHE_DTYPES = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])

# Relative L2 error vs fp64: q and the probabilities are rounded to the cache dtype for the dot
# products (fp16 ~2^-11, bf16 ~2^-8 per element), and the output to q's dtype.
ATTN_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def _caches(n_kv: int, max_ctx: int, d: int, pos: int, dtype: torch.dtype):
    k = torch.randn(n_kv, max_ctx, d).to(dtype)
    v = torch.randn(n_kv, max_ctx, d).to(dtype)
    k[:, pos + 1:] = float("nan")  # must never be read
    v[:, pos + 1:] = float("nan")
    return k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("pos,span", [(0, 256), (1, 256), (255, 256), (700, 768), (700, 1024),
                                      (5, 4096)])
def test_decode_attention(dtype, d, group, pos, span):
    n_kv = 2
    k, v = _caches(n_kv, max(span, 1030), d, pos, dtype)
    q = torch.randn(n_kv * group, d).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(d)
    out = decode_attention(q, k, v, torch.tensor([pos], device=DEVICE), scale, group, span=span)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), pos, scale, group)
    assert out.shape == (n_kv * group, d) and out.dtype == dtype
    assert _rel(out, ref) < ATTN_TOL[dtype], plan(span, n_kv, group, d)


@pytest.mark.parametrize("window", [1, 16, 100, 512, 5000])
@pytest.mark.parametrize("pos,span", [(0, 256), (99, 256), (255, 256), (700, 768),
                                      (4000, 4096)])
def test_windowed_decode_attention_reads_only_the_window(window, pos, span):
    """A sliding-window layer's query reads slots max(0, pos + 1 - window)..pos: the slots
    before the window hold NaN as those past pos do, so any read of them shows, and the
    result is the oracle's over the window (a window wider than the position is global)."""
    n_kv, group, d, dtype = 2, 4, 128, torch.float16
    k, v = _caches(n_kv, span, d, pos, dtype)
    lo = max(0, pos + 1 - window)
    k_ref, v_ref = k.cpu().clone(), v.cpu().clone()
    k[:, :lo] = float("nan")
    v[:, :lo] = float("nan")
    q = torch.randn(n_kv * group, d).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(d)
    out = decode_attention(q, k, v, torch.tensor([pos], device=DEVICE), scale, group,
                           span=span, window=window)
    ref = reference_decode_attention(q.cpu(), k_ref, v_ref, pos, scale, group, window=window)
    assert not out.isnan().any()
    assert _rel(out, ref) < ATTN_TOL[dtype]
    if lo > 0:  # the window matters: global attention over the same slots differs
        glob = reference_decode_attention(q.cpu(), k_ref, v_ref, pos, scale, group)
        assert _rel(glob, ref) > 10 * ATTN_TOL[dtype]


def test_decode_attention_fp32_q_and_llama8b_shape():
    # Llama-3-8B: 32 query heads over 8 KV heads; q in fp32 as RoPE leaves it.
    n_kv, group, d, pos, span = 8, 4, 128, 1000, 1024
    k, v = _caches(n_kv, span, d, pos, torch.float16)
    q = torch.randn(1, n_kv * group * d, device=DEVICE)
    out = decode_attention(q, k, v, torch.tensor([pos], device=DEVICE), 0.088, group, span=span)
    ref = reference_decode_attention(q.cpu().half(), k.cpu(), v.cpu(), pos, 0.088, group)
    assert out.dtype == torch.float32
    assert _rel(out, ref) < ATTN_TOL[torch.float16]


def test_decode_attention_rejects_bad_input():
    k = torch.zeros(2, 16, 64, dtype=torch.float16, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="span"):
        decode_attention(torch.zeros(2, 64, device=DEVICE), k, k, pos, 1.0, 1, span=17)
    with pytest.raises(ValueError, match="heads"):
        decode_attention(torch.zeros(3, 64, device=DEVICE), k, k, pos, 1.0, 1)
    with pytest.raises(ValueError, match="caches"):
        decode_attention(torch.zeros(2, 64, device=DEVICE), k.float(), k.float(), pos, 1.0, 1)
    with pytest.raises(ValueError, match="window"):
        decode_attention(torch.zeros(2, 64, device=DEVICE), k, k, pos, 1.0, 1, window=-1)


def _cfg(style: str, n_heads: int, n_kv: int, head_dim: int, rope_dim: int) -> ModelConfig:
    return ModelConfig(architecture="llama" if style == "normal" else "qwen2", n_layers=1,
                       hidden=n_heads * head_dim, ffn=1, n_heads=n_heads, n_kv_heads=n_kv,
                       head_dim=head_dim, rope_dim=rope_dim, vocab_size=1, context_length=4096,
                       norm_eps=1e-5, rope_base=500000.0, rope_style=style)


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,rope_dim",
                         [(4, 1, 64, 64), (12, 4, 128, 128), (6, 2, 128, 64)])
@pytest.mark.parametrize("qkv_dtype,cache_dtype", [(torch.float32, torch.float16),
                                                   (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("pos", [0, 37, 799])
def test_rope_and_cache(style, n_heads, n_kv, head_dim, rope_dim, qkv_dtype, cache_dtype, pos):
    max_ctx = 800
    cfg = _cfg(style, n_heads, n_kv, head_dim, rope_dim)
    rope = RopeTable(cfg, max_ctx, DEVICE)
    rows = n_heads + 2 * n_kv
    qkv = torch.randn(1, rows * head_dim).to(qkv_dtype).to(DEVICE)
    k_cache = torch.zeros(n_kv, max_ctx, head_dim, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache,
                       torch.tensor([pos], device=DEVICE), n_heads, n_kv, head_dim, style,
                       rope_dim=rope_dim, q_dtype=torch.float32)

    # The model's path: rotate q and k together in fp32, then cast into the caches.
    x = qkv.view(1, rows, head_dim)
    qk = rope.apply(x[:, : n_heads + n_kv], rope.angles(torch.tensor([pos], device=DEVICE)))
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, qk[0, :n_heads], rtol=1e-5, atol=1e-5)
    # k: fp32 rotations that differ in the last bit may round one ulp apart in the cache.
    ulp = 2 ** -7 if cache_dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(k_cache[:, pos].float(), qk[0, n_heads:].to(cache_dtype).float(),
                               rtol=ulp, atol=1e-6)
    torch.testing.assert_close(v_cache[:, pos], x[0, n_heads + n_kv:].to(cache_dtype),
                               rtol=0, atol=0)
    others = torch.ones(max_ctx, dtype=torch.bool)
    others[pos] = False
    assert not k_cache[:, others.to(DEVICE)].any() and not v_cache[:, others.to(DEVICE)].any()

    # Default q dtype is the cache dtype.
    q2 = rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache,
                        torch.tensor([pos], device=DEVICE), n_heads, n_kv, head_dim, style,
                        rope_dim=rope_dim)
    assert q2.dtype == cache_dtype
    # (one ulp: Triton's interpreter truncates fp32 -> bf16 where the GPU rounds)
    torch.testing.assert_close(q2.float(), q.to(cache_dtype).float(), rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,rope_dim", [(8, 4, 128, 128), (6, 2, 128, 64),
                                                           (4, 1, 256, 256)])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_rope_and_cache_with_head_norms(style, n_heads, n_kv, head_dim, rope_dim, cache_dtype):
    """Qwen3's and Gemma 3's per-head RMSNorm of queries and keys, fused before the rotation:
    the model's unfused path (model.llama.qk_normed's norms, in fp32, then RoPE) within fp32
    rounding; values pass unnormed; without the weights the result is far off."""
    max_ctx, pos, eps = 64, 41, 1e-6
    cfg = _cfg(style, n_heads, n_kv, head_dim, rope_dim)
    rope = RopeTable(cfg, max_ctx, DEVICE)
    rows = n_heads + 2 * n_kv
    qkv = (torch.randn(1, rows * head_dim) * 4).to(DEVICE)
    q_norm = (torch.rand(head_dim) + 0.5).to(DEVICE)
    k_norm = (torch.rand(head_dim) + 0.5).to(DEVICE)
    k_cache = torch.zeros(n_kv, max_ctx, head_dim, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    p = torch.tensor([pos], device=DEVICE)
    q = rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, p, n_heads, n_kv, head_dim,
                       style, rope_dim=rope_dim, q_dtype=torch.float32, q_norm=q_norm,
                       k_norm=k_norm, eps=eps)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    x = qkv.view(1, rows, head_dim)
    normed = torch.cat((rms(x[:, :n_heads], q_norm), rms(x[:, n_heads:n_heads + n_kv], k_norm)),
                       dim=1)
    qk = rope.apply(normed, rope.angles(p))
    torch.testing.assert_close(q, qk[0, :n_heads], rtol=1e-5, atol=1e-5)
    tol = 2 ** -10 if cache_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(k_cache[:, pos].float(), qk[0, n_heads:].to(cache_dtype).float(),
                               rtol=tol, atol=1e-5)
    torch.testing.assert_close(v_cache[:, pos], x[0, n_heads + n_kv:].to(cache_dtype),
                               rtol=0, atol=0)
    plain = rope_and_cache(qkv, rope.cos, rope.sin, k_cache.clone(), v_cache.clone(), p,
                           n_heads, n_kv, head_dim, style, rope_dim=rope_dim,
                           q_dtype=torch.float32)
    assert (plain - qk[0, :n_heads]).abs().max() > 0.5
    with pytest.raises(ValueError, match="both or neither"):
        rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, p, n_heads, n_kv, head_dim,
                       style, rope_dim=rope_dim, q_norm=q_norm)


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,rope_dim", [(8, 4, 128, 128), (6, 2, 128, 64)])
@pytest.mark.parametrize("pos", [3, 700])
def test_rope_and_cache_family_pieces(style, n_heads, n_kv, head_dim, rope_dim, pos):
    """The families' other per-head pieces, fused: no rotation (Cohere 2's global layers), the
    query temperature (Ministral 3: model.llama.attention_temperature, floor 256 here so that
    700 lies past it) and value heads RMS-normed without a weight (Gemma 4:
    model.llama.unit_rms_norm), each against the model's own torch ops; with them off the
    results are far off."""
    from slipstream.model.llama import unit_rms_norm

    max_ctx, eps, temp, floor = 800, 1e-6, 0.3, 256.0
    cfg = _cfg(style, n_heads, n_kv, head_dim, rope_dim)
    rope = RopeTable(cfg, max_ctx, DEVICE)
    rows = n_heads + 2 * n_kv
    qkv = (torch.randn(1, rows * head_dim) * 3).to(DEVICE)
    p = torch.tensor([pos], device=DEVICE)
    x = qkv.view(1, rows, head_dim)

    def run(**kw):
        k_cache = torch.zeros(n_kv, max_ctx, head_dim, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q = rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, p, n_heads, n_kv,
                           head_dim, style, rope_dim=rope_dim, q_dtype=torch.float32, eps=eps,
                           **kw)
        return q, k_cache[:, pos], v_cache[:, pos]

    # no rotation: q and k as they came
    q, k, v = run(rotate=False)
    torch.testing.assert_close(q, x[0, :n_heads], rtol=0, atol=0)
    torch.testing.assert_close(k, x[0, n_heads:n_heads + n_kv], rtol=0, atol=0)
    rotated = rope.apply(x[:, :n_heads + n_kv], rope.angles(p))[0]
    assert (run()[0] - x[0, :n_heads]).abs().max() > 0.1  # (pos > 0 rotates)
    # the query temperature, after the rotation, on every dim of q (k untouched)
    factor = 1.0 + temp * torch.log1p(torch.floor(torch.tensor(float(pos)) / floor))
    q, k, v = run(q_temp=(temp, floor))
    torch.testing.assert_close(q, rotated[:n_heads] * factor.to(DEVICE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rotated[n_heads:], rtol=1e-5, atol=1e-5)
    if pos > floor:
        assert (q - rotated[:n_heads]).abs().max() > 0.1
    # value heads normed without a weight
    q, k, v = run(v_norm=True)
    torch.testing.assert_close(v, unit_rms_norm(x[0, n_heads + n_kv:], eps), rtol=1e-5,
                               atol=1e-5)
    assert (v - x[0, n_heads + n_kv:]).abs().max() > 0.1
    with pytest.raises(ValueError, match="floor"):
        run(q_temp=(temp, 0.0))


def test_rope_and_cache_rejects_bad_input():
    cfg = _cfg("normal", 4, 1, 64, 64)
    rope = RopeTable(cfg, 16, DEVICE)
    kc = torch.zeros(1, 16, 64, dtype=torch.float16, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="style"):
        rope_and_cache(torch.zeros(1, 384, device=DEVICE), rope.cos, rope.sin, kc, kc, pos,
                       4, 1, 64, "gptj")
    with pytest.raises(ValueError, match="T=1"):
        rope_and_cache(torch.zeros(2, 384, device=DEVICE), rope.cos, rope.sin, kc, kc, pos,
                       4, 1, 64, "normal")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_graph_replay_follows_device_position():
    """One capture of rope_and_cache + decode_attention, replayed at positions it never saw."""
    n_heads, n_kv, d, span, max_ctx = 32, 8, 128, 768, 1024
    group = n_heads // n_kv
    cfg = _cfg("normal", n_heads, n_kv, d, d)
    rope = RopeTable(cfg, max_ctx, DEVICE)
    k_cache = torch.randn(n_kv, max_ctx, d, device=DEVICE).half()
    v_cache = torch.randn(n_kv, max_ctx, d, device=DEVICE).half()
    qkv = torch.randn(1, (n_heads + 2 * n_kv) * d, device=DEVICE)
    pos_buf = torch.zeros(1, dtype=torch.long, device=DEVICE)
    scale = 1 / math.sqrt(d)

    def step() -> torch.Tensor:
        q = rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, pos_buf, n_heads, n_kv, d,
                           "normal")
        return decode_attention(q, k_cache, v_cache, pos_buf, scale, group, span=span)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for pos in (0, 1, 63, 64, 255, 700, 767):
        qkv.normal_()
        pos_buf.fill_(pos)
        graph.replay()
        torch.cuda.synchronize()
        x = qkv.view(1, -1, d)
        qk = rope.apply(x[:, : n_heads + n_kv], rope.angles(torch.tensor([pos], device=DEVICE)))
        q_ref = qk[0, :n_heads].half()
        torch.testing.assert_close(k_cache[:, pos], qk[0, n_heads:].half(), rtol=2e-3,
                                   atol=2e-3)
        torch.testing.assert_close(v_cache[:, pos], x[0, n_heads + n_kv:].half())
        ref = reference_decode_attention(q_ref, k_cache, v_cache, pos, scale, group)
        assert _rel(out, ref) < ATTN_TOL[torch.float16], pos
