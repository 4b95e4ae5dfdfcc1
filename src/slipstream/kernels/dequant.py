"""Dequantize a packed weight to bf16/fp16/fp32, and `matmul`, which dispatches by the number of rows.

Prefill (m > 8) is compute-bound at m in the hundreds, so the weight is expanded once into a
scratch (N, K) bf16 buffer and multiplied by cuBLAS on the tensor cores. For m <= 8 the fused GEMV
in gemv.py reads only the quantized bytes. Measured on an H200 at m = 512 (Q4_K 14336x4096):
dequant 205 us + cuBLAS 115 us = 312 us, 193 TFLOP/s; 70B 28672x8192: 686 + 337 us, 238 TFLOP/s.
The dequant kernel runs at only ~0.7 TB/s (strided 8-byte stores per slot), so it is 2/3 of the
prefill time. Dispatch: m <= 8 -> GEMV, m <= QGEMM_MAX_M (128) -> qgemm.py's fused
dequant-in-GEMM (a draft's tree levels and small verification trees), else dequant + cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import MAX_M, _scale_min, _table, gemv
from .gemv_iq import dequantize_iq
from .pack import FLOAT_DTYPES, PackedWeight
from .qgemm import MAX_M as QGEMM_MAX_M, qgemm, supports as qgemm_supports
from .qgemm import MIN_M as QGEMM_MIN_M  # noqa: F401 (kernels.QGEMM_MIN_M)


@triton.jit
def _dequant_q_kernel(lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, cb_ptr, out_ptr, N,
                      NUT, stride_on, LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr,
                      OFF: tl.constexpr, KQUANT: tl.constexpr, HAS_MIN: tl.constexpr,
                      PACKED_SCMN: tl.constexpr, SM: tl.constexpr, F16_SCALES: tl.constexpr,
                      CB: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr):
    """out[n, k] = s_g * (q - OFF) - t_g in fp32, rounded once to out's dtype. SM: s_g and t_g
    from the fused f16 plane (pack.fuse_scales); F16_SCALES: from the GGUF planes, rounded to
    f16 the same way (PackedWeight.f16_scales), so both give the same bits. CB (codebook
    formats): s_g * grid[q], the grid gathered from the 16-entry float32 table at cb_ptr."""
    NJ: tl.constexpr = 32 // LO
    SPU: tl.constexpr = 32 // G
    JPS: tl.constexpr = NJ // SPU
    P: tl.constexpr = SPU * (2 if HAS_MIN else 1)  # fused-scale entries per unit
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    uu = tl.program_id(1) * NU + tl.arange(0, NU)
    offs_w = tl.arange(0, LO)
    r3 = rows[:, None, None]
    u3 = uu[None, :, None]
    w3 = offs_w[None, None, :]
    qmask = (r3 < N) & (u3 < NUT)
    qoff = r3 * (NUT * LO) + u3 * LO + w3  # [BN, NU, LO]
    words = tl.load(lo_ptr + qoff, mask=qmask, other=0)
    if HI > 0:
        hw = tl.load(hi_ptr + qoff, mask=qmask, other=0).to(tl.int32)
    r2 = rows[:, None]
    u2 = uu[None, :]
    m2 = (r2 < N) & (u2 < NUT)
    obase = out_ptr + r3 * stride_on + u3 * 32 + w3
    for s in tl.static_range(SPU):
        scale, tmin = _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, u2, m2, NUT, s, SPU,
                                 P, KQUANT, HAS_MIN, PACKED_SCMN, SM, F16_SCALES)
        scale3 = scale[:, :, None]
        if HAS_MIN:
            tmin3 = tmin[:, :, None]
        for jj in tl.static_range(JPS):
            j = s * JPS + jj
            q = (words >> (j * LO)) & ((1 << LO) - 1)
            if HI > 0:
                q = q | (((hw >> (j * HI)) & ((1 << HI) - 1)) << LO)
            if CB:
                w = tl.load(cb_ptr + q) * scale3
            else:
                w = (q - OFF).to(tl.float32) * scale3
            if HAS_MIN:
                w = w - tmin3
            tl.store(obase + j * LO, w.to(out_ptr.dtype.element_ty), mask=qmask)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole weight as a dense (N, K) tensor of `dtype` (into `out` if given, e.g. a scratch
    buffer reused across layers)."""
    n, k = packed.rows, packed.cols
    if out is None:
        out = torch.empty(n, k, device=packed.device, dtype=dtype)
    elif out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be ({n}, {k}) with unit column stride, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if packed.qtype in FLOAT_DTYPES:
        out.copy_(packed.lo)
        return out
    spec = packed.spec
    if spec.iq:
        return dequantize_iq(packed, out)
    nut = k // 32
    bn, nu = 8, 16
    dummy = packed.lo
    grid = (triton.cdiv(n, bn), triton.cdiv(nut, nu))
    _dequant_q_kernel[grid](
        packed.lo, packed.hi if packed.hi is not None else dummy,
        packed.d if packed.d is not None else dummy,
        packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy,
        packed.sm if packed.sm is not None else dummy, _table(packed), out, n, nut,
        out.stride(0), LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off, KQUANT=spec.kquant,
        HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn, SM=packed.sm is not None,
        F16_SCALES=packed.f16_scales and packed.sm is None, CB=spec.grid is not None, BN=bn,
        NU=nu, num_warps=4)
    return out


def matmul(x: torch.Tensor, packed: PackedWeight, out_dtype: torch.dtype | None = None,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T. Rows m = prod(x.shape[:-1]): the exact fused GEMV for
    m <= 8 (float32 products of the file's weights: precision "exact" keeps them for tree
    passes of up to 8 nodes, at the cost of qgemm's there), the tensor-core quantized GEMM
    (qgemm.py) up to QGEMM_MAX_M, otherwise dequantize (into `scratch` if given) + cuBLAS.
    The int8-activation GEMV (precision "fast", weights.linear.QuantLinear) hands over to
    qgemm from QGEMM_MIN_M rows instead. Output dtype: out_dtype or x's dtype."""
    if x.shape[-1] != packed.cols:
        raise ValueError(f"x's last dim must be {packed.cols}, got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.cols)
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    if m <= MAX_M:
        y = gemv(x2, packed, out_dtype=out_dtype)
    elif m <= QGEMM_MAX_M and qgemm_supports(packed):
        y = qgemm(x2, packed, out_dtype=out_dtype)
    else:
        # bf16 tensor-core matmul; fp16 activations stay fp16 (same speed, more mantissa)
        cdtype = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
        if packed.qtype in FLOAT_DTYPES and packed.lo.dtype == cdtype:
            w = packed.lo
        else:
            w = dequantize(packed, cdtype, out=scratch)
        y = torch.matmul(x2.to(cdtype), w.t())
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
    return y.reshape(*lead, packed.rows)
