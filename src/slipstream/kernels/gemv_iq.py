"""The i-quant grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) on the GPU:
the float32 GEMV (m = 1..8, and one routed expert per pair) and dequantization for prefill.

Every weight is rebuilt in float32 from its fields (pack_iq.py's planes) as gguf-py does it:
w = (d * s) * grid[idx][j] * sign, or for IQ1 (d * s) * (grid[idx][j] + shift), where d is the
f16 super-block scale, s the sub-block's odd integer factor ((0.5 + s4) / 4 is (2 s4 + 1) / 8
for IQ2, / 4 for IQ3_XXS; 1 + 2 s4 for IQ3_S; 2 s3 + 1 for IQ1). Each such weight is exact in
float32 (d has 11 significant bits, s at most 5, a grid value at most 6 (43 = 101011b),
IQ1's grid + shift at most 4 (9/8 = 1.001b): 22 of float32's 24), so the dequantized weights equal gguf-py's bit for bit and the
GEMV differs from it only by float32 summation order.

Tiles are [BN rows, NG groups of 8 weights, 8 lanes]: 8 weights share one sign pattern
(and, for IQ2/IQ1, one grid point), so every field of a group (grid index, signs, scale, d)
is loaded and decoded once per group on [BN, NG, 1] and broadcast over the lanes, the grid
points too: a point's 4 or 8 values are bytes of one int64 (grid_words: 16 KiB for IQ1's
2048 points, made once per device), so per weight remain a byte extract, a conversion, the
sign bit and the multiplies. Sign patterns of the XXS/XS formats are 7-bit indices into
ggml's even-parity table: bit 7 is the parity of bits 0..6, computed with three xor-shifts
instead of a table.

x (M_PAD, NG, 8) is loaded once per step; products are summed in place ([BN, NG, 8] at
m = 1, [M_PAD, BN, NG] above) and reduced once at the end (deterministic, no atomics). Not yet run nor tuned on a GPU: the tile sizes are first
guesses sized like gemv.py's float kernel.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from .pack import PackedWeight
from .pack_iq import grid_words

_IQ2_XXS = tl.constexpr(int(T.IQ2_XXS))
_IQ2_XS = tl.constexpr(int(T.IQ2_XS))
_IQ2_S = tl.constexpr(int(T.IQ2_S))
_IQ3_XXS = tl.constexpr(int(T.IQ3_XXS))
_IQ3_S = tl.constexpr(int(T.IQ3_S))
_IQ1_S = tl.constexpr(int(T.IQ1_S))
_IQ1_M = tl.constexpr(int(T.IQ1_M))


@triton.jit
def _ksign_neg(s7, lane):
    """1 where weight `lane` (0..7) of a group is negative under 7-bit sign index s7: bit lane
    of ggml's ksigns[s7] = s7 | parity(s7) << 7."""
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return ((s7 | ((p & 1) << 7)) >> lane) & 1


@triton.jit
def _u8(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32) & 0xFF


@triton.jit
def _u16(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def _grid8(cb_ptr, idx, lane, OFF: tl.constexpr):
    """Grid value `lane` of 8-wide points idx [BN, NG, 1] -> float32 [BN, NG, 8]: one 8-byte
    load per point (grid_words), a byte per lane."""
    v = tl.load(cb_ptr + idx)
    return (((v >> (8 * lane)) & 0xFF) - OFF).to(tl.float32)


@triton.jit
def _grid4x2(cb_ptr, idx0, idx1, lane):
    """The 8 weights of two 4-wide points idx0, idx1 [BN, NG, 1] -> float32 [BN, NG, 8]."""
    v = tl.where(lane < 4, tl.load(cb_ptr + idx0), tl.load(cb_ptr + idx1))
    return ((v >> (8 * (lane % 4))) & 0xFF).to(tl.float32)


@triton.jit
def _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r, g, lane, mask, K,
                FMT: tl.constexpr):
    """float32 weights [BN, NG, 8] of plane rows r [BN, 1, 1], groups of 8 weights g
    [1, NG, 1] (column g * 8 + lane), lanes [1, 1, 8]; mask [BN, NG, 1]. Every field shared
    by a group (grid index, sign pattern, scale, d) is read and decoded once per group, on
    [BN, NG, 1]; only the grid gather and the sign bit are per weight."""
    e32 = g // 4  # the group's 32-weight sub-block
    d = tl.load(d_ptr + r * (K // 256) + g // 32, mask=mask, other=0.0).to(tl.float32)
    neg = lane * 0
    if FMT == _IQ2_XXS or FMT == _IQ3_XXS:
        word = tl.load(hi_ptr + r * (K // 32) + e32, mask=mask, other=0)
        neg = _ksign_neg((word >> (7 * (g % 4))) & 127, lane)
        s4 = ((word >> 28) & 15).to(tl.float32)
        if FMT == _IQ2_XXS:
            idx = _u8(lo_ptr, r * (K // 8) + g, mask)
            scale = d * (0.5 + s4) * 0.25
            w = scale * _grid8(cb_ptr, idx, lane, 0)
        else:  # two points of 4 weights per group
            pts = lo_ptr + r * (K // 4) + 2 * g
            scale = d * (0.5 + s4) * 0.5
            w = scale * _grid4x2(cb_ptr, _u8(pts, 0, mask), _u8(pts, 1, mask), lane)
    elif FMT == _IQ2_XS or FMT == _IQ2_S:
        sb = _u8(sc_ptr, r * (K // 32) + e32, mask)
        s4 = ((sb >> (4 * ((g // 2) % 2))) & 15).to(tl.float32)
        if FMT == _IQ2_XS:
            q = _u16(lo_ptr, r * (K // 8) + g, mask)
            idx = q & 511
            neg = _ksign_neg(q >> 9, lane)
        else:
            qh = _u8(mn_ptr, r * (K // 32) + e32, mask)
            idx = _u8(lo_ptr, r * (K // 8) + g, mask) | (((qh >> (2 * (g % 4))) & 3) << 8)
            neg = (_u8(hi_ptr, r * (K // 8) + g, mask) >> lane) & 1
        scale = d * (0.5 + s4) * 0.25
        w = scale * _grid8(cb_ptr, idx, lane, 0)
    elif FMT == _IQ3_S:
        qh = _u8(mn_ptr, r * (K // 32) + e32, mask)
        pts = lo_ptr + r * (K // 4) + 2 * g
        p0 = 2 * (g % 4)  # the group's first point in the sub-block: qh bit p0, then p0 + 1
        idx0 = _u8(pts, 0, mask) | (((qh >> p0) & 1) << 8)
        idx1 = _u8(pts, 1, mask) | (((qh >> (p0 + 1)) & 1) << 8)
        neg = (_u8(hi_ptr, r * (K // 8) + g, mask) >> lane) & 1
        sb = _u8(sc_ptr, r * (K // 64) + g // 8, mask)
        s4 = ((sb >> (4 * (e32 % 2))) & 15).to(tl.float32)
        scale = d * (1.0 + 2.0 * s4)
        w = scale * _grid4x2(cb_ptr, idx0, idx1, lane)
    elif FMT == _IQ1_S:
        qh = _u16(sc_ptr, r * (K // 32) + e32, mask)
        idx = _u8(lo_ptr, r * (K // 8) + g, mask) | (((qh >> (3 * (g % 4))) & 7) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        w = dl * (_grid8(cb_ptr, idx, lane, 1) + delta)
    else:  # IQ1_M
        nib = (_u8(mn_ptr, r * (K // 16) + g // 2, mask) >> (4 * (g % 2))) & 15
        idx = _u8(lo_ptr, r * (K // 8) + g, mask) | ((nib & 7) << 8)
        sw = _u16(sc_ptr, r * (K // 64) + g // 8, mask)
        dl = d * (2 * ((sw >> (3 * ((g // 2) % 4))) & 7) + 1).to(tl.float32)
        delta = tl.where((nib & 8) != 0, -0.125, 0.125)
        w = dl * (_grid8(cb_ptr, idx, lane, 1) + delta)
    return tl.where(neg != 0, -w, w)


@triton.jit
def _gemv_iq_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, y_ptr, M, N, K,
                    stride_xm, stride_ym, ids_ptr, X_DIV, stride_xp, stride_yp,
                    FMT: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, ROUTED: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] w[n, k], fp32. ROUTED (M = 1): pair p = program_id(1) reads
    expert ids[p]'s rows (plane rows ids[p] * N ..) and x row p // X_DIV, writes y row p."""
    NG: tl.constexpr = BK // 8  # groups of 8 weights per step
    row0 = 0
    if ROUTED:  # see gemv.gemv_routed
        p = tl.program_id(1)
        row0 = tl.load(ids_ptr + p).to(tl.int64) * N
        x_ptr += (p // X_DIV) * stride_xp
        y_ptr += p * stride_yp
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    r3 = (row0 + rows)[:, None, None]
    offs_g = tl.arange(0, NG)[None, :, None]
    lane = tl.arange(0, 8)[None, None, :]
    om = tl.arange(0, M_PAD)
    if M_PAD == 1:  # decode: products summed in place, one reduction at the end (a sum per
        # step costs shuffles and a shared-memory layout change per step in the SASS)
        acc1 = tl.zeros([BN, NG, 8], dtype=tl.float32)
        for g0 in range(0, K // 8, NG):
            g = g0 + offs_g  # [1, NG, 1]
            gmask = g < K // 8
            w = _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r3, g, lane,
                            rmask[:, None, None] & gmask, K, FMT)  # [BN, NG, 8]
            x = tl.load(x_ptr + g * 8 + lane, mask=gmask, other=0.0).to(tl.float32)
            acc1 += w * x
        y1 = tl.sum(tl.sum(acc1, axis=2), axis=1)  # [BN]
        tl.store(y_ptr + rows, y1.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        offs_m = om[:, None, None]
        acc = tl.zeros([M_PAD, BN, NG], dtype=tl.float32)
        for g0 in range(0, K // 8, NG):
            g = g0 + offs_g  # [1, NG, 1]
            gmask = g < K // 8
            w = _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r3, g, lane,
                            rmask[:, None, None] & gmask, K, FMT)  # [BN, NG, 8]
            x = tl.load(x_ptr + offs_m * stride_xm + g * 8 + lane,
                        mask=(offs_m < M) & gmask, other=0.0).to(tl.float32)  # [M_PAD, NG, 8]
            acc += tl.sum(w[None, :, :, :] * x[:, None, :, :], axis=3)
        y = tl.sum(acc, axis=2)  # [M_PAD, BN]
        tl.store(y_ptr + om[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=(om < M)[:, None] & rmask[None, :])


@triton.jit
def _dequant_iq_kernel(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, out_ptr, N, K, stride_on,
                       FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    NG: tl.constexpr = BK // 8
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r3 = rows[:, None, None]
    g = tl.program_id(1) * NG + tl.arange(0, NG)[None, :, None]
    lane = tl.arange(0, 8)[None, None, :]
    mask = (r3 < N) & (g < K // 8)
    w = _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r3, g, lane, mask, K, FMT)
    tl.store(out_ptr + r3 * stride_on + g * 8 + lane, w.to(out_ptr.dtype.element_ty),
             mask=mask & (lane < 8))


def _planes(packed: PackedWeight) -> tuple[torch.Tensor, ...]:
    """lo, hi, d, sc, mn and the grid table; a plane the format lacks is passed as lo (its
    kernel branch never reads it)."""
    dummy = packed.lo
    return (packed.lo, *(p if p is not None else dummy for p in (packed.hi, packed.d,
                                                                   packed.sc, packed.mn)),
            grid_words(packed.qtype, packed.device))


def _m_pad(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def gemv_iq_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """BK = 256 weights per step (one super-block: its d read by one tile), BN rows so the
    [M_PAD, BN, BK] products stay at 8192 floats (64 a thread at 4 warps; m = 1: BN = 16, as
    the per-group decoding is spread over more rows: the SASS of the IQ2_XXS loop for sm_90
    counts 16.3 thread instructions a weight at BN = 4, 12.5 at 16), fewer where N is too
    small to give ~4 programs per SM (132 on an H100/H200). BK: a multiple of 8."""
    mp = _m_pad(m)
    bn = 16 if mp == 1 else max(1, 8192 // (mp * 256))
    while bn > 1 and -(-packed.rows // bn) < 4 * 132:
        bn //= 2
    return {"BN": bn, "BK": 256, "num_warps": 4}


def gemv_iq(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor,
            config: dict[str, int] | None = None) -> torch.Tensor:
    """out (m, N) = x (m <= 8, K; unit column stride) @ W^T for a grid-format weight."""
    m, n = x.shape[0], packed.rows
    cfg = dict(config or gemv_iq_config(packed, m))
    warps = cfg.pop("num_warps", 4)
    _gemv_iq_kernel[(triton.cdiv(n, cfg["BN"]),)](
        x, *_planes(packed), out, m, n, packed.cols, x.stride(0), out.stride(0), packed.lo, 1,
        0, 0, FMT=int(packed.qtype), M_PAD=_m_pad(m), num_warps=warps, **cfg)
    return out


def gemv_iq_routed(x: torch.Tensor, packed: PackedWeight, ids: torch.Tensor, n: int,
                   x_div: int, out: torch.Tensor) -> torch.Tensor:
    """gemv.gemv_routed for a grid-format stack of experts of n rows each."""
    cfg = gemv_iq_config(replace(packed, rows=n * ids.shape[0]), 1)
    warps = cfg.pop("num_warps")
    _gemv_iq_kernel[(triton.cdiv(n, cfg["BN"]), ids.shape[0])](
        x, *_planes(packed), out, 1, n, packed.cols, x.stride(0), out.stride(0), ids, x_div,
        x.stride(0), out.stride(0), FMT=int(packed.qtype), M_PAD=1, ROUTED=True,
        num_warps=warps, **cfg)
    return out


def dequantize_iq(packed: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """out (N, K), unit column stride, = the grid-format weight, rounded once to out's dtype."""
    bn, bk = 8, 256
    _dequant_iq_kernel[(triton.cdiv(packed.rows, bn), triton.cdiv(packed.cols, bk))](
        *_planes(packed), out, packed.rows, packed.cols, out.stride(0), FMT=int(packed.qtype),
        BN=bn, BK=bk, num_warps=4)
    return out
