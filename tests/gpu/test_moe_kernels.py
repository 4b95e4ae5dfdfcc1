"""The routed GEMVs of a mixture of experts (kernels.gemv.gemv_routed, kernels.gemv_q8.
gemv_q8_routed): every expert's weight stacked in one packed weight, the expert of each
(token, slot) pair read from a device tensor. Checked against gguf-py's dequantize of each
expert's bytes in float64, for every format the dense GEMV takes, expert ids with repeats and
k = 1..8; and bit for bit against the dense GEMV run on each pair's expert alone (the same
code, the rows found through the ids).

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the same checks in Triton's interpreter.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from slipstream import kernels  # noqa: E402
from slipstream.kernels import gemv_q8, pack  # noqa: E402
from slipstream.kernels.gemv import gemv_routed  # noqa: E402

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda")
FLOATS = [T.F32, T.F16, T.BF16]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
CODEBOOK = [T.IQ4_NL, T.IQ4_XS, T.MXFP4]
ALL = FLOATS + LEGACY + KQUANTS + CODEBOOK
N_EXPERTS = 5
ROWS = 9  # per expert: a tail for every BN

# tests/gpu/test_kernels.py's bounds: the float32 GEMV is exact up to summation order; the
# int8-activation one carries x's rounding to 8 bits per block of 32
FP32_TOL = 2e-6
Q8_VS_FLOAT_X_TOL = 1.5e-2


def _k_for(qt: T) -> int:
    return 64 if GGML_QUANT_SIZES[qt][0] == 32 or qt in FLOATS else 256


def _raw(qt: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) GGUF bytes: gguf-py's quantize of Gaussian data where it quantizes the
    format, else random blocks with small finite scales."""
    data = rng.standard_normal((n, k)).astype(np.float32)
    if qt == T.F32:
        return data.view(np.uint8).reshape(n, -1)
    if qt in FLOATS or qt in LEGACY or qt == T.IQ4_NL:
        try:
            return np.ascontiguousarray(gguf.quants.quantize(data, qt)).view(np.uint8) \
                .reshape(n, -1)
        except NotImplementedError:
            pass
    block, size = GGML_QUANT_SIZES[qt]
    nb = n * k // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if qt == T.MXFP4:
        raw[:, 0] = rng.integers(120, 131, size=nb)
    else:
        fields = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                  T.Q6_K: (208,)}.get(qt, (0,))
        for off in fields:
            raw[:, off:off + 2] = rng.uniform(1e-3, 1e-2, size=nb).astype(np.float16) \
                .view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)


def _experts(qt: T, seed: int):
    """The stacked packed weight (N_EXPERTS * ROWS, K) and each expert's reference (ROWS, K)
    from gguf-py's dequantize of its own bytes."""
    k = _k_for(qt)
    raw = _raw(qt, N_EXPERTS * ROWS, k, np.random.default_rng(seed))
    refs = [gguf.quants.dequantize(raw[e * ROWS:(e + 1) * ROWS], qt).reshape(ROWS, k)
            .astype(np.float64) for e in range(N_EXPERTS)]
    packed = kernels.pack_weight(torch.from_numpy(raw).to(DEVICE), qt, N_EXPERTS * ROWS, k)
    return packed, refs, k


def _ids(k: int, tokens: int, seed: int) -> torch.Tensor:
    """(tokens * k,) expert ids with repeats across tokens and within a token's slots."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_EXPERTS, (tokens * k,), generator=g)


def _rel(y: torch.Tensor, ref: np.ndarray) -> float:
    y = y.double().cpu().numpy()
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_gemv_routed_matches_reference(qt: T) -> None:
    """Shared input (x_div = k: a token's gate/up) and one input per pair (x_div = 1: the down
    projection), k = 1..8 over 1 or 2 tokens: every pair's row is its expert's product, and
    equals the dense GEMV on that expert's rows alone bit for bit."""
    packed, refs, kk = _experts(qt, seed=int(qt))
    for k, tokens in [(1, 1), (2, 2), (5, 1), (8, 1)]:
        ids = _ids(k, tokens, seed=k)
        for x_div, x_rows in [(k, tokens), (1, tokens * k)]:
            x = torch.randn(x_rows, kk).to(torch.float16)
            xs = x.double().numpy()
            ref = np.stack([xs[p // x_div] @ refs[int(e)].T for p, e in enumerate(ids)])
            out = torch.full((ids.shape[0], ROWS), float("nan"), device=DEVICE)
            y = gemv_routed(x.to(DEVICE), packed, ids.to(DEVICE), N_EXPERTS, x_div, out=out)
            assert _rel(y, ref) <= FP32_TOL, (qt.name, k, x_div)
            # the routed launch's tiles (gemv_routed sizes them for every pair's rows)
            tiles = kernels.gemv_config(replace(packed, rows=ROWS * ids.shape[0]), 1)
            for p, e in enumerate(ids.tolist()):
                one = packed.row_slice(e * ROWS, (e + 1) * ROWS)
                dense = kernels.gemv(x[p // x_div:p // x_div + 1].to(DEVICE), one,
                                     out_dtype=torch.float32, config=tiles)
                assert torch.equal(y[p:p + 1].cpu(), dense.cpu()), (qt.name, k, x_div, p)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_top_k(k: int) -> None:
    """k = 1..8 slots of one token (Mixtral's 2, gpt-oss's 4, Qwen3-MoE's 8), ids drawn with
    repeats, in both GEMVs (Q4_K: the float32 one at "exact", the int8 one at "fast")."""
    packed, refs, kk = _experts(T.Q4_K, seed=50 + k)
    ids = _ids(k, 1, seed=20 + k).to(DEVICE)
    x = torch.randn(1, kk).to(DEVICE)
    xs = x.double().cpu().numpy()
    ref = np.stack([xs[0] @ refs[int(e)].T for e in ids.tolist()])
    y = gemv_routed(x, packed, ids, N_EXPERTS, x_div=k, out_dtype=torch.float32)
    assert _rel(y, ref) <= FP32_TOL, k
    yq = gemv_q8.gemv_q8_routed(*gemv_q8.quantize_x(x), pack.fuse_scales(packed), ids,
                                N_EXPERTS, x_div=k)
    assert _rel(yq, ref) <= Q8_VS_FLOAT_X_TOL, k


INT_CODES = LEGACY + KQUANTS


@pytest.mark.parametrize("qt", INT_CODES, ids=lambda t: t.name)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "f16_scales"])
def test_gemv_q8_routed_matches_reference(qt: T, fused: bool) -> None:
    """The int8-activation routed GEMV (precision "fast"), on the stacked weight with its
    scales fused once (resident layers) or kept in the GGUF layout: equal to the dense
    gemv_q8 on each pair's expert bit for bit, and to the float64 reference within x's
    rounding to int8."""
    packed, refs, kk = _experts(qt, seed=100 + int(qt))
    packed = pack.fuse_scales(packed) if fused else pack.f16_scales(packed)
    for k, tokens in [(1, 1), (3, 2), (8, 1)]:
        ids = _ids(k, tokens, seed=10 + k)
        for x_div, x_rows in [(k, tokens), (1, tokens * k)]:
            x = torch.randn(x_rows, kk).to(DEVICE)
            xq, xm = gemv_q8.quantize_x(x)
            y = gemv_q8.gemv_q8_routed(xq, xm, packed, ids.to(DEVICE), N_EXPERTS, x_div)
            xs = x.double().cpu().numpy()
            ref = np.stack([xs[p // x_div] @ refs[int(e)].T for p, e in enumerate(ids)])
            assert _rel(y, ref) <= Q8_VS_FLOAT_X_TOL, (qt.name, k, x_div)
            for p, e in enumerate(ids.tolist()):
                one = packed.row_slice(e * ROWS, (e + 1) * ROWS)
                r = p // x_div
                dense = gemv_q8.gemv_q8_quantized(xq[r:r + 1], xm[r:r + 1], one)
                assert torch.equal(y[p:p + 1].cpu(), dense.cpu()), (qt.name, k, x_div, p)


def test_routed_arguments_are_checked() -> None:
    packed, _, kk = _experts(T.Q8_0, seed=1)
    x = torch.randn(1, kk, device=DEVICE)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="does not stack 4 experts"):
        gemv_routed(x, packed, ids, 4, x_div=2)
    with pytest.raises(ValueError, match="need 2 rows of x, got 1"):
        gemv_routed(x, packed, ids, N_EXPERTS, x_div=1)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        gemv_routed(x, packed, ids.float(), N_EXPERTS, x_div=2)
