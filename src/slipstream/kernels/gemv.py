"""Fused dequantize-and-GEMV: y[m, N] = x[m, K] @ W[N, K]^T for m = 1..8, W in any GGUF format.

Decode (m = 1) and speculative verification (m <= 8) are memory-bound: the whole weight is read
once per token. Each program owns BN rows and walks K in chunks of NU units of 32 elements; every
quantized byte is loaded once, with 16-byte loads along a row (see pack.py for the planes), and
nothing dequantized goes to memory.

Kernels: `_gemv_q1_kernel` (m = 1, natural-K-order tiles, x read once per step),
`_gemv_q_kernel` (m = 2..8, fp32 on CUDA cores; the tensor cores serve more rows, in
qgemm.py), `_gemv_f_kernel` (F32/F16/BF16).

Measured on an H200 (CUDA-graph timings, L2 defeated): F32/F16/BF16 weights stream at 60-100% of the
4.2 TB/s copy rate, but the quantized kernels are instruction-bound, not HBM-bound: at m = 1
Q4_K reaches ~0.8-1.1 TB/s and Q8_0 ~2.2 TB/s on the large 8B matrices. The unpacking is
designed for ~3 instructions per code (4.8 TB/s of 4-bit codes is ~9.6e12 codes/s against ~17e12
int32 and ~33e12 fp32 lane-ops/s), but what Triton emits around it costs several times that:

* Code -> float without a conversion instruction: the B-bit code q is masked straight into the top
  mantissa bits of 1.0f, giving f = 1 + q/2^B exactly (a shift and one LOP3).
* f * x is exact (bf16/fp16 x has <= 11 significant bits, f <= B+1), so summing F = sum(f*x)
  and X = sum(x) per group and taking sum(q*x) = 2^B (F - X) loses almost nothing: F and X have
  the same magnitude, so the cancellation costs ~1 bit.
* The per-group affine part (w = s*(q - OFF) - t) is applied once per group of 16/32 codes:
  y += a*F + b*X with a = s*2^B and b = -s*(2^B + OFF) - t.

Accumulators keep the per-group partial sums [M, BN, NU] and reduce across lanes only once, at
the end. Results are deterministic (no atomics, fixed reduction order).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .gemv_iq import gemv_iq, gemv_iq_routed
from .pack import FLOAT_DTYPES, PackedWeight, grid_table

MAX_M = 8  # rows of x the fused GEMV takes; matmul() dequantizes + cuBLAS above this


@triton.jit
def _bits_to(v, src: tl.constexpr, nbits: tl.constexpr, dst: tl.constexpr):
    """Bits [src, src+nbits) of int32 v moved to [dst, dst+nbits), all other bits zero."""
    mask: tl.constexpr = ((1 << nbits) - 1) << dst
    if dst >= src:
        r = (v << (dst - src)) & mask
    else:
        r = (v >> (src - dst)) & mask
    return r


@triton.jit
def _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT, s, SPU: tl.constexpr,
                     KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr):
    """(scale, tmin), [BN, NU] fp32, of sub-group s of each unit uu: w = scale*(q - OFF) - tmin
    (tmin is 0.0 when the format has no min)."""
    tmin = 0.0
    if KQUANT:
        # super-block of 256 = 8 units: d/dmin gathered per unit (repeated addresses, L1 hits)
        sup = r2 * (NUT // 8) + uu // 8
        d = tl.load(d_ptr + sup, mask=umask2, other=0.0).to(tl.float32)
        scv = tl.load(sc_ptr + r2 * (NUT * SPU) + uu * SPU + s, mask=umask2, other=0)
        if PACKED_SCMN:
            sci = scv.to(tl.int32) & 0xFF
            scale = d * (sci & 15).to(tl.float32)
            if HAS_MIN:
                dmin = tl.load(m_ptr + sup, mask=umask2, other=0.0).to(tl.float32)
                tmin = dmin * (sci >> 4).to(tl.float32)
        else:
            scale = d * scv.to(tl.float32)
            if HAS_MIN:
                dmin = tl.load(m_ptr + sup, mask=umask2, other=0.0).to(tl.float32)
                mnv = tl.load(mn_ptr + r2 * (NUT * SPU) + uu * SPU + s, mask=umask2, other=0)
                tmin = dmin * mnv.to(tl.float32)
    else:
        scale = tl.load(d_ptr + r2 * NUT + uu, mask=umask2, other=0.0).to(tl.float32)
        if HAS_MIN:
            tmin = -tl.load(m_ptr + r2 * NUT + uu, mask=umask2, other=0.0).to(tl.float32)
    return scale, tmin


@triton.jit
def _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uu, umask2, NUT, s, SPU: tl.constexpr,
               P: tl.constexpr, KQUANT: tl.constexpr, HAS_MIN: tl.constexpr,
               PACKED_SCMN: tl.constexpr, SM: tl.constexpr, F16_SCALES: tl.constexpr):
    """_group_scale_min from whichever planes the weight has: the fused f16 plane (SM,
    pack.fuse_scales: P entries per unit), the GGUF planes rounded to f16 as fusing rounds them
    (F16_SCALES, pack.f16_scales), or the GGUF planes as they are."""
    if SM:
        smp = sm_ptr + (r2 * NUT + uu) * P + s
        scale = tl.load(smp, mask=umask2, other=0.0).to(tl.float32)
        tmin = 0.0
        if HAS_MIN:
            tmin = tl.load(smp + SPU, mask=umask2, other=0.0).to(tl.float32)
    else:
        scale, tmin = _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT, s,
                                       SPU, KQUANT, HAS_MIN, PACKED_SCMN)
        if F16_SCALES:
            scale = scale.to(tl.float16).to(tl.float32)
            if HAS_MIN:
                tmin = tmin.to(tl.float16).to(tl.float32)
    return scale, tmin


@triton.jit
def _group_affine(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT,
                  s, SPU: tl.constexpr, B: tl.constexpr, OFF: tl.constexpr,
                  KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr):
    """(a, b) of sub-group s of each unit, [BN, NU] fp32: contribution = a*F + b*X (see top)."""
    scale, tmin = _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT, s, SPU,
                                   KQUANT, HAS_MIN, PACKED_SCMN)
    a = scale * (1 << B)
    b = -scale * ((1 << B) + OFF) - tmin
    return a, b


@triton.jit
def _gemv_q_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, cb_ptr, y_ptr,
                   M, N, NUT, stride_xm, stride_ym,
                   LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                   KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                   CB: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr):
    """CB (codebook formats, no hi plane nor min): f = grid[q] from the float32 table at
    cb_ptr instead of the mantissa trick, and each group adds scale * sum(f * x)."""
    NJ: tl.constexpr = 32 // LO  # slots per word
    SPU: tl.constexpr = 32 // G  # scale groups per 32-unit
    JPS: tl.constexpr = NJ // SPU  # slots per scale group
    B: tl.constexpr = LO + HI  # bits per code
    MANT: tl.constexpr = 23 - B  # code lands in mantissa bits [MANT, 23)
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    offs_m = tl.arange(0, M_PAD)
    offs_u = tl.arange(0, NU)
    offs_w = tl.arange(0, LO)
    r3 = rows[:, None, None]  # [BN, 1, 1]
    w3 = offs_w[None, None, :]  # [1, 1, LO]
    r2 = rows[:, None]  # [BN, 1]
    xm = offs_m[:, None, None] * stride_xm  # [M_PAD, 1, 1]
    xmask_m = (offs_m < M)[:, None, None]
    acc = tl.zeros([M_PAD, BN, NU], dtype=tl.float32)
    for u0 in range(0, NUT, NU):
        uu3 = u0 + offs_u[None, :, None]  # [1, NU, 1]
        umask3 = uu3 < NUT
        qmask = rmask[:, None, None] & umask3
        qoff = r3 * (NUT * LO) + uu3 * LO + w3  # [BN, NU, LO]
        words = tl.load(lo_ptr + qoff, mask=qmask, other=0)
        if HI > 0:
            hw = tl.load(hi_ptr + qoff, mask=qmask, other=0).to(tl.int32)
        xbase = x_ptr + xm + uu3 * 32 + w3  # [M_PAD, NU, LO]
        xmask = xmask_m & umask3
        uu2 = u0 + offs_u[None, :]  # [1, NU]
        umask2 = rmask[:, None] & (uu2 < NUT)
        for s in tl.static_range(SPU):
            F = tl.zeros([M_PAD, BN, NU, LO], dtype=tl.float32)
            X = tl.zeros([M_PAD, NU, LO], dtype=tl.float32)
            for jj in tl.static_range(JPS):
                j = s * JPS + jj
                if CB:
                    f = tl.load(cb_ptr + ((words >> (j * LO)) & ((1 << LO) - 1)))
                else:
                    bits = _bits_to(words, j * LO, LO, MANT) | 0x3F800000
                    if HI > 0:
                        bits = bits | _bits_to(hw, j * HI, HI, MANT + LO)
                    f = bits.to(tl.float32, bitcast=True)  # 1 + q / 2^B, exact
                xj = tl.load(xbase + j * LO, mask=xmask, other=0.0).to(tl.float32)
                F += f[None, :, :, :] * xj[:, None, :, :]
                X += xj
            Fs = tl.sum(F, axis=3)  # [M_PAD, BN, NU]
            if CB:
                scale, _ = _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu2, umask2, NUT,
                                            s, SPU, KQUANT, False, False)
                acc += scale[None, :, :] * Fs
            else:
                a, b = _group_affine(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu2, umask2, NUT,
                                     s, SPU, B, OFF, KQUANT, HAS_MIN, PACKED_SCMN)
                Xs = tl.sum(X, axis=2)  # [M_PAD, NU]
                acc += a[None, :, :] * Fs + b[None, :, :] * Xs[:, None, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BN]
    ymask = (offs_m < M)[:, None] & rmask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :],
             y.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _gemv_q1_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, cb_ptr, y_ptr,
                    N, NUT, ids_ptr, X_DIV, stride_xp, stride_yp,
                    LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr,
                    OFF: tl.constexpr, KQUANT: tl.constexpr, HAS_MIN: tl.constexpr,
                    PACKED_SCMN: tl.constexpr, CB: tl.constexpr, BN: tl.constexpr,
                    NG: tl.constexpr, ROUTED: tl.constexpr = False):
    """m = 1 variant: tiles are [BN, NG scale groups, JPS slots, LO lanes] in natural K order, so
    x is read once per step as contiguous 16-byte vectors and all slots unpack in one broadcast
    shift (a G = 16 format loads each code word twice, from L1). ROUTED: one routed expert per
    program_id(1) (gemv_routed)."""
    SPU: tl.constexpr = 32 // G
    JPS: tl.constexpr = 32 // LO // SPU
    B: tl.constexpr = LO + HI
    MANT: tl.constexpr = 23 - B
    NGT = NUT * SPU  # scale groups per row
    row0 = 0  # the weight's first plane row (a constant unless routed)
    if ROUTED:  # see gemv_routed
        p = tl.program_id(1)
        row0 = tl.load(ids_ptr + p).to(tl.int64) * N
        x_ptr += (p // X_DIV) * stride_xp
        y_ptr += p * stride_yp
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    wrows = row0 + rows  # the rows' planes (an expert's, in a routed launch)
    offs_g = tl.arange(0, NG)
    jj4 = tl.arange(0, JPS)[None, None, :, None]
    w4 = tl.arange(0, LO)[None, None, None, :]
    r4 = wrows[:, None, None, None]
    r2 = wrows[:, None]
    acc = tl.zeros([BN, NG], dtype=tl.float32)
    for g0 in range(0, NGT, NG):
        gg = g0 + offs_g
        g4 = gg[None, :, None, None]
        gmask4 = g4 < NGT
        qmask = rmask[:, None, None, None] & gmask4
        woff = r4 * (NUT * LO) + (g4 // SPU) * LO + w4  # [BN, NG, 1, LO]
        words = tl.load(lo_ptr + woff, mask=qmask, other=0)
        slot = (g4 % SPU) * JPS + jj4  # [1, NG, JPS, 1]
        if CB:  # the grid value of each code (see _gemv_q_kernel)
            f = tl.load(cb_ptr + ((words >> (slot * LO)) & ((1 << LO) - 1)))
        else:
            bits = (((words >> (slot * LO)) & ((1 << LO) - 1)) << MANT) | 0x3F800000
            if HI > 0:
                hw = tl.load(hi_ptr + woff, mask=qmask, other=0).to(tl.int32)
                bits = bits | (((hw >> (slot * HI)) & ((1 << HI) - 1)) << (MANT + LO))
            f = bits.to(tl.float32, bitcast=True)  # [BN, NG, JPS, LO], 1 + q / 2^B
        x = tl.load(x_ptr + g4 * G + jj4 * LO + w4, mask=gmask4, other=0.0).to(tl.float32)
        F = tl.sum(tl.sum(f * x, axis=3), axis=2)  # [BN, NG]
        X = tl.sum(tl.sum(x, axis=3), axis=2)  # [1, NG]
        g2 = gg[None, :]
        gmask2 = rmask[:, None] & (g2 < NGT)
        # a group g is sub-group g % SPU of unit g // SPU
        if CB:
            scale, _ = _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, g2 // SPU, gmask2,
                                        NUT, g2 % SPU, SPU, KQUANT, False, False)
            acc += scale * F
        else:
            a, b = _group_affine(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, g2 // SPU, gmask2, NUT,
                                 g2 % SPU, SPU, B, OFF, KQUANT, HAS_MIN, PACKED_SCMN)
            acc += a * F + b * X
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _gemv_f_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   ids_ptr, X_DIV, stride_xp, stride_yp,
                   M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   ROUTED: tl.constexpr = False):
    """Plain GEMV for F32/F16/BF16 weights (fp32 accumulation, one reduction at the end).
    ROUTED: one routed expert per program_id(1) (gemv_routed), M = 1."""
    pid = tl.program_id(0)
    row0 = 0
    if ROUTED:  # see gemv_routed
        p = tl.program_id(1)
        row0 = tl.load(ids_ptr + p).to(tl.int64) * N
        x_ptr += (p // X_DIV) * stride_xp
        y_ptr += p * stride_yp
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    wrows = row0 + rows
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([M_PAD, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        kmask = kk < K
        w = tl.load(w_ptr + wrows[:, None] * stride_wn + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m < M)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & rmask[None, :])


def _table(packed: PackedWeight) -> torch.Tensor:
    """The cb_ptr argument: the format's grid table, or any tensor for formats without one
    (the kernels read it only under CB)."""
    table = grid_table(packed.spec, packed.device)
    return packed.lo if table is None else table


def _m_pad(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """Tile sizes for one launch.

    From tile sweeps on an H200 (CUDA-graph timings, L2 defeated):
    m = 1: NG = 128 scale groups per K-step and 4 warps won for every swept format and shape;
    BN = 4 rows for 32-group formats without a hi plane (Q4_0/Q4_K/Q8_0: e.g. Q4_K 14336x4096
    1071 GB/s vs 307 GB/s at BN=8, NG=16), BN = 1 for Q5_K/Q6_K/Q3_K and for N too small to give
    ~4 programs per SM (Q4_K 1024x4096: BN=1).
    m > 1: 16 rows per program where N allows (the m-fold FMA work is the limit there: Q4_K m=8
    peaked at BN=16, NU=8..16, ~300 GB/s).
    """
    n, k = packed.rows, packed.cols
    mp = _m_pad(m)
    sms = _sm_count(packed.device)
    if packed.qtype in FLOAT_DTYPES:
        bn = 16
        while bn > 1 and -(-n // bn) < 4 * sms:
            bn //= 2
        esize = packed.lo.element_size()
        bk = max(64, min(1024, (8192 // esize) // bn))
        bk = min(bk, max(64, triton.next_power_of_2(k)))
        while mp * bn * bk > 8192 and bk > 64:
            bk //= 2
        return {"BN": bn, "BK": bk, "num_warps": 4}
    spec = packed.spec
    if m == 1:
        bn = 4 if (spec.hi == 0 and spec.group == 32) else 1
        while bn > 1 and -(-n // bn) < 4 * sms:
            bn //= 2
        ng = min(128, max(8, triton.next_power_of_2(k // spec.group)))
        return {"BN": bn, "NG": ng, "num_warps": 4}
    bn = 16
    while bn > 2 and -(-n // bn) < 2 * sms:
        bn //= 2
    nu = 8 if mp == 8 else 16
    nu = min(nu, max(4, triton.next_power_of_2(k // 32)))
    return {"BN": bn, "NU": nu, "num_warps": 4}


def gemv(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: dict[str, int] | None = None
         ) -> torch.Tensor:
    """y = x @ W^T for x (m, K) with m <= 8 (bf16, fp16 or fp32) -> (m, N) in out_dtype
    (default x's dtype), fp32 accumulation. `config` overrides gemv_config (for tuning)."""
    if x.dim() != 2 or x.shape[1] != packed.cols:
        raise ValueError(f"x must be (m, {packed.cols}), got {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv takes 1..{MAX_M} rows of x, got {m}; use matmul()")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = packed.rows
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if packed.spec is not None and packed.spec.iq:  # the grid formats' own kernel and tiles
        return gemv_iq(x, packed, out, config)
    cfg = dict(config or gemv_config(packed, m))
    warps = cfg.pop("num_warps", 4)
    grid = (triton.cdiv(n, cfg["BN"]),)
    if packed.qtype in FLOAT_DTYPES:
        w = packed.lo
        _gemv_f_kernel[grid](x, w, out, m, n, packed.cols, x.stride(0), w.stride(0),
                             out.stride(0), w, 1, 0, 0, M_PAD=_m_pad(m), num_warps=warps,
                             **cfg)
        return out
    spec = packed.spec
    dummy = packed.lo
    if m == 1 and "NG" in cfg:
        _gemv_q1_kernel[grid](
            x, packed.lo, packed.hi if packed.hi is not None else dummy, packed.d,
            packed.m if packed.m is not None else dummy,
            packed.sc if packed.sc is not None else dummy,
            packed.mn if packed.mn is not None else dummy, _table(packed), out, n,
            packed.cols // 32, dummy, 1, 0, 0, LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off,
            KQUANT=spec.kquant, HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn,
            CB=spec.grid is not None, num_warps=warps, **cfg)
        return out
    _gemv_q_kernel[grid](
        x, packed.lo, packed.hi if packed.hi is not None else dummy, packed.d,
        packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy, _table(packed), out,
        m, n, packed.cols // 32, x.stride(0), out.stride(0),
        LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off, KQUANT=spec.kquant,
        HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn, CB=spec.grid is not None,
        M_PAD=_m_pad(m), num_warps=warps, **cfg)
    return out


def expert_rows(packed: PackedWeight, n_experts: int) -> int:
    """Rows of one expert in a weight stacking `n_experts` experts' (rows, K) weights."""
    if n_experts <= 0 or packed.rows % n_experts:
        raise ValueError(f"a weight of {packed.rows} rows does not stack {n_experts} experts")
    return packed.rows // n_experts


def check_routed(x_rows: int, ids: torch.Tensor, x_div: int) -> None:
    """The arguments of a routed GEMV: ids (P,) int32/int64 and P / x_div rows of x."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert ids must be a 1-D integer tensor, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    if x_div < 1 or ids.shape[0] % x_div or x_rows != ids.shape[0] // x_div:
        raise ValueError(f"{ids.shape[0]} routed pairs over x_div={x_div} need "
                         f"{ids.shape[0] // max(x_div, 1)} rows of x, got {x_rows}")


def gemv_routed(x: torch.Tensor, packed: PackedWeight, ids: torch.Tensor, n_experts: int,
                x_div: int = 1, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[p] = x[p // x_div] @ W_{ids[p]}^T for each routed pair p: `packed` stacks n_experts
    experts' (N, K) weights as one (n_experts * N, K) weight, and ids (P,) are read by the
    kernel on the device (no host sync, so a CUDA graph holds it). One launch over (output
    blocks, P): program (b, p) reads expert e = ids[p], whose rows start at plane row e * N,
    and x row p // x_div (x_div = top_k: a token's slots share its input; 1: each pair its
    own), and writes y row p; otherwise gemv's m = 1 kernels as they are (fp32 accumulation).
    x (P / x_div, K); returns (P, N) in out_dtype (default x's dtype)."""
    n = expert_rows(packed, n_experts)
    if x.dim() != 2 or x.shape[1] != packed.cols:
        raise ValueError(f"x must be (m, {packed.cols}), got {tuple(x.shape)}")
    check_routed(x.shape[0], ids, x_div)
    if x.stride(1) != 1:
        x = x.contiguous()
    p = ids.shape[0]
    if out is None:
        out = torch.empty(p, n, device=x.device, dtype=out_dtype or x.dtype)
    if packed.spec is not None and packed.spec.iq:
        return gemv_iq_routed(x, packed, ids, n, x_div, out)
    # tiles as for one weight of every pair's rows (n * P): the grid holds P experts' blocks,
    # so BN need not shrink to give each SM enough programs (gemv_config)
    cfg = dict(gemv_config(replace(packed, rows=n * p), 1))
    warps = cfg.pop("num_warps", 4)
    grid = (triton.cdiv(n, cfg["BN"]), p)
    if packed.qtype in FLOAT_DTYPES:
        w = packed.lo
        _gemv_f_kernel[grid](x, w, out, 1, n, packed.cols, x.stride(0), w.stride(0),
                             out.stride(0), ids, x_div, x.stride(0), out.stride(0), M_PAD=1,
                             ROUTED=True, num_warps=warps, **cfg)
        return out
    spec = packed.spec
    dummy = packed.lo
    _gemv_q1_kernel[grid](
        x, packed.lo, packed.hi if packed.hi is not None else dummy, packed.d,
        packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy, _table(packed), out, n,
        packed.cols // 32, ids, x_div, x.stride(0), out.stride(0), LO=spec.lo, HI=spec.hi,
        G=spec.group, OFF=spec.off, KQUANT=spec.kquant, HAS_MIN=spec.has_min,
        PACKED_SCMN=spec.packed_scmn, CB=spec.grid is not None, ROUTED=True,
        num_warps=warps, **cfg)
    return out
