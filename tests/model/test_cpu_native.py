"""The native CPU decode ops (slipstream.native, model.cpu_native) against torch.

Each C function is held to the torch ops it replaces: the same values up to float32 rounding
(its sums run in another order), then rounded to bfloat16 at the same places, so an output
differs from torch's by at most one bfloat16 step, and only where torch's float32 value lies
within float32 noise of a rounding boundary. A decode token through them is held to the torch
path (model.cpu_decode) at the distance of two float32 orders of summation, and to the logits
of Hugging Face transformers' elsewhere (tests/model/test_vs_transformers.py runs at the
default setting, native on).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slipstream import native
from slipstream.model import cpu_native, llama
from slipstream.synth import write_synth

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: decode takes the torch ops")


def ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous()
    return t.data_ptr()


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values apart a and b (both bfloat16) are, elementwise."""
    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def assert_bf16_close(got: torch.Tensor, ref64: torch.Tensor, share: float = 0.02):
    """got (bfloat16) is ref64 rounded to bfloat16, except for elements one step off where the
    exact value lies within float32 noise of a rounding boundary (at most `share` of them)."""
    want = ref64.to(torch.float32).to(torch.bfloat16)
    steps = bf16_steps(got, want)
    assert int(steps.max()) <= 1, float(steps.max())
    assert float((steps > 0).float().mean()) <= share


@pytest.mark.parametrize("n", [576, 100, 7])
def test_rms_norm_and_the_residual_add(n):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, generator=g), torch.randn(n, generator=g)
    y = torch.randn(n, generator=g).to(torch.bfloat16)
    lib = native.library()
    out = torch.empty(n, dtype=torch.bfloat16)
    lib.ss_rms_norm_bf16(ptr(x), ptr(w), n, 1e-5, ptr(out))
    xd = x.double()
    assert_bf16_close(out, xd * torch.rsqrt(xd.pow(2).mean() + 1e-5) * w.double())
    mid = torch.empty(n)
    lib.ss_add_rms_norm_bf16(ptr(x), ptr(y), ptr(w), n, 1e-5, ptr(mid), ptr(out))
    assert torch.equal(mid, x + y)  # the residual add is torch.add's, bit for bit
    md = mid.double()
    assert_bf16_close(out, md * torch.rsqrt(md.pow(2).mean() + 1e-5) * w.double())


@pytest.mark.parametrize("n", [1536, 37])
def test_silu_mul_is_torchs_in_bfloat16(n):
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(2 * n, generator=g) * 4).to(torch.bfloat16)
    gate_up[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's ends, and zeros
    out = torch.empty(n, dtype=torch.bfloat16)
    native.library().ss_silu_mul_bf16(ptr(gate_up), n, ptr(out))
    gate, up = gate_up.chunk(2)
    want = torch.mul(F.silu(gate), up)  # the torch path's ops
    assert int(bf16_steps(out, want).max()) <= 1
    assert float((out != want).float().mean()) <= 0.02
    assert not out.isnan().any()


def reference_attention(qkv, cos, sin, style, rope_dim, pos, k_cache, v_cache, n_q, n_kv, d):
    """The decode attention in float64 from the same inputs: rotate, write, attend."""
    n = n_q + n_kv
    heads = qkv.double().view(n + n_kv, d).clone()
    rot = heads[:n, :rope_dim]
    c, s = cos.double(), sin.double()
    if style == 0:
        re, im = rot[:, 0::2].clone(), rot[:, 1::2].clone()
        rot[:, 0::2], rot[:, 1::2] = re * c - im * s, re * s + im * c
    else:
        half = rope_dim // 2
        x1, x2 = rot[:, :half].clone(), rot[:, half:].clone()
        rot[:, :half], rot[:, half:] = x1 * c - x2 * s, x2 * c + x1 * s
    k = k_cache.double().clone()
    v = v_cache.double().clone()
    k[:, pos], v[:, pos] = heads[n_q:n], heads[n:]
    q = heads[:n_q].view(n_kv, n_q // n_kv, d)
    scores = q @ k[:, :pos + 1].transpose(1, 2) / math.sqrt(d)
    out = torch.softmax(scores, dim=-1) @ v[:, :pos + 1]
    return out.reshape(n_q * d), k, v


@pytest.mark.parametrize("n_q, n_kv, d, rope_dim", [
    (9, 3, 64, 64),  # the default model's heads
    (4, 4, 32, 32),  # no grouping
    (24, 2, 64, 64),  # 12 query heads a KV head: more than the 8 held at once
    (6, 2, 40, 24),  # head_dim not a multiple of 16, partial rotation
])
@pytest.mark.parametrize("style", [0, 1])
@pytest.mark.parametrize("pos", [0, 5, 77])
@pytest.mark.parametrize("qkv_f32", [False, True])
def test_decode_attention_matches_float64(n_q, n_kv, d, rope_dim, style, pos, qkv_f32):
    g = torch.Generator().manual_seed(pos + 7 * n_q + d)
    max_ctx = 96
    qkv = torch.randn((n_q + 2 * n_kv) * d, generator=g) * 2
    qkv = qkv if qkv_f32 else qkv.to(torch.bfloat16)
    theta = torch.rand(rope_dim // 2, generator=g) * 6
    cos, sin = theta.cos(), theta.sin()
    if style == 0:  # RopeTable.angles: complex (cos, sin) pairs
        ang, ang_sin = torch.complex(cos, sin), cos
    else:  # cos and sin, each half repeated
        ang, ang_sin = torch.cat((cos, cos)), torch.cat((sin, sin))
    k_cache = torch.randn(n_kv, max_ctx, d, generator=g)
    v_cache = torch.randn(n_kv, max_ctx, d, generator=g)
    want, k_want, v_want = reference_attention(qkv, cos, sin, style, rope_dim, pos, k_cache,
                                               v_cache, n_q, n_kv, d)
    work = torch.empty(n_q * d + (n_q // n_kv) * max_ctx)
    out = torch.empty(n_q * d, dtype=torch.bfloat16)
    native.library().ss_decode_attention(
        ptr(qkv), qkv_f32, ptr(ang), ptr(ang_sin), rope_dim, style, pos, ptr(k_cache),
        ptr(v_cache), max_ctx, n_q, n_kv, d, 1.0 / math.sqrt(d), ptr(work), ptr(out))
    # the cache: the one slot written, rotated as float32 rotates (a few ulps from float64)
    assert torch.allclose(k_cache.double(), k_want, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache, v_want.float())  # values are only widened
    assert_bf16_close(out, want)


@pytest.mark.slow
def test_layer_after_layer_matches_the_torch_path(tmp_path, monkeypatch):
    """Whole decode tokens on a synthetic model with native ops on and off: the keys, values
    and logits agree as two float32 orders of summation do (the activations go through
    bfloat16 at the same places in both, so a one-step rounding difference can spread)."""
    from helpers import cpu_engine

    runs = []
    for arch in ("llama", "qwen2"):  # adjacent / half RoPE pairs; qwen2's QKV bias
        path = write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q4_K", n_layers=3,
                           from_floats=True, std=0.1, seed=5, arch=arch)
        for on in (True, False):
            monkeypatch.setattr(llama, "CPU_NATIVE", on)
            engine = cpu_engine(path, ctx=64, precision="fast")
            engine.forward([3, 17, 99])
            logits = torch.cat([engine.forward([t]) for t in (11, 42, 500, 8, 1, 2, 3)])
            served = [isinstance(w.cpu_native, cpu_native.NativeLayer)
                      for w in engine.weights.layers]
            runs.append((logits, engine.kv.k[:, :, :10].clone(), served))
        (a, ka, served_on), (b, kb, served_off) = runs[-2:]
        assert all(served_on) and not any(served_off), arch
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) < 0.02 * scale, arch
        assert torch.allclose(ka, kb, rtol=0.02, atol=0.02 * float(kb.abs().max())), arch


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fused_layer_is_the_call_by_call_path_bit_for_bit(tmp_path, monkeypatch, arch):
    """native/decode_layer.c makes the same calls in the same order as decode_layer's Python
    (FUSED_LAYER off), so the keys, values and logits are the same bits, at 1 and 2 threads.
    qwen2's q/k/v bias keeps its layers on the call-by-call path (no fused call is made)."""
    from helpers import cpu_engine

    path = write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q4_0", n_layers=3,
                       from_floats=True, std=0.1, seed=7, arch=arch)
    runs = {}
    for fused in (True, False):
        for threads in (1, 2):
            monkeypatch.setattr(cpu_native, "FUSED_LAYER", fused)
            torch.set_num_threads(threads)
            engine = cpu_engine(path, ctx=64, precision="fast")
            engine.forward([3, 17, 99])
            logits = torch.cat([engine.forward([t]) for t in (11, 42, 500, 8, 1, 2, 3)])
            runs[fused, threads] = (logits, engine.kv.k[:, :, :10].clone(),
                                    engine.kv.v[:, :, :10].clone())
            assert all(isinstance(w.cpu_native, cpu_native.NativeLayer)
                       for w in engine.weights.layers)
            # the ss_layer is made at a layer's first fused call
            made = [w.cpu_native.fused is not None for w in engine.weights.layers]
            assert made == [fused and arch == "llama"] * 3, (arch, fused)
    torch.set_num_threads(2)
    ref = runs[False, 1]
    for key, got in runs.items():
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (arch, key)


def test_off_switch_and_unserved_layers(monkeypatch, tmp_path):
    """SLIPSTREAM_NATIVE=0 turns the library off (decode takes the torch ops); exact precision
    has no packed kernels, so no layer takes the native form."""
    from helpers import cpu_engine

    monkeypatch.setenv("SLIPSTREAM_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
        path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=2, seed=1)
        engine = cpu_engine(path, ctx=32, precision="fast")
        engine.forward([1, 2])
        engine.forward([3])
        assert [w.cpu_native for w in engine.weights.layers] == [False, False]
    finally:
        monkeypatch.delenv("SLIPSTREAM_NATIVE")
        native.library.cache_clear()
    assert native.library() is not None
    engine = cpu_engine(path, ctx=32, precision="exact")
    engine.forward([1, 2])
    engine.forward([3])
    assert [w.cpu_native for w in engine.weights.layers] == [False, False]


def test_long_context_goes_to_torch(monkeypatch, tmp_path):
    """Past NATIVE_MAX_SPAN slots the single-threaded C attention gives way to torch's."""
    from helpers import cpu_engine

    calls = []
    real = cpu_native.decode_layer
    monkeypatch.setattr(llama, "native_decode_layer",
                        lambda *a: calls.append(a[4]) or real(*a))
    monkeypatch.setattr(cpu_native, "NATIVE_MAX_SPAN", 4)
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=1, seed=2)
    engine = cpu_engine(path, ctx=32, precision="fast")
    engine.forward([1, 2])
    for t in (3, 4, 5, 6):
        engine.forward([t])
    assert calls == [2, 3]  # slots 2 and 3; 4 and 5 by the torch ops


@pytest.mark.slow
def test_one_build_however_many_threads_ask(monkeypatch, tmp_path):
    """api.load starts the build beside the load (native.build_in_background) while a decode
    may ask for the library too: one compile, one library for all of them."""
    import threading

    builds = []
    real = native._compile
    monkeypatch.setattr(native, "_compile", lambda *a: builds.append(a) or real(*a))
    monkeypatch.setenv("SLIPSTREAM_NATIVE_DIR", str(tmp_path / "native"))
    native.library.cache_clear()
    try:
        got = []
        threads = [threading.Thread(target=lambda: got.append(native.library()))
                   for _ in range(3)]
        native.build_in_background()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(builds) == 1 and len(got) == 3 and None not in got
        assert len(list((tmp_path / "native").glob("decode_ops-*.so"))) == 1
    finally:
        monkeypatch.delenv("SLIPSTREAM_NATIVE_DIR")
        native.library.cache_clear()
