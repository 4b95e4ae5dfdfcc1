"""Triton kernels against the reference dequantize-then-matmul (float64 on the CPU).

Every format, odd shapes (rows 1, 17, 33, 300; K a whole number of blocks but not a power of two),
m in {1, 3, 8} for the fused GEMV, m up to 128 for the
tensor-core quantized GEMM (qgemm), m in {17, 512} for matmul's dispatch (qgemm, then the
prefill path). Errors are ||y - ref|| / ||ref||, bounded by the one table below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from slipstream import kernels  # noqa: E402

pytestmark = pytest.mark.gpu

FLOATS = [T.F32, T.F16, T.BF16]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ALL = FLOATS + LEGACY + KQUANTS

# Relative L2 error bounds, per format and path. The fused fp32 GEMV is exact up to summation
# order (~1e-7 seen); the prefill path rounds the weights to bf16
# (~2^-9 per weight, ~4e-3 seen on random data). A bf16 output adds another ~2^-9.
FP32_TOL = 2e-6
BF16_W_TOL = 1e-2
TOL: dict[T, dict[str, float]] = {
    qt: {"gemv": FP32_TOL, "gemv_bf16_out": 8e-3, "prefill": BF16_W_TOL}
    for qt in ALL
}
TOL[T.F32]["prefill"] = BF16_W_TOL  # weights go to bf16 for cuBLAS too
# The int8-activation GEMV (precision="fast"): against the reference run on the same int8-rounded
# x it is exact up to fp32 summation order; against the unrounded x it carries x's rounding to
# 8 bits per block of 32 (~0.5% per element on Gaussian data).
for qt in LEGACY + KQUANTS:
    TOL[qt]["gemv_q8"] = 2e-5
    TOL[qt]["gemv_q8_vs_float_x"] = 1.5e-2


def _reference_dequant(raw: np.ndarray, qt: T, n: int, k: int) -> np.ndarray:
    """float64 (n, k): slipstream.quant's torch oracle when present, else gguf-py's numpy one."""
    try:
        from slipstream.quant import dequantize
    except ImportError:
        return gguf.quants.dequantize(raw, qt).reshape(n, k).astype(np.float64)
    return dequantize(torch.from_numpy(raw), qt, (n, k)).double().numpy()


def _make_weight(qt: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random but sane GGUF bytes (n, row_bytes): quantized floats for formats gguf-py can
    quantize, random blocks with small finite f16 scale fields for the K-quants."""
    if qt in FLOATS:
        data = rng.standard_normal((n, k)).astype(np.float32)
        enc = data if qt == T.F32 else gguf.quants.quantize(data, qt)
        return np.ascontiguousarray(enc).view(np.uint8).reshape(n, -1)
    if qt in LEGACY:
        data = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(data, qt).reshape(n, -1)
    _, tsize = GGML_QUANT_SIZES[qt]
    nb = n * k // 256
    blocks = rng.integers(0, 256, size=(nb, tsize), dtype=np.uint8)
    f16_fields = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                  T.Q6_K: (208,)}[qt]
    for off in f16_fields:
        vals = rng.uniform(1e-3, 1e-2, size=nb).astype(np.float16)
        blocks[:, off:off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def _k_for(qt: T) -> int:
    return 32 * 7 if GGML_QUANT_SIZES[qt][0] == 32 or qt in FLOATS else 256 * 3


def _setup(qt: T, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = _make_weight(qt, n, k, rng)
    ref = _reference_dequant(raw, qt, n, k)
    packed = kernels.pack_weight(torch.from_numpy(raw).cuda(), qt, n, k)
    return packed, ref


def _rel(y: torch.Tensor, ref: np.ndarray) -> float:
    y = y.double().cpu().numpy()
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 17, 33, 300])
def test_gemv_matches_reference(qt: T, n: int) -> None:
    k = _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=n)
    for m in (1, 3, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        yref = x.double().cpu().numpy() @ ref.T
        out = torch.full((m, n), float("nan"), device="cuda")  # poison: every element written
        kernels.gemv(x, packed, out=out)
        assert _rel(out, yref) <= TOL[qt]["gemv"], (qt.name, n, m)
        ybf = kernels.gemv(x, packed)
        assert ybf.dtype == torch.bfloat16
        assert _rel(ybf, yref) <= TOL[qt]["gemv_bf16_out"], (qt.name, n, m)


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_gemv_config_sweep(qt: T) -> None:
    """Tile shapes the autotuned table may pick, including tails in N and K."""
    k = _k_for(qt) * 3
    n = 45
    packed, ref = _setup(qt, n, k, seed=7)
    x = torch.randn(2, k, device="cuda").to(torch.float16)
    yref = x.double().cpu().numpy() @ ref.T
    sizes = [{"BN": bn, "BK": bk} for bn in (1, 4, 16) for bk in (64, 512)] if qt in FLOATS \
        else [{"BN": bn, "NU": nu} for bn in (1, 4, 16) for nu in (4, 16, 64)]
    for cfg in sizes:
        y = kernels.gemv(x, packed, out_dtype=torch.float32, config=dict(cfg, num_warps=4))
        assert _rel(y, yref) <= TOL[qt]["gemv"], (qt.name, cfg)
    if qt not in FLOATS:  # the m = 1 kernel's tiles (BN rows x NG scale groups)
        for cfg in [{"BN": 1, "NG": 8}, {"BN": 2, "NG": 32}, {"BN": 8, "NG": 32},
                    {"BN": 1, "NG": 256}]:
            y = kernels.gemv(x[:1], packed, out_dtype=torch.float32, config=dict(cfg, num_warps=8))
            assert _rel(y, yref[:1]) <= TOL[qt]["gemv"], (qt.name, cfg)


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [17, 512])
def test_prefill_matmul(qt: T, m: int) -> None:
    k = _k_for(qt)
    n = 33
    packed, ref = _setup(qt, n, k, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = kernels.matmul(x.reshape(1, m, k), packed)
    assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
    yref = x.double().cpu().numpy() @ ref.T
    assert _rel(y.reshape(m, n), yref) <= TOL[qt]["prefill"]


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_one_block_per_row(qt: T) -> None:
    """K = one (super-)block: planes sliced out of single-block rows once stayed strided views
    of the raw bytes, and Q2_K/Q6_K came out as garbage (the 256-wide layers of tiny models)."""
    k = GGML_QUANT_SIZES[qt][0] if qt not in FLOATS else 32
    packed, ref = _setup(qt, 17, k, seed=7)
    x = torch.randn(1, k, device="cuda")
    yref = x.double().cpu().numpy() @ ref.T
    assert _rel(kernels.gemv(x, packed, out_dtype=torch.float32), yref) <= TOL[qt]["gemv"]
    w = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    assert np.array_equal(w, ref)


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_dequantize_bit_exact(qt: T) -> None:
    """Dequant to fp32 equals the reference exactly; to bf16, the reference rounded once."""
    n, k = 17, _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=3)
    w32 = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    assert np.array_equal(w32, ref)
    wbf = kernels.dequantize(packed).float().cpu()
    assert torch.equal(wbf, torch.from_numpy(ref).float().to(torch.bfloat16).float())


def test_matmul_small_m_uses_fused_path() -> None:
    """Up to 8 rows (leading dims folded) go to the exact GEMV: the same bits as calling it."""
    packed, ref = _setup(T.Q4_K, 33, 512, seed=11)
    x = torch.randn(2, 4, 512, device="cuda").to(torch.bfloat16)
    y = kernels.matmul(x, packed, out_dtype=torch.float32)
    yref = x.reshape(8, 512).double().cpu().numpy() @ ref.T
    assert y.shape == (2, 4, 33)
    assert torch.equal(y.reshape(8, 33), kernels.gemv(x.reshape(8, 512), packed,
                                                       out_dtype=torch.float32))
    assert _rel(y.reshape(8, 33), yref) <= TOL[T.Q4_K]["gemv"]


def test_pack_rejects_bad_input() -> None:
    from slipstream.errors import GGUFError, UnsupportedTensorType

    raw = torch.zeros(144, dtype=torch.uint8, device="cuda")
    with pytest.raises(GGUFError):
        kernels.pack_weight(raw, T.Q4_K, 1, 255)
    with pytest.raises(GGUFError):
        kernels.pack_weight(raw[:100], T.Q4_K, 1, 256)
    with pytest.raises(UnsupportedTensorType):
        kernels.pack_weight(raw, T.TQ2_0, 1, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096, 5120])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    eps = 1e-5
    x = torch.randn(7, hidden, device="cuda").to(dtype)
    r = torch.randn(7, hidden, device="cuda").to(dtype)
    w = torch.randn(hidden, device="cuda").to(dtype)

    def ref(v):
        v = v.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.float())

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    y = kernels.rms_norm(x, w, eps)
    assert (y.float() - ref(x)).norm() / ref(x).norm() < tol
    y2, h = kernels.rms_norm(x, w, eps, residual=r)
    assert torch.equal(h, x + r)
    assert (y2.float() - ref(x + r)).norm() / ref(x + r).norm() < tol
    # the post-norm form (Gemma): r + norm(x), one rounding of the sum
    y3 = kernels.rms_norm(x, w, eps, add_to=r)
    want = r.float() + ref(x)
    assert y3.dtype == dtype and (y3.float() - want).norm() / want.norm() < tol
    assert (y3.float() - ref(x)).norm() / want.norm() > 10 * tol  # the residual is in it
    with pytest.raises(ValueError, match="give one"):
        kernels.rms_norm(x, w, eps, residual=r, add_to=r)


def _quantize_x_reference(x: torch.Tensor) -> np.ndarray:
    """x rounded as the int8-activation GEMV specifies: per block of 32, codes are
    round-half-away(x * (127 / max|x|)) computed in float32 (ties decided in float64 would
    differ now and then), scale = max|x| / 127; returned dequantized, float64."""
    xb = x.float().cpu().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    v = xb * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    return (q.astype(np.float64) * (amax.astype(np.float64) / 127.0)).reshape(x.shape[0], -1)


@pytest.mark.parametrize("qt", LEGACY + KQUANTS, ids=lambda t: t.name)
def test_fused_scales_dequantize_within_f16_rounding(qt: T) -> None:
    """precision="fast" keeps s = d*sc and t = dmin*mn as f16: each weight may move by the f16
    rounding of its scale and min (2^-11 relative each), and by nothing else."""
    from slipstream.kernels.pack import fuse_scales

    n, k = 33, _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=3)
    fused = fuse_scales(packed)
    w = kernels.dequantize(fused, torch.float32).double().cpu().numpy()
    # bound: 2^-11 * (|s * (q - OFF)| + |t|) <= 2^-11 * (|w| + 2|t|); |t| <= max |w| per row
    bound = 2.0 ** -11 * (np.abs(ref) + 2 * np.abs(ref).max(axis=1, keepdims=True)) + 1e-12
    assert (np.abs(w - ref) <= bound).all(), qt.name
    if qt in (T.Q4_0, T.Q5_0, T.Q8_0):
        assert fused is packed  # one f16 scale per 32 already: nothing to fuse


def _decode_q8(xq: torch.Tensor, xm: torch.Tensor) -> np.ndarray:
    """The x a GEMV on (xq, xm) multiplies, float64 (layout checked by test_quantize_x_layout)."""
    m = xq.shape[0]
    codes = xq.cpu().numpy().view(np.int8).reshape(m, -1, 8, 4).transpose(0, 1, 3, 2)
    scale = xm[..., 0].cpu().numpy().view(np.float32).astype(np.float64)
    return (codes.reshape(m, -1, 32) * scale[:, :, None]).reshape(m, -1)


def _check_codes_near_reference(x: torch.Tensor, xq: torch.Tensor) -> None:
    """The kernel's codes against the reference rounding: equal except at exact ties of
    fp16/bf16 inputs (x*127/amax = n + 1/2 exactly), which the GPU's division may send either
    way: such codes differ by one, and they are rare."""
    xr = x.float().cpu().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xr).max(axis=2, keepdims=True)
    ref = np.round(_quantize_x_reference(x).reshape(xr.shape) /
                   np.maximum(amax, 1e-30) * 127.0).astype(np.int32)
    got = xq.cpu().numpy().view(np.int8).reshape(x.shape[0], -1, 8, 4).transpose(0, 1, 3, 2)
    diff = np.abs(got.reshape(xr.shape).astype(np.int32) - ref)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2


@pytest.mark.parametrize("qt", LEGACY + KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 17, 33, 300])
def test_gemv_q8_matches_reference(qt: T, n: int) -> None:
    """Against the same int8-rounded x times the fused-scale weights (checked against gguf by
    the test above): exact up to fp32 summation; against the float x and gguf's weights:
    within the rounding of x."""
    from slipstream.kernels.gemv_q8 import gemv_q8, quantize_x
    from slipstream.kernels.pack import fuse_scales

    k = _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=n)
    packed = fuse_scales(packed)
    wf = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    for m in (1, 3, 8):
        x = torch.randn(m, k, device="cuda").to(torch.float16)
        out = torch.full((m, n), float("nan"), device="cuda")  # poison: every element written
        gemv_q8(x, packed, out=out)
        qx = quantize_x(x)
        _check_codes_near_reference(x, qx[0])
        xq = _decode_q8(*qx)
        err = _rel(out, xq @ wf.T)
        assert err <= TOL[qt]["gemv_q8"], (qt.name, n, m, err)
        if n >= 17:  # a relative error over one or two dot products is too heavy-tailed to bound
            err = _rel(out, x.double().cpu().numpy() @ ref.T)
            assert err <= TOL[qt]["gemv_q8_vs_float_x"], (qt.name, n, m, err)
        r = torch.randn(m, n, device="cuda").to(torch.float16)
        yr = gemv_q8(x, packed, residual=r, out_dtype=torch.float32)
        err = _rel(yr, xq @ wf.T + r.double().cpu().numpy())
        assert err <= TOL[qt]["gemv_q8"], (qt.name, n, m, "residual", err)


@pytest.mark.parametrize("qt", LEGACY + KQUANTS, ids=lambda t: t.name)
def test_gemv_q8_config_sweep(qt: T) -> None:
    """Tiles the config may pick, with tails in N (45 rows) and in K (units not a multiple
    of NU)."""
    from slipstream.kernels.gemv_q8 import gemv_q8, quantize_x
    from slipstream.kernels.pack import fuse_scales

    k = _k_for(qt) * 3
    n = 45
    packed, _ = _setup(qt, n, k, seed=7)
    packed = fuse_scales(packed)
    wf = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    x = torch.randn(2, k, device="cuda").to(torch.bfloat16)
    yref = _decode_q8(*quantize_x(x)) @ wf.T
    for bn, nu in ((1, 4), (2, 16), (4, 64), (8, 16)):
        cfg = {"BN": bn, "NU": nu, "num_warps": 4}
        y = gemv_q8(x, packed, out_dtype=torch.float32, config=cfg)
        assert _rel(y, yref) <= TOL[qt]["gemv_q8"], (qt.name, cfg, _rel(y, yref))
        y1 = gemv_q8(x[:1], packed, out_dtype=torch.float32, config=cfg)
        assert _rel(y1, yref[:1]) <= TOL[qt]["gemv_q8"], (qt.name, cfg, "m=1")


def test_quantize_x_layout() -> None:
    """Word k of a block holds the int8 codes of elements k, k+8, k+16, k+24 (bytes 0..3);
    the metadata holds the scale's bits and the code sums of each half and of the block."""
    from slipstream.kernels.gemv_q8 import quantize_x

    x = torch.randn(3, 32 * 5, device="cuda")
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    xq, xm = quantize_x(x)
    xr = x.double().cpu().numpy().reshape(3, 5, 32)
    amax = np.abs(xr).max(axis=2)
    meta = xm.cpu().numpy()
    np.testing.assert_allclose(meta[:, :, 0].view(np.float32), amax / 127.0, rtol=1e-6)
    codes = xq.cpu().numpy().view(np.int8).reshape(3, 5, 8, 4)  # [row, block, word k, byte b]
    expect = np.round(_quantize_x_reference(x).reshape(3, 5, 32) /
                      np.maximum(amax, 1e-30)[:, :, None] * 127.0)
    np.testing.assert_array_equal(codes.transpose(0, 1, 3, 2).reshape(3, 5, 32),
                                  expect.astype(np.int8))
    halves = expect.reshape(3, 5, 2, 16).sum(axis=3)
    np.testing.assert_array_equal(meta[:, :, 1:3], halves)
    np.testing.assert_array_equal(meta[:, :, 3], halves.sum(axis=2))


def _codes(xq: torch.Tensor) -> np.ndarray:
    return xq.cpu().numpy().view(np.int8).astype(np.int32)


@pytest.mark.parametrize("k", [32 * 7, 4096, 32 * 300])  # 300 blocks: a partial last program
def test_fused_quantizers_match_separate_ops(k: int) -> None:
    """rms_norm_q8 = quantize_x(rms_norm(x)), quantize_x(glu=True) =
    quantize_x(silu(gate) * up) and with act="gelu_tanh" = quantize_x(gelu_tanh(gate) * up)
    (Gemma's GeGLU), up to ties decided differently (codes off by at most one)."""
    from slipstream.kernels.gemv_q8 import quantize_x, rms_norm_q8

    x = torch.randn(3, k, device="cuda") * 3
    w = torch.rand(k, device="cuda") + 0.5
    eps = 1e-5
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w
    gelu = torch.nn.functional.gelu(x, approximate="tanh")
    for (xq, xm), (rq, rm) in [(rms_norm_q8(x, w, eps), quantize_x(normed)),
                               (quantize_x(torch.cat([x, normed], 1), glu=True),
                                quantize_x(torch.nn.functional.silu(x) * normed)),
                               (quantize_x(torch.cat([x, normed], 1), glu=True,
                                           act="gelu_tanh"), quantize_x(gelu * normed))]:
        diff = np.abs(_codes(xq) - _codes(rq))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        np.testing.assert_allclose(xm[..., 0].cpu().numpy().view(np.float32),
                                   rm[..., 0].cpu().numpy().view(np.float32), rtol=1e-5)


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q8_0])
def test_prefill_in_row_chunks_matches_the_whole_weight(qt: T) -> None:
    """A weight larger than the capped prefill scratch (the head) is dequantized and multiplied
    in row chunks (weights.linear.Workspace); the result is the whole weight's, chunk edges
    included (300 rows in chunks of 64: four full and one of 44)."""
    from slipstream.weights.linear import QuantLinear, Workspace

    k = _k_for(qt) * 2
    packed, wf = _setup(qt, 300, k, seed=11)
    x = torch.randn(200, k, device="cuda")  # past qgemm's 128 rows: the scratch's path
    whole = QuantLinear(packed, None, Workspace(torch.device("cuda")))(x)
    capped = Workspace(torch.device("cuda"), max_elements=64 * k)
    chunked = QuantLinear(packed, None, capped)(x)
    assert capped.buffer.numel() == 64 * k
    assert _rel(chunked, whole.double().cpu().numpy()) < 1e-3
    assert _rel(chunked, x.double().cpu().numpy() @ wf.T) < 3e-3  # fp16 x and W


@pytest.mark.parametrize("qt", LEGACY + KQUANTS, ids=lambda t: t.name)
def test_unfused_f16_scales_give_the_fused_bits(qt: T) -> None:
    """Streamed layers keep the GGUF scale planes (pack.f16_scales) and the kernels round the
    scales as fuse_scales does: dequantize and gemv_q8 give bit for bit what the fused weight
    gives, so a layer computes the same in VRAM (fused) and streamed."""
    from slipstream.kernels.gemv_q8 import gemv_q8
    from slipstream.kernels.pack import f16_scales, fuse_scales

    k = _k_for(qt) * 2
    packed, _ = _setup(qt, 45, k, seed=13)
    fused, unfused = fuse_scales(packed), f16_scales(packed)
    assert unfused.sm is None and unfused.nbytes == packed.nbytes
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(kernels.dequantize(fused, dtype), kernels.dequantize(unfused, dtype))
    for m in (1, 3):
        x = torch.randn(m, k, device="cuda")
        assert torch.equal(gemv_q8(x, fused), gemv_q8(x, unfused)), (qt.name, m)


# --- the tensor-core quantized GEMM (kernels/qgemm.py), m up to 128 -----------------------------

# float16 weights and x (2^-11 relative each): ~5e-4 seen on random data
QGEMM_TOL = 2e-3
QUANTIZED = LEGACY + KQUANTS


@pytest.mark.parametrize("qt", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [17, 300])
def test_qgemm_matches_reference(qt: T, n: int) -> None:
    from slipstream.kernels.qgemm import qgemm

    k = _k_for(qt) * 2
    packed, ref = _setup(qt, n, k, seed=n + 1)
    for m in (1, 5, 9, 17, 33, 64, 100, 128):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        yref = x.double().cpu().numpy() @ ref.T
        out = torch.full((m, n), float("nan"), device="cuda")  # poison: every element written
        qgemm(x, packed, out=out)
        assert _rel(out, yref) <= QGEMM_TOL, (qt.name, n, m)
    yb = qgemm(x, packed)  # the output in x's dtype
    assert yb.dtype == torch.bfloat16 and yb.shape == (x.shape[0], n)
    assert _rel(yb, yref) <= TOL[qt]["gemv_bf16_out"], (qt.name, n)


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_qgemm_tiles(qt: T) -> None:
    """The per-slot kernel (precision "exact") at tiles a caller may pass, with tails in N and K
    (K not a whole number of steps), K split across programs and 33 rows (a block of 32 and one
    of 1): every one within the float32 bound of the reference, and a split sums in a fixed
    order."""
    from slipstream.kernels.qgemm import qgemm

    k = _k_for(qt) * 3
    n = 45
    packed, ref = _setup(qt, n, k, seed=5)
    x = torch.randn(33, k, device="cuda")
    yref = x.double().cpu().numpy() @ ref.T
    for bn, warps, nu in ((32, 4, 2), (64, 4, 8)):
        for split in (1, 3):
            cfg = {"BN": bn, "NU": nu, "SPLIT": split, "num_warps": warps}
            y = qgemm(x, packed, out_dtype=torch.float32, config=cfg, exact=True)
            assert _rel(y, yref) <= FP32_TOL, (qt.name, cfg)
            assert torch.equal(y, qgemm(x, packed, out_dtype=torch.float32, config=cfg,
                                        exact=True))


@pytest.mark.parametrize("qt", QUANTIZED, ids=lambda t: t.name)
def test_qgemm_wide_kernel_matches_reference(qt: T) -> None:
    """The wide kernel (kernels/qgemm_wide.py, one MMA per K step), precision "fast"'s: GGUF
    and fused scale planes, widths 1..128, tiles the sweep may pick with
    tails in N and K and K split across programs; the same bits on a second call."""
    from slipstream.kernels.pack import fuse_scales
    from slipstream.kernels.qgemm import qgemm

    k = _k_for(qt) * 3
    n = 45
    packed, ref = _setup(qt, n, k, seed=31)
    for weight in (packed, fuse_scales(packed)):
        for m in (1, 5, 17, 33, 100, 128):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            yref = x.double().cpu().numpy() @ ref.T
            out = torch.full((m, n), float("nan"), device="cuda")
            qgemm(x, weight, out=out)
            assert _rel(out, yref) <= QGEMM_TOL, (qt.name, m)
    x = torch.randn(33, k, device="cuda").to(torch.float16)
    yref = x.double().cpu().numpy() @ ref.T
    for bn, nu, warps in ((32, 2, 4), (64, 4, 4), (128, 8, 8), (16, 8, 4)):
        for split in (1, 3):
            cfg = {"BN": bn, "NU": nu, "SPLIT": split, "num_warps": warps}
            y = qgemm(x, packed, out_dtype=torch.float32, config=cfg)
            assert _rel(y, yref) <= QGEMM_TOL, (qt.name, cfg)
            assert torch.equal(y, qgemm(x, packed, out_dtype=torch.float32, config=cfg))


@pytest.mark.parametrize("qt", LEGACY + KQUANTS, ids=lambda t: t.name)
def test_qgemm_fused_and_unfused_scales_give_the_same_bits(qt: T) -> None:
    """precision="fast": a resident layer (fused scale plane) and a streamed one (GGUF planes,
    its fused plane made for the call by with_fused_scales) multiply the same weights, bit for
    bit, at every width: the fused plane made on the GPU is fuse_scales', and both go through
    the one kernel (two kernels, one per kind of plane, gave sums that differed in the last
    bit on an H200)."""
    from slipstream.kernels.pack import f16_scales, fuse_scales
    from slipstream.kernels.qgemm import qgemm, with_fused_scales

    k = _k_for(qt) * 2
    packed, _ = _setup(qt, 45, k, seed=17)
    fused, unfused = fuse_scales(packed), f16_scales(packed)
    if fused is packed:  # one f16 scale per 32 already: nothing to fuse
        assert unfused is packed
        return
    assert torch.equal(with_fused_scales(unfused).sm, fused.sm)
    wf = kernels.dequantize(fused, torch.float32).double().cpu().numpy()
    scratch = torch.full((1 << 20,), float("nan"), device="cuda", dtype=torch.float16)
    for m in (9, 64):
        x = torch.randn(m, k, device="cuda")
        y = qgemm(x, fused)
        assert torch.equal(y, qgemm(x, fused)), (qt.name, m, "not deterministic")
        yu = qgemm(x, unfused, scale_buffer=scratch)
        assert torch.equal(y, yu), (qt.name, m, (y - yu).abs().max().item())
        assert _rel(y, x.double().cpu().numpy() @ wf.T) <= QGEMM_TOL


# the exact kernel unrolls a [BN, 64] float32 tile per slot, 16 slots for the 2-bit formats
HEAVY = pytest.mark.compile_heavy


@pytest.mark.parametrize("qt", [pytest.param(t, marks=HEAVY) if t in (T.Q2_K, T.Q3_K) else t
                                for t in QUANTIZED], ids=lambda t: t.name)
def test_exact_qgemm_is_float32_like_the_gemv(qt: T) -> None:
    """precision="exact": qgemm's float32 variant is within the fp32 GEMV's bound of gguf's
    dequantized weights (float16 weights and x are ~100x further off), and so is an exact
    QuantLinear above qgemm's 128 rows (float weights too): a verification pass rounds like
    the decode steps it stands for."""
    from slipstream.kernels.qgemm import EXACT_MAX_M, qgemm
    from slipstream.weights.linear import QuantLinear, Workspace

    k = _k_for(qt) * 2
    packed, ref = _setup(qt, 45, k, seed=29)
    for m in (9, 64, 128):
        x = torch.randn(m, k, device="cuda")
        yref = x.double().cpu().numpy() @ ref.T
        assert _rel(qgemm(x, packed, exact=True), yref) <= FP32_TOL, (qt.name, m)
    assert _rel(qgemm(x, packed), yref) > 10 * FP32_TOL  # the float16 kernel, for scale
    # above EXACT_MAX_M rows the exact kernel runs in row blocks (its 128-row variant stalled
    # ptxas for minutes): the bits of launching each block alone
    assert m > EXACT_MAX_M
    assert torch.equal(qgemm(x, packed, exact=True),
                       torch.cat([qgemm(x[:EXACT_MAX_M], packed, exact=True),
                                  qgemm(x[EXACT_MAX_M:], packed, exact=True)]))
    exact = Workspace(torch.device("cuda"), float32_products=True)
    x = torch.randn(300, k, device="cuda")
    yref = x.double().cpu().numpy() @ ref.T
    assert _rel(QuantLinear(packed, None, exact)(x), yref) <= FP32_TOL, qt.name
    wf = torch.from_numpy(ref.astype(np.float32)).cuda()
    floats = kernels.pack_weight(wf.contiguous().view(torch.uint8), T.F32, 45, k)
    assert _rel(QuantLinear(floats, None, exact)(x), yref) <= FP32_TOL


def test_matmul_routes_small_batches_to_qgemm() -> None:
    """kernels.matmul: m <= 8 the fused GEMV, 9..128 qgemm (the same bits as calling it), more
    than 128 dequantize + cuBLAS; each within its tolerance of the reference. And a CUDA graph
    replays qgemm to the bit (draft levels run captured)."""
    from slipstream.kernels.qgemm import MAX_M, qgemm

    k = 512
    packed, ref = _setup(T.Q4_K, 70, k, seed=23)
    for m in (9, MAX_M):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert torch.equal(kernels.matmul(x, packed), qgemm(x, packed))
    x = torch.randn(MAX_M + 1, k, device="cuda").to(torch.bfloat16)
    y = kernels.matmul(x, packed, out_dtype=torch.float32)
    assert _rel(y, x.double().cpu().numpy() @ ref.T) <= TOL[T.Q4_K]["prefill"]
    x = torch.randn(40, k, device="cuda").to(torch.bfloat16)
    eager = qgemm(x, packed)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qgemm(x, packed)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = qgemm(x, packed)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
