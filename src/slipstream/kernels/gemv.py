"""Fused dequantize-and-GEMV: y[m, N] = x[m, K] @ W[N, K]^T for m = 1..8, W in any GGUF format.

Decode (m = 1) and speculative verification (m <= 8) are memory-bound: the whole weight is read
once per token. Each program owns BN rows and walks K in steps of NU units of 32 elements; every
quantized byte is loaded once, with 16-byte loads along a row (see pack.py for the planes), and
nothing dequantized goes to memory.

Kernels: `_gemv_qv_kernel` (all quantized formats, m = 1..8, fp32 on CUDA cores),
`_gemv_q_dot_kernel` (m = 2..8 on tensor cores with bf16-rounded weights; opt-in via config
{"dot": 1}, less exact), `_gemv_f_kernel` (F32/F16/BF16).

The previous m = 1 kernel measured 0.8-1.3 TB/s for Q4_K/Q6_K on an H200 (4.2 TB/s copy rate):
it was instruction-bound, ~9 (Q4_K) to ~20 (Q6_K) SASS instructions per code in its loop, most
of them per-step cross-lane reductions and shared-memory layout shuffles. `_gemv_qv_kernel`
gives each thread whole 32-code units of BN rows, so its loop is per-lane arithmetic only:

* Code -> exact float with no shift and no conversion instruction: the code is masked in place
  into the mantissa of a float whose exponent makes the mantissa LSB worth 1, and one FADD
  removes the implicit leading bit and the format's offset (_code_to_f32). One LOP3 + one FADD
  per code (+ a shift and a LOP3 for the high bits of Q3_K/Q5_*/Q6_K), then m FFMAs with x.
* The group scale and min are applied once per 16/32 codes, to the per-lane dot sums.
* x is loaded and converted once per unit and reused for all BN rows held by the thread.

SASS (sm_90, offline, `python` + ptxas of Triton 3.9), loop instructions per code at m = 1:
Q4_K 4.2 (was 9.1), Q8_0 4.1 (was 7.7), Q6_K 6.5 (was 20). The H200 issues ~33e12 lane-
instructions/s, i.e. ~8e12 codes/s at 4.2 per code: for Q4_K (0.58 B per code) ~4.6 TB/s of
weight bytes, above HBM, so m = 1 should now be memory-bound. At m = 8 the m FFMAs per code
dominate (~25 instructions per code): a tensor-core path is the next step there.
Results are deterministic (no atomics, fixed reduction order).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pack import FLOAT_DTYPES, PackedWeight

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
def _group_affine(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT,
                  s: tl.constexpr, SPU: tl.constexpr, B: tl.constexpr, OFF: tl.constexpr,
                  KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr):
    """(a, b) of sub-group s of each unit, [BN, NU] fp32: contribution = a*F + b*X (see top)."""
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
    a = scale * (1 << B)
    b = -scale * ((1 << B) + OFF)
    if HAS_MIN:
        b = b - tmin
    return a, b


@triton.jit
def _code_to_f32(words, wsh, hw, ones, j: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
                 OFF: tl.constexpr, S: tl.constexpr, ASM: tl.constexpr):
    """Slot j's codes as exact fp32 values q - OFF, [same shape as words].

    The code is masked *in place* into the mantissa of a float whose exponent makes the mantissa
    LSB worth 1: bits = (code << p) | (150 - p) << 23 is 2^(23-p) + code exactly, and one FADD of
    -(2^(23-p) + OFF) leaves q - OFF. So a slot costs one LOP3 (and+or) and one FADD per code, no
    shift: a code at bits [p, p+B) fits if p + B <= 23, and the slots above that are read from
    wsh = words >> S, shifted once per word (S from _shift_for). Formats with a hi plane add the
    high bits with one shift and one LOP3."""
    B: tl.constexpr = LO + HI
    SRC: tl.constexpr = j * LO
    P: tl.constexpr = SRC - S * ((SRC + B) // 24)  # SRC if the code fits below bit 23
    if SRC + B <= 23:
        v = words
    else:
        v = wsh
    EXP: tl.constexpr = (150 - P) << 23
    # `ones` is a runtime 0xFFFFFFFF (uint32): the masks become loop-invariant registers instead of immediates that
    # ptxas rematerializes with a MOV before every LOP3 (LOP3 takes one immediate, EXP here)
    lo = v & ((ones >> (32 - LO)) << P)
    if HI > 0:
        HSRC: tl.constexpr = j * HI
        HDST: tl.constexpr = P + LO
        if HDST >= HSRC:
            h = hw << (HDST - HSRC)
        else:
            h = hw >> (HSRC - HDST)
        hm = (ones >> (32 - HI)) << HDST
        if ASM:
            # two explicit (a & b) | c LOP3s; left to LLVM the ops regroup into three LOP3s
            t = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                          [h.to(tl.uint32, bitcast=True), hm, ones & EXP],
                                          dtype=tl.uint32, is_pure=True, pack=1)
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                             [v.to(tl.uint32, bitcast=True),
                                              (ones >> (32 - LO)) << P, t],
                                             dtype=tl.uint32, is_pure=True, pack=1)
        else:  # the CPU interpreter has no inline PTX
            bits = lo | ((h.to(tl.uint32, bitcast=True) & hm) | EXP)
    else:
        bits = lo | EXP
    MAGIC: tl.constexpr = (1 << (23 - P)) + OFF
    return bits.to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """Load without a mask when the tiles divide evenly (fewer predicates in the inner loop)."""
    if EVEN:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _gemv_qv_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, y_ptr,
                    M, N, NUT, stride_xm, stride_ym, ones,
                    LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                    S: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
                    M_PAD: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr):
    """m = 1..8. Tiles are [BN rows, NU units, LO words]: each thread owns whole units (LO words =
    16 B for 4-bit formats, one 32-element unit, loaded with one 16-byte load) for BN rows, keeps
    that unit's activations in registers for all BN rows, and accumulates per lane with FFMAs;
    the only cross-thread reduction is the final one over NU. Per code the inner loop is one LOP3,
    one FADD and M_PAD FFMAs (see _code_to_f32); the group scale is applied once per 16/32 codes.
    """
    SPU: tl.constexpr = 32 // G  # scale groups per unit
    JPS: tl.constexpr = 32 // LO // SPU  # slots per scale group
    # Formats with a min term (codes 0..2^B-1) are centred, w = s*(q - CEN) + (t + s*CEN), so the
    # two group terms do not cancel (Q5_1's d*Q + m*X lost ~4 bits: 1.6e-6 relative error)
    CEN: tl.constexpr = (1 << (LO + HI - 1)) if HAS_MIN else 0
    # Everything is built at rank 4, [M_PAD, BN, NU, LO], straight from the loads' pointers, so
    # Triton gives the products the loads' register layout (a rank-4 tl.zeros accumulator gets a
    # default layout that spreads LO over lanes and costs shared-memory shuffles every slot).
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1)  # clamped: loads need no row mask, the store has one
    offs_u = tl.arange(0, NU)
    r4 = rows_c[None, :, None, None].to(tl.int64)  # [1, BN, 1, 1]
    r3 = rows_c[None, :, None].to(tl.int64)  # [1, BN, 1]
    # Q8_0's 8 words per unit are two [.., 4] halves: an 8-wide int32 tile would be split over two
    # lanes (16-byte loads) while its 8 bf16 activations sit in one, costing a layout shuffle
    LW: tl.constexpr = 4 if LO == 8 else LO
    w4 = tl.arange(0, LW)[None, None, None, :]  # [1, 1, 1, LW]
    offs_m = tl.arange(0, M_PAD)
    xm4 = offs_m[:, None, None, None] * stride_xm  # [M_PAD, 1, 1, 1]
    xmask_m = (offs_m < M)[:, None, None, None]
    # `ones` (a runtime 0xFFFFFFFF) shifted by (offs_u + N) >> 31, which is 0 but neither compiler
    # can prove it: a per-lane value, so the bit masks derived from it live in ordinary registers,
    # which LOP3's third operand takes (uniform or immediate masks cost a second LOP3 per code).
    ones = (ones >> ((offs_u + N) >> 31).to(tl.uint32)).to(tl.uint32)[None, None, :, None]
    acc = tl.zeros([M_PAD, BN, NU], dtype=tl.float32)
    for u0 in range(0, NUT, NU):
        uu = u0 + offs_u  # [NU]
        u4 = uu[None, None, :, None]  # [1, 1, NU, 1]
        u3 = uu[None, None, :]  # [1, 1, NU]
        um3 = u3 < NUT
        qoff = r4 * (NUT * LO) + u4 * LO + w4  # [1, BN, NU, LW]: LO contiguous words per unit
        xoff = xm4 + u4 * 32 + w4  # [M_PAD, 1, NU, LW]
        if EVEN:
            words = tl.load(lo_ptr + qoff)
            xmask = xmask_m
        else:
            words = tl.load(lo_ptr + qoff, mask=u4 < NUT, other=0)
            xmask = xmask_m & (u4 < NUT)
        if HI > 0:
            hw = _ld(hi_ptr + qoff, u4 < NUT, EVEN).to(tl.int32)
        else:
            hw = words
        wsh = words >> S
        if LW < LO:
            words2 = _ld(lo_ptr + qoff + LW, u4 < NUT, EVEN)
            wsh2 = words2 >> S
        for s in tl.static_range(SPU):
            # q: sum over the group of x * (code - OFF), per lane; xs: sum of x (min term)
            # j (the slot) must be a static_range variable to reach the helpers as a constexpr:
            # `j = s * JPS + jj` makes a runtime int32 scalar, which Triton 3.6 passes on to a
            # constexpr parameter as such (and a constexpr-annotated j cannot be reassigned)
            for j in tl.static_range(s * JPS, (s + 1) * JPS):
                f = _code_to_f32(words, wsh, hw, ones, j, LO, HI, OFF + CEN, S, ASM)
                xj = tl.load(x_ptr + xoff + j * LO, mask=xmask, other=0.0).to(tl.float32)
                if j == s * JPS:
                    q = f * xj
                    xs = xj
                else:
                    q += f * xj
                    if HAS_MIN:
                        xs += xj
                if LW < LO:  # second half of the unit's words (no format with a hi plane)
                    f2 = _code_to_f32(words2, wsh2, hw, ones, j, LO, HI, OFF + CEN, S, ASM)
                    x2 = tl.load(x_ptr + xoff + j * LO + LW, mask=xmask, other=0.0)
                    x2 = x2.to(tl.float32)
                    q += f2 * x2
                    if HAS_MIN:
                        xs += x2
            # per (row, unit, sub-group) scale and min: w = scale * (code - OFF) + tneg
            if KQUANT:
                sup = r3 * (NUT // 8) + u3 // 8
                d = _ld(d_ptr + sup, um3, EVEN).to(tl.float32)
                scv = _ld(sc_ptr + r3 * (NUT * SPU) + u3 * SPU + s, um3, EVEN)
                if PACKED_SCMN:
                    sci = scv.to(tl.int32) & 0xFF
                    scale = d * (sci & 15).to(tl.float32)
                    if HAS_MIN:
                        dmin = _ld(m_ptr + sup, um3, EVEN).to(tl.float32)
                        tneg = -dmin * (sci >> 4).to(tl.float32)
                else:
                    scale = d * scv.to(tl.float32)
                    if HAS_MIN:
                        mnv = _ld(mn_ptr + r3 * (NUT * SPU) + u3 * SPU + s, um3, EVEN)
                        tneg = -_ld(m_ptr + sup, um3, EVEN).to(tl.float32) * mnv.to(tl.float32)
            else:
                scale = _ld(d_ptr + r3 * NUT + u3, um3, EVEN).to(tl.float32)
                if HAS_MIN:
                    tneg = _ld(m_ptr + r3 * NUT + u3, um3, EVEN).to(tl.float32)
            acc += scale * tl.sum(q, axis=3)  # [1, BN, NU] * [M_PAD, BN, NU]
            if HAS_MIN:
                tneg = tneg + scale * CEN  # exact product (power of two), one rounding
            if HAS_MIN:
                acc += tneg * tl.sum(xs, axis=3)  # [1, BN, NU] * [M_PAD, 1, NU]
    y = tl.sum(acc, axis=2)  # [M_PAD, BN]
    ymask = (offs_m < M)[:, None] & (rows < N)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :],
             y.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _gemv_q_dot_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, y_ptr,
                       M, N, NUT, stride_xm, stride_ym,
                       LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                       KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                       M_PAD: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr,
                       WDT: tl.constexpr):
    """Tensor-core variant for m = 2..8 (x padded to 16 rows): each slot's codes are expanded to
    bf16 weights in registers and multiplied with tl.dot, so the FMAs per code do not grow with m.
    Weights are rounded to bf16 (rel. error ~2^-9 per weight, like the prefill path)."""
    NJ: tl.constexpr = 32 // LO
    SPU: tl.constexpr = 32 // G
    JPS: tl.constexpr = NJ // SPU
    B: tl.constexpr = LO + HI
    MANT: tl.constexpr = 23 - B
    NUL: tl.constexpr = NU * LO
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    r2 = rows[:, None]
    cols = tl.arange(0, NUL)
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros([BN, M_PAD], dtype=tl.float32)
    for u0 in range(0, NUT, NU):
        uc = u0 + cols // LO  # [NUL] unit of each column
        cmask = uc < NUT
        qmask = rmask[:, None] & cmask[None, :]
        qoff = r2 * (NUT * LO) + u0 * LO + cols[None, :]  # contiguous along a row
        words = tl.load(lo_ptr + qoff, mask=qmask, other=0)
        if HI > 0:
            hw = tl.load(hi_ptr + qoff, mask=qmask, other=0).to(tl.int32)
        xk = uc * 32 + cols % LO  # [NUL]
        xmask = cmask[:, None] & (offs_m < M)[None, :]
        for s in tl.static_range(SPU):
            a, b = _group_affine(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uc[None, :], qmask, NUT,
                                 s, SPU, B, OFF, KQUANT, HAS_MIN, PACKED_SCMN)
            for j in tl.static_range(s * JPS, (s + 1) * JPS):  # constexpr j (see qv kernel)
                bits = _bits_to(words, j * LO, LO, MANT) | 0x3F800000
                if HI > 0:
                    bits = bits | _bits_to(hw, j * HI, HI, MANT + LO)
                w = (a * bits.to(tl.float32, bitcast=True) + b).to(WDT)  # [BN, NUL]
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (xk + j * LO)[:, None],
                             mask=xmask, other=0.0).to(WDT)  # [NUL, M_PAD]
                acc = tl.dot(w, xt, acc)
    ymask = rmask[:, None] & (offs_m < M)[None, :]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=ymask)


@triton.jit
def _gemv_f_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Plain GEMV for F32/F16/BF16 weights (fp32 accumulation, one reduction at the end)."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([M_PAD, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        kmask = kk < K
        w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m < M)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & rmask[None, :])


def _m_pad(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _shift_for(lo: int, hi: int) -> int:
    """S of _code_to_f32: the smallest multiple of LO that brings the top slot below bit 23."""
    return lo * -(-(32 - lo + lo + hi - 23) // lo)


def gemv_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """Tile sizes for one launch.

    Float weights (from the H200 sweeps of bench/kernels_bench.py --sweep): BN rows x BK columns.
    Quantized weights (_gemv_qv_kernel): BN rows x NU 32-element units per step, one unit per
    thread (num_warps = NU / 32). NU is the largest power of two <= 128 dividing K/32, so the
    K loop needs no masks (EVEN) on the 8B/70B shapes; BN trades x reuse (x is converted and
    summed once per unit for all BN rows) against registers (m * BN * LO fp32 partial sums per
    thread) and against having enough programs: at least ~4 per SM.
    Not yet swept on a GPU: chosen from register counts and SASS instruction counts per code.
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
    nut = k // 32
    nu = 128
    while nu > 32 and nut % nu:
        nu //= 2
    if nut % nu:  # K/32 odd etc.: masked tail, 4 warps
        nu = min(128, max(32, triton.next_power_of_2(nut)))
    # partial sums per thread: mp * bn * LO fp32 registers (keep <= ~64)
    # SASS at m = 1: BN = 8 is 80 registers, 4.1-3.9 instructions per code for Q4_K/Q8_0;
    # formats with a hi plane need more registers (Q6_K 128 at BN = 4, 164 at BN = 8)
    bn = {1: 8, 2: 4, 4: 2, 8: 2}[mp]
    if spec.hi and mp == 1:
        bn = 4
    while bn > 1 and -(-n // bn) < 4 * sms:
        bn //= 2
    return {"BN": bn, "NU": nu, "num_warps": max(1, nu // 32)}


def gemv(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: dict[str, int] | None = None
         ) -> torch.Tensor:
    """y = x @ W^T for x (m, K) with m <= 8 (bf16, fp16 or fp32) -> (m, N) in out_dtype
    (default x's dtype), fp32 accumulation. `config` overrides gemv_config (for tuning): keys
    BN, NU (or the old m = 1 key NG, in scale groups), num_warps, and dot=1 for the tensor-core
    variant."""
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
    cfg = dict(config or gemv_config(packed, m))
    warps = cfg.pop("num_warps", 4)
    grid = (triton.cdiv(n, cfg["BN"]),)
    if packed.qtype in FLOAT_DTYPES:
        w = packed.lo
        _gemv_f_kernel[grid](x, w, out, m, n, packed.cols, x.stride(0), w.stride(0),
                             out.stride(0), M_PAD=_m_pad(m), num_warps=warps, **cfg)
        return out
    spec = packed.spec
    dummy = packed.lo
    nut = packed.cols // 32
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    planes = (packed.lo, packed.hi if packed.hi is not None else dummy, packed.d,
              packed.m if packed.m is not None else dummy,
              packed.sc if packed.sc is not None else dummy,
              packed.mn if packed.mn is not None else dummy)
    fmt = {"LO": spec.lo, "HI": spec.hi, "G": spec.group, "OFF": spec.off, "KQUANT": spec.kquant,
           "HAS_MIN": spec.has_min, "PACKED_SCMN": spec.packed_scmn}
    if cfg.pop("dot", 0):
        # Triton's CPU interpreter (3.9) computes bf16 tl.dot wrongly; fp32 there for the logic
        _gemv_q_dot_kernel[grid](
            x, *planes, out, m, n, nut, x.stride(0), out.stride(0), **fmt, M_PAD=16,
            WDT=tl.float32 if interp else tl.bfloat16, num_warps=warps, **cfg)
        return out
    if "NG" in cfg:  # old m = 1 tile key: NG scale groups of G elements
        cfg["NU"] = max(1, cfg.pop("NG") * spec.group // 32)
    _gemv_qv_kernel[grid](
        x, *planes, out, m, n, nut, x.stride(0), out.stride(0), 0xFFFFFFFF, **fmt,
        S=_shift_for(spec.lo, spec.hi), EVEN=nut % cfg["NU"] == 0, ASM=not interp,
        M_PAD=_m_pad(m), num_warps=warps, **cfg)
    return out
