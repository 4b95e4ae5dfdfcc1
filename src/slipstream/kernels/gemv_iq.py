"""The i-quant grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) on the GPU:
the float32 GEMV (m = 1..8, and one routed expert per pair) and dequantization for prefill.

Every weight is rebuilt in float32 from its fields (pack_iq.py's planes) as gguf-py does it:
w = (d * s) * grid[idx][j] * sign, or for IQ1 (d * s) * (grid[idx][j] + shift), where d is the
f16 super-block scale, s the sub-block's odd integer factor ((0.5 + s4) / 4 is (2 s4 + 1) / 8
for IQ2, / 4 for IQ3_XXS; 1 + 2 s4 for IQ3_S; 2 s3 + 1 for IQ1). Each such weight is exact in
float32 (d has 11 significant bits, s at most 5, a grid value at most 6 (IQ3_XXS: up to 62),
IQ1's grid + shift 4 (9/8)), so the dequantized weights equal gguf-py's bit for bit and the
GEMV differs from it only by float32 summation order.

The grid (up to 2048 points x 8 float32, 64 KiB for IQ1) is gathered per weight from a table
made once per device (quant.iquants.grid); the fields of a group of 4..256 weights are read
once per weight too, the same address across the group, served from L1. Sign patterns of the
XXS/XS formats are 7-bit indices into ggml's even-parity table: bit 7 is the parity of bits
0..6, computed here with three xor-shifts instead of a table.

Tiles: [BN rows, BK weights] per step along K, x (M_PAD, BK) loaded once per step; partial
sums [M_PAD, BN, BK] reduced once at the end (deterministic, no atomics). Not yet tuned on a
GPU: the tile sizes below are first guesses sized like gemv.py's float kernel.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ..quant.iquants import grid as iq_grid
from .pack import PackedWeight

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
def _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r, e, mask, K,
                FMT: tl.constexpr):
    """float32 weights [BN, BK] of plane rows r [BN, 1] at columns e [1, BK] (see the top)."""
    g8 = e // 8  # the weight's group of 8: one sign pattern; the point of IQ2/IQ1
    lane = e % 8
    e32 = e // 32
    d = tl.load(d_ptr + r * (K // 256) + e // 256, mask=mask, other=0.0).to(tl.float32)
    neg = lane * 0
    if FMT == _IQ2_XXS or FMT == _IQ3_XXS:
        word = tl.load(hi_ptr + r * (K // 32) + e32, mask=mask, other=0)
        s7 = (word >> (7 * (g8 % 4))) & 127
        neg = _ksign_neg(s7, lane)
        s4 = ((word >> 28) & 15).to(tl.float32)
        if FMT == _IQ2_XXS:
            idx = _u8(lo_ptr, r * (K // 8) + g8, mask)
            g = tl.load(cb_ptr + idx * 8 + lane)
            scale = d * (0.5 + s4) * 0.25
        else:
            idx = _u8(lo_ptr, r * (K // 4) + e // 4, mask)
            g = tl.load(cb_ptr + idx * 4 + e % 4)
            scale = d * (0.5 + s4) * 0.5
        w = scale * g
    elif FMT == _IQ2_XS or FMT == _IQ2_S:
        sb = _u8(sc_ptr, r * (K // 32) + e32, mask)
        s4 = ((sb >> (4 * ((e // 16) % 2))) & 15).to(tl.float32)
        if FMT == _IQ2_XS:
            q = _u16(lo_ptr, r * (K // 8) + g8, mask)
            idx = q & 511
            neg = _ksign_neg(q >> 9, lane)
        else:
            qh = _u8(mn_ptr, r * (K // 32) + e32, mask)
            idx = _u8(lo_ptr, r * (K // 8) + g8, mask) | (((qh >> (2 * (g8 % 4))) & 3) << 8)
            neg = (_u8(hi_ptr, r * (K // 8) + g8, mask) >> lane) & 1
        g = tl.load(cb_ptr + idx * 8 + lane)
        w = d * (0.5 + s4) * 0.25 * g
    elif FMT == _IQ3_S:
        p4 = e // 4
        qh = _u8(mn_ptr, r * (K // 32) + e32, mask)
        idx = _u8(lo_ptr, r * (K // 4) + p4, mask) | (((qh >> (p4 % 8)) & 1) << 8)
        neg = (_u8(hi_ptr, r * (K // 8) + g8, mask) >> lane) & 1
        sb = _u8(sc_ptr, r * (K // 64) + e // 64, mask)
        s4 = ((sb >> (4 * (e32 % 2))) & 15).to(tl.float32)
        g = tl.load(cb_ptr + idx * 4 + e % 4)
        w = d * (1.0 + 2.0 * s4) * g
    elif FMT == _IQ1_S:
        qh = _u16(sc_ptr, r * (K // 32) + e32, mask)
        idx = _u8(lo_ptr, r * (K // 8) + g8, mask) | (((qh >> (3 * (g8 % 4))) & 7) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        w = dl * (tl.load(cb_ptr + idx * 8 + lane) + delta)
    else:  # IQ1_M
        nib = (_u8(mn_ptr, r * (K // 16) + e // 16, mask) >> (4 * (g8 % 2))) & 15
        idx = _u8(lo_ptr, r * (K // 8) + g8, mask) | ((nib & 7) << 8)
        sw = _u16(sc_ptr, r * (K // 64) + e // 64, mask)
        dl = d * (2 * ((sw >> (3 * ((e // 16) % 4))) & 7) + 1).to(tl.float32)
        delta = tl.where((nib & 8) != 0, -0.125, 0.125)
        w = dl * (tl.load(cb_ptr + idx * 8 + lane) + delta)
    return tl.where(neg != 0, -w, w)


@triton.jit
def _gemv_iq_kernel(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, y_ptr, M, N, K,
                    stride_xm, stride_ym, ids_ptr, X_DIV, stride_xp, stride_yp,
                    FMT: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, ROUTED: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] w[n, k], fp32. ROUTED (M = 1): pair p = program_id(1) reads
    expert ids[p]'s rows (plane rows ids[p] * N ..) and x row p // X_DIV, writes y row p."""
    row0 = 0
    if ROUTED:  # see gemv.gemv_routed
        p = tl.program_id(1)
        row0 = tl.load(ids_ptr + p).to(tl.int64) * N
        x_ptr += (p // X_DIV) * stride_xp
        y_ptr += p * stride_yp
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    r2 = (row0 + rows)[:, None]
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([M_PAD, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        kmask = kk < K
        w = _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, r2, kk[None, :],
                        rmask[:, None] & kmask[None, :], K, FMT)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m < M)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & rmask[None, :])


@triton.jit
def _dequant_iq_kernel(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, out_ptr, N, K, stride_on,
                       FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows < N)[:, None] & (kk < K)[None, :]
    w = _iq_weights(lo_ptr, hi_ptr, d_ptr, sc_ptr, mn_ptr, cb_ptr, rows[:, None], kk[None, :],
                    mask, K, FMT)
    tl.store(out_ptr + rows[:, None] * stride_on + kk[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask)


def _planes(packed: PackedWeight) -> tuple[torch.Tensor, ...]:
    """lo, hi, d, sc, mn and the grid table; a plane the format lacks is passed as lo (its
    kernel branch never reads it)."""
    dummy = packed.lo
    return (packed.lo, *(p if p is not None else dummy for p in (packed.hi, packed.d,
                                                                   packed.sc, packed.mn)),
            iq_grid(packed.qtype, packed.device))


def _m_pad(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def gemv_iq_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """BK = 256 (one super-block per step: every field of it read by one tile), BN rows so the
    [M_PAD, BN, BK] partial sums stay at 8192 floats (64 a thread at 4 warps), fewer where N
    is too small to give ~4 programs per SM (132 on an H100/H200)."""
    mp = _m_pad(m)
    bn = max(1, 8192 // (mp * 256))
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
