"""Small-m quantized GEMM, one wide MMA per K step: y[m, N] = x[m, K] @ W[N, K]^T, m <= 128.
precision "fast" multiplies 5 to 128 rows through this kernel (qgemm.qgemm dispatches).

Why not qgemm.py's per-slot kernel in float16: it multiplies each of a word's 32/LO slots
separately, eight [BN, 32] x [32, m] products per step for a 4-bit format, and on an H200 it
read the 8B's gate_up (28672x4096 Q4_K) at ~0.5 TB/s, a seventh of HBM, so a draft's tree level
cost 16-25 ms where a captured decode step costs 2.6. Here a program unpacks all the codes of NU
units (NU*32 columns of K) into one [BN, NU*32] float16 tile and makes one [BN, NU*32] x
[NU*32, m] product of it per step, so the tensor cores see K = 64..256 at once and the unpacking
is a few shifts on a 5-D view of the words. On the H200: gate_up at 8 rows in 99 us against
144, the Q6_K head in 442 against 947, a draft level of 8 / 32 / 128 nodes in 10.7 / 11.0 /
15.7 ms against 17.2 / 16.6 / 24.5; still 0.10-0.16 of HBM, the scales' and codes' unpacking
being most of a step.

The tile's K order is the plane layout's (pack.py): column c of a step = unit c // 32, lane
w = (c % 32) // NJ, slot j = c % NJ holds element unit*32 + j*LO + w. wide_order() permutes x
into that order once per call, padded to M_PAD rows, so every load of x is one aligned
[NU*32, M_PAD] block.

Numbers: by default (F16MATH) a code q goes into the mantissa of 1024.0h, q - OFF comes out
of one exact float16 subtraction, and w = (q - OFF) * scale - min is one float16 FMA: one
rounding, as when float32 arithmetic is rounded to float16 at the end, and no conversions.
F16MATH=False expands as gemv.py does (the code in 1.0f's mantissa, a float32 FMA, then a
conversion): 0-8% slower on the H200. x is rounded to float16 (GGUF scales are float16, so
float16 keeps 3 more mantissa bits than bfloat16), sums are float32: dequantize + cuBLAS up to
summation order and the ~2^-11 rounding of each weight. The exact variant (float32 products)
is qgemm.py's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _scale_min, _sm_count
from .pack import PackedWeight
from .splitk import finish, format_constants, outputs, planes, split_units


@triton.jit
def _scales5(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uu2, umask2, NUT, SPU: tl.constexpr,
             P: tl.constexpr, KQUANT: tl.constexpr, HAS_MIN: tl.constexpr,
             PACKED_SCMN: tl.constexpr, SM: tl.constexpr):
    """(scale, tmin) of every group of the [BN, NU] units, as [BN, NU, 1, SPU, 1] (tmin a
    scalar 0.0 without a min)."""
    s0, t0 = _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uu2, umask2, NUT, 0, SPU, P,
                        KQUANT, HAS_MIN, PACKED_SCMN, SM, False)
    if SPU == 1:
        scale = s0[:, :, None, None, None]
        tmin = t0
        if HAS_MIN:
            tmin = t0[:, :, None, None, None]
    else:
        s1, t1 = _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uu2, umask2, NUT, 1, SPU,
                            P, KQUANT, HAS_MIN, PACKED_SCMN, SM, False)
        scale = tl.join(s0, s1)[:, :, None, :, None]
        tmin = t0
        if HAS_MIN:
            tmin = tl.join(t0, t1)[:, :, None, :, None]
    return scale, tmin


@triton.jit
def _qgemm_wide_kernel(xw_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, y_ptr,
                       M, N, NUT, units_per_split, stride_ym, stride_ys,
                       LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                       KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                       SM: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr,
                       NU: tl.constexpr, F16MATH: tl.constexpr):
    """xw: x in wide_order, (K padded to whole steps, M_PAD) with M_PAD contiguous."""
    NJ: tl.constexpr = 32 // LO  # slots per word
    SPU: tl.constexpr = 32 // G  # scale groups per unit of 32
    JPS: tl.constexpr = NJ // SPU  # slots per scale group
    B: tl.constexpr = LO + HI
    MANT: tl.constexpr = 23 - B
    P: tl.constexpr = SPU * (2 if HAS_MIN else 1)
    BK: tl.constexpr = NU * 32
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    r2 = rows[:, None]
    nu2 = tl.arange(0, NU)[None, :]
    r5 = rows[:, None, None, None, None]
    nu5 = tl.arange(0, NU)[None, :, None, None, None]
    w5 = tl.arange(0, LO)[None, None, :, None, None]
    slot5 = (tl.arange(0, SPU)[None, None, None, :, None] * JPS
             + tl.arange(0, JPS)[None, None, None, None, :])  # j = s*JPS + jj
    u_begin = tl.program_id(1) * units_per_split
    u_end = tl.minimum(u_begin + units_per_split, NUT)
    cols = tl.arange(0, BK)
    offs_m = tl.arange(0, M_PAD)
    ymask = (rows < N)[:, None] & (offs_m < M)[None, :]
    xtile = cols[:, None] * M_PAD + offs_m[None, :]  # [BK, M_PAD]
    acc = tl.zeros([BN, M_PAD], dtype=tl.float32)
    for u0 in range(u_begin, u_end, NU):
        uu2 = u0 + nu2
        umask2 = rmask[:, None] & (uu2 < u_end)
        wmask = (r5 < N) & (u0 + nu5 < u_end)
        woff = r5 * (NUT * LO) + (u0 + nu5) * LO + w5  # [BN, NU, LO, 1, 1]: contiguous words
        words = tl.load(lo_ptr + woff, mask=wmask, other=0)
        q = (words >> (slot5 * LO)) & ((1 << LO) - 1)
        if HI > 0:
            hw = tl.load(hi_ptr + woff, mask=wmask, other=0).to(tl.int32)
            q = q | (((hw >> (slot5 * HI)) & ((1 << HI) - 1)) << LO)
        scale, tmin = _scales5(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uu2, umask2, NUT,
                               SPU, P, KQUANT, HAS_MIN, PACKED_SCMN, SM)
        if F16MATH:
            # q in the mantissa of 1024.0h (a B <= 10-bit code is exact there), q - OFF by an
            # exact float16 subtraction, then one float16 FMA: no float32 and no conversions
            qh = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            qo = qh - (1024.0 + OFF)
            w = tl.fma(qo, scale.to(tl.float16), -tmin.to(tl.float16))
        else:
            f = ((q << MANT) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/2^B, exactly
            a = scale * (1 << B)  # w = a*f + b = scale*(q - OFF) - tmin
            b = -scale * ((1 << B) + OFF) - tmin
            w = (a * f + b).to(tl.float16)
        w = tl.reshape(w, [BN, BK])
        xt = tl.load(xw_ptr + u0 * 32 * M_PAD + xtile)  # rows past M are zeros
        acc = tl.dot(w, xt, acc)
    yp = y_ptr + tl.program_id(1) * stride_ys + offs_m[None, :] * stride_ym + rows[:, None]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def wide_order(x: torch.Tensor, lo_bits: int, nu: int, m_pad: int) -> torch.Tensor:
    """x (m, K) as the kernel reads it: (K padded to whole steps of nu units, m_pad), float16,
    each unit's 32 elements in the order (lane w, slot j) of element j*LO + w, and the rows past
    m zero. Padding the rows makes every load of x one aligned [NU*32, M_PAD] block: with m as
    the stride, a width not a multiple of 16 (m = 8) took 128 registers a thread, not 80."""
    m, k = x.shape
    step = nu * 32
    if k % step or m != m_pad:
        x = torch.nn.functional.pad(x, (0, -k % step, 0, m_pad - m))
    xs = x.view(m_pad, -1, 32 // lo_bits, lo_bits).permute(1, 3, 2, 0)  # (unit, w, j, m)
    return xs.to(torch.float16).reshape(-1, m_pad)


def wide_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """Tile sizes for one launch: BN rows, NU units of 32 per step, SPLIT programs along K
    until the programs fill the SMs twice over, M_PAD columns of x (16 up to 16 rows) and the
    float16 dequantization. From tile sweeps on an H200: BN 64 / NU 4 was best or within 5% of
    the best tile for the 8B's Q4_K matrices and Q6_K head at 8 and 32 rows; M_PAD 16 took 7-9%
    off at 8 rows; float16 dequantization 0-8% at every width."""
    n, nut = packed.rows, packed.cols // 32
    nu = 4
    bn = 64
    sms = _sm_count(packed.device)
    split = 1
    while -(-n // bn) * split < 2 * sms and nut // (split * 2) >= 2 * nu:
        split *= 2
    return {"BN": bn, "NU": nu, "SPLIT": split, "num_warps": 4, "num_stages": 3,
            "M_PAD": max(16, triton.next_power_of_2(m)), "F16MATH": True}


def qgemm_wide(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None,
               out_dtype: torch.dtype, config: dict[str, int] | None = None) -> torch.Tensor:
    """y = x @ W^T for x (m, K), W quantized with its scales fused where the format has them
    (qgemm.qgemm checks the arguments and fuses a streamed layer's scales first)."""
    m = x.shape[0]
    n, nut = packed.rows, packed.cols // 32
    cfg = {**wide_config(packed, m), **(config or {})}  # a config's keys override the defaults
    warps = cfg.pop("num_warps", 4)
    stages = cfg.pop("num_stages", 3)
    split = cfg.pop("SPLIT", 1)
    m_pad = cfg.pop("M_PAD")
    nu = cfg["NU"] = max(cfg["NU"], 1)
    units, split = split_units(nut, nu, split)
    xw = wide_order(x, packed.spec.lo, nu, m_pad)
    part = outputs(m, n, split, out, out_dtype, x.device)
    _qgemm_wide_kernel[(triton.cdiv(n, cfg["BN"]), split)](
        xw, *planes(packed), part,
        m, n, nut, units, part.stride(-2), part.stride(0) if split > 1 else 0,
        **format_constants(packed), M_PAD=m_pad, num_warps=warps, num_stages=stages, **cfg)
    return finish(part, split, out, out_dtype)
