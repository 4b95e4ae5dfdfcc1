"""The codebook formats (IQ4_NL, IQ4_XS, MXFP4) through the GPU path: pack_weight's planes, the
dequant kernel and the fused float32 GEMV, against the reference dequantizer (slipstream.quant,
itself bit-identical to gguf-py's, tests/quant/test_dequant.py) in float64.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the same checks in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from slipstream import kernels, quant  # noqa: E402
from slipstream.errors import UnsupportedTensorType  # noqa: E402
from slipstream.kernels import gemv_q8, pack  # noqa: E402

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

gemv_module = importlib.import_module("slipstream.kernels.gemv")
DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CODEBOOK = [T.IQ4_NL, T.IQ4_XS, T.MXFP4]

# The fused float32 GEMV: exact products of the float32 x, float32 sums (tests/gpu/
# test_kernels.py's bound for every format); a bfloat16 result adds its rounding (2^-9).
FP32_TOL = 2e-6
BF16_OUT_TOL = 8e-3
# matmul above 8 rows: the weights rounded to bfloat16 for cuBLAS (2^-9 relative each)
BF16_W_TOL = 1e-2


def _raw(qt: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with sane scales: f16 d in [1e-3, 1e-2] (IQ4_*; IQ4_XS's six-bit
    sub-block scales stay random), e8m0 bytes 110..130 (2^-18..2^2) for MXFP4."""
    block, size = GGML_QUANT_SIZES[qt]
    nb = n * k // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if qt == T.MXFP4:
        raw[:, 0] = rng.integers(110, 131, size=nb)
    else:
        raw[:, 0:2] = rng.uniform(1e-3, 1e-2, size=nb).astype(np.float16).view(np.uint8) \
            .reshape(nb, 2)
    return raw.reshape(n, -1)


def _setup(qt: T, n: int, k: int, seed: int):
    raw = torch.from_numpy(_raw(qt, n, k, np.random.default_rng(seed)))
    ref = quant.dequantize(raw, qt, (n, k)).double().numpy()
    return kernels.pack_weight(raw.to(DEVICE), qt, n, k), ref


def _k_for(qt: T) -> int:
    return 32 * 7 if GGML_QUANT_SIZES[qt][0] == 32 else 256 * 3


def _rel(y: torch.Tensor, ref: np.ndarray) -> float:
    y = y.double().cpu().numpy()
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("qt", CODEBOOK, ids=lambda t: t.name)
def test_dequantize_bit_exact(qt: T) -> None:
    """Dequant to float32 equals the reference exactly (every product grid * scale is exact in
    float32); to 16 bits, the reference rounded once (float16 in the interpreter, whose
    bfloat16 conversion truncates instead of rounding to nearest)."""
    n, k = 5, _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=3)
    assert pack.QSPECS[qt].grid is not None
    w32 = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    assert np.array_equal(w32, ref)
    half = torch.float16 if INTERPRET else torch.bfloat16
    w16 = kernels.dequantize(packed, half).float().cpu()
    assert torch.equal(w16, torch.from_numpy(ref).float().to(half).float())


@pytest.mark.parametrize("qt", CODEBOOK, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 17])
def test_gemv_matches_reference(qt: T, n: int) -> None:
    k = _k_for(qt)
    packed, ref = _setup(qt, n, k, seed=n)
    for m in (1, 3, 8):
        x = torch.randn(m, k).to(torch.bfloat16).to(DEVICE)
        yref = x.double().cpu().numpy() @ ref.T
        out = torch.full((m, n), float("nan"), device=DEVICE)  # poison: every element written
        kernels.gemv(x, packed, out=out)
        assert _rel(out, yref) <= FP32_TOL, (qt.name, n, m)
        ybf = kernels.gemv(x, packed)
        assert ybf.dtype == torch.bfloat16
        assert _rel(ybf, yref) <= BF16_OUT_TOL, (qt.name, n, m)


@pytest.mark.parametrize("qt", CODEBOOK, ids=lambda t: t.name)
def test_gemv_tiles(qt: T) -> None:
    """Tile shapes with tails in N and K, for both GEMV kernels (m = 1: BN x NG groups)."""
    k, n = _k_for(qt) * 2, 9
    packed, ref = _setup(qt, n, k, seed=7)
    x = torch.randn(2, k).to(torch.float16).to(DEVICE)
    yref = x.double().cpu().numpy() @ ref.T
    for cfg in [{"BN": 1, "NU": 4}, {"BN": 4, "NU": 16}]:
        y = kernels.gemv(x, packed, out_dtype=torch.float32, config=dict(cfg, num_warps=4))
        assert _rel(y, yref) <= FP32_TOL, (qt.name, cfg)
    for cfg in [{"BN": 1, "NG": 8}, {"BN": 2, "NG": 32}]:
        y = kernels.gemv(x[:1], packed, out_dtype=torch.float32, config=dict(cfg, num_warps=4))
        assert _rel(y, yref[:1]) <= FP32_TOL, (qt.name, cfg)


@pytest.mark.parametrize("qt", CODEBOOK, ids=lambda t: t.name)
def test_matmul_above_the_gemv_dequantizes(qt: T) -> None:
    """More than 8 rows: no qgemm for codebook formats (it expands integer codes), so matmul
    dequantizes and multiplies; the int8-activation GEMV refuses them too."""
    k, n, m = _k_for(qt), 6, 12
    packed, ref = _setup(qt, n, k, seed=5)
    assert not kernels.qgemm_supports(packed) and not gemv_q8.supports(packed)
    x = torch.randn(m, k).to(torch.bfloat16).to(DEVICE)
    y = kernels.matmul(x, packed)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, x.double().cpu().numpy() @ ref.T) <= BF16_W_TOL


@pytest.mark.parametrize("qt", CODEBOOK, ids=lambda t: t.name)
def test_one_block_per_row_and_row_slices(qt: T) -> None:
    k = GGML_QUANT_SIZES[qt][0]
    packed, ref = _setup(qt, 6, k, seed=9)
    w = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    assert np.array_equal(w, ref)
    part = kernels.dequantize(packed.row_slice(2, 5), torch.float32).double().cpu().numpy()
    assert np.array_equal(part, ref[2:5])


def test_a_wrong_grid_fails(monkeypatch) -> None:
    """Negative control: the kernels reading IQ4_NL's grid reversed (or MXFP4's with the sign
    bit ignored) must miss the reference by far more than the tolerance."""
    for qt, wrong in ((T.IQ4_NL, pack.IQ4NL_VALUES[::-1]),
                      (T.MXFP4, pack.MXFP4_VALUES[:8] * 2)):
        k = _k_for(qt)
        packed, ref = _setup(qt, 3, k, seed=1)
        x = torch.randn(1, k).to(DEVICE)
        yref = x.double().cpu().numpy() @ ref.T
        table = torch.tensor(wrong, dtype=torch.float32, device=DEVICE)
        with monkeypatch.context() as mp:  # the table every kernel launch passes (gemv._table)
            mp.setattr(gemv_module, "grid_table", lambda spec, device: table)
            y = kernels.gemv(x, packed, out_dtype=torch.float32)
            w = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
        assert _rel(y, yref) > 0.1
        assert not np.array_equal(w, ref)
        assert _rel(kernels.gemv(x, packed, out_dtype=torch.float32), yref) <= FP32_TOL


def test_unsupported_formats_are_named() -> None:
    with pytest.raises(UnsupportedTensorType, match="TQ2_0 has no GPU kernel"):
        kernels.pack_weight(torch.zeros(66, dtype=torch.uint8), T.TQ2_0, 1, 256)


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_quant_linear_routes_codebook_weights(precision: str) -> None:
    """A layer's QuantLinear: precision "fast" keeps the float32 GEMV for these formats (no
    int8 activations), and above the GEMV's rows "exact" multiplies float32 dequantized rows
    (float32 products) where "fast" dequantizes to float16 for cuBLAS."""
    from slipstream.weights.linear import QuantLinear, Workspace

    qt, k, n = T.IQ4_XS, 512, 40
    packed, ref = _setup(qt, n, k, seed=4)
    ws = Workspace(torch.device(DEVICE), int8_activations=precision == "fast",
                   float32_products=precision == "exact", max_elements=16 * k)
    lin = QuantLinear(packed, None, ws)
    assert lin._q8 is None and lin._max_m == kernels.MAX_M
    for m, tol in ((2, FP32_TOL), (12, FP32_TOL if precision == "exact" else BF16_W_TOL)):
        x = torch.randn(m, k).to(DEVICE)
        y = lin(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert _rel(y, x.double().cpu().numpy() @ ref.T) <= tol, (precision, m)
