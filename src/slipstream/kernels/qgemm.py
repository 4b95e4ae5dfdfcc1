"""Small-m quantized GEMM: y[m, N] = x[m, K] @ W[N, K]^T for m up to 128.

Why: a draft's tree level and a resident target's tree verification multiply 8 to 128 tokens by
every weight. The fused GEMVs (gemv.py, gemv_q8.py) do work per code that grows with m (one FMA
or dp4a per row of x), and the prefill path dequantizes the whole weight to a float16 scratch
and reads it back for cuBLAS: a level of the 8B draft cost ~30 ms at every width from 8 to 128
on an H200, against 4.7 ms at width 1. Here every code is unpacked once per program into a
weight tile in registers, and the tile is multiplied by all m rows of x at once, so the
unpacking is paid once and m only adds multiply work.

`exact=False` (precision "fast") multiplies through qgemm_wide.py's tensor-core kernel, one wide
MMA per K step, with float16 weights and x and float32 sums: on an H200 an 8B draft's tree level
of 8-128 nodes took 10.8-15.7 ms there against 16.6-24.5 through a float16 variant of this
module's per-slot kernel.

`exact=True` (precision "exact") runs this module's per-slot kernel: weights and x stay float32
and the tile products are IEEE float32 (no TF32), as the exact GEMV's are, so a tree pass rounds
like the decode steps it verifies up to summation order. On the CUDA cores, not the tensor
cores: the reference, not the fast path. The code is expanded with pack.py's mantissa trick,
w = a*f + b (see gemv.py), instead of (q - OFF)*s - t.

Tiles: a program owns BN rows and walks a range of K in steps of NU units of 32; per step it
loads the [BN, NU*LO] code words once and, for each of a word's 32/LO slots, expands one
[BN, NU*LO] weight tile and multiplies it by the matching [NU*LO, M_PAD] tile of x (element
u*32 + j*LO + w of slot j, lane w: the plane layout of pack.py). SPLIT > 1 splits K across
programs (for N too small to fill the SMs) into float32 partials, summed in a fixed order:
results do not depend on scheduling.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .gemv import _bits_to, _scale_min, _sm_count
from .pack import FLOAT_DTYPES, PackedWeight, sm_width
from .qgemm_wide import qgemm_wide
from .splitk import (finish, format_constants, in_row_blocks, outputs, planes,
                     split_units)

MAX_M = 128  # rows of x this kernel takes (M_PAD up to 128 keeps the accumulator in registers)
# From this many rows the int8-activation GEMV (precision "fast") hands over to this kernel
# (weights.linear.QuantLinear). On an H200, gate_up 28672x4096 Q4_K: that GEMV took 105 us at
# 4 rows and 389 at 8 (its rows unroll), where a tensor-core GEMM took ~140 us for anything up
# to 32 rows. The exact float GEMV keeps its 8 rows (kernels.matmul): 206 us at 8, as fast as
# the tensor-core GEMM there
MIN_M = 5
# precision "exact" multiplies at most this many rows of x per launch, and more in row blocks
# that each read the whole weight: its float32 tile products run on the CUDA cores, unrolled
# for every slot of a code word, and the 128-row variant (M_PAD 128) stalls ptxas: the default
# model's greedy test in tests/gpu (a 100+-token exact prefill) did not finish in 430 s, and
# in a second run was still in ptxas for it at 110 s (H100, Triton 3.6). 32 rows is the
# smallest variant (m_pad), the one a tree pass of up to 32 nodes compiles anyway, so the exact
# kernel compiles once per format, its unrolled loop body an eighth of the 128-row one's
EXACT_MAX_M = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _qgemm_kernel(xt_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, y_ptr,
                  M, N, NUT, units_per_split, stride_ym, stride_ys,
                  LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                  KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                  SM: tl.constexpr, M_PAD: tl.constexpr,
                  BN: tl.constexpr, NU: tl.constexpr, WDT: tl.constexpr, IEEE: tl.constexpr):
    """xt: x in slot order (slot_order), so that each [NU*LO, M] tile is one contiguous block."""
    NJ: tl.constexpr = 32 // LO  # slots per word
    SPU: tl.constexpr = 32 // G  # scale groups per unit of 32
    JPS: tl.constexpr = NJ // SPU  # slots per scale group
    B: tl.constexpr = LO + HI
    MANT: tl.constexpr = 23 - B
    P: tl.constexpr = SPU * (2 if HAS_MIN else 1)
    NUL: tl.constexpr = NU * LO
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    r2 = rows[:, None]
    u_begin = tl.program_id(1) * units_per_split
    u_end = tl.minimum(u_begin + units_per_split, NUT)
    cols = tl.arange(0, NUL)
    offs_m = tl.arange(0, M_PAD)
    xmask = (offs_m < M)[None, :]
    xtile = cols[:, None] * M + offs_m[None, :]  # [NUL, M_PAD] within one slot's block
    acc = tl.zeros([BN, M_PAD], dtype=tl.float32)
    for u0 in range(u_begin, u_end, NU):
        uc = u0 + cols // LO  # [NUL] the unit of each column
        qmask = rmask[:, None] & (uc < u_end)[None, :]
        qoff = r2 * (NUT * LO) + u0 * LO + cols[None, :]  # a unit's LO words are contiguous
        words = tl.load(lo_ptr + qoff, mask=qmask, other=0)
        if HI > 0:
            hw = tl.load(hi_ptr + qoff, mask=qmask, other=0).to(tl.int32)
        xstep = xt_ptr + (u0 // NU) * (NJ * NUL * M)
        for s in tl.static_range(SPU):
            scale, tmin = _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, uc[None, :],
                                     qmask, NUT, s, SPU, P, KQUANT, HAS_MIN, PACKED_SCMN, SM,
                                     False)
            a = scale * (1 << B)  # w = a*f + b for f = 1 + q/2^B (gemv.py's mantissa trick)
            b = -scale * ((1 << B) + OFF) - tmin
            for jj in tl.static_range(JPS):
                j = s * JPS + jj
                bits = _bits_to(words, j * LO, LO, MANT) | 0x3F800000
                if HI > 0:
                    bits = bits | _bits_to(hw, j * HI, HI, MANT + LO)
                w = (a * bits.to(tl.float32, bitcast=True) + b).to(WDT)  # [BN, NUL]
                xt = tl.load(xstep + j * (NUL * M) + xtile, mask=xmask, other=0.0)
                if IEEE:
                    acc = tl.dot(w, xt.to(WDT), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, xt.to(WDT), acc)
    ymask = rmask[:, None] & xmask
    yp = y_ptr + tl.program_id(1) * stride_ys + offs_m[None, :] * stride_ym + rows[:, None]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _fuse_scales_kernel(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, N, NUT, SPU: tl.constexpr,
                        P: tl.constexpr, KQUANT: tl.constexpr, HAS_MIN: tl.constexpr,
                        PACKED_SCMN: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr):
    """pack.fuse_scales on the GPU, into a buffer: the same f16 numbers (the kernels' f16
    rounding of the scales equals fuse_scales', tests/gpu/test_kernels.py)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    uu = tl.program_id(1) * NU + tl.arange(0, NU)
    r2 = rows[:, None]
    u2 = uu[None, :]
    mask = (r2 < N) & (u2 < NUT)
    base = sm_ptr + (r2 * NUT + u2) * P
    for s in tl.static_range(SPU):
        scale, tmin = _scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr, r2, u2, mask, NUT, s, SPU,
                                 P, KQUANT, HAS_MIN, PACKED_SCMN, False, True)
        tl.store(base + s, scale.to(tl.float16), mask=mask)
        if HAS_MIN:
            tl.store(base + SPU + s, tmin.to(tl.float16), mask=mask)


def with_fused_scales(packed: PackedWeight, buffer: torch.Tensor | None = None) -> PackedWeight:
    """A weight that keeps its GGUF scale planes for precision="fast" (pack.f16_scales: a
    streamed layer) with its fused plane made now, into `buffer` where it is float16 and
    holds N*K/32*P elements. qgemm multiplies such a weight through the fused kernel, so
    that a streamed layer computes the same bits as its resident, fused copy: the two kernels'
    code differs, and so, on an H200, did their float16 products' sums."""
    spec = packed.spec
    n, nut = packed.rows, packed.cols // 32
    p = sm_width(spec)
    if buffer is None or buffer.dtype != torch.float16 or buffer.numel() < n * nut * p:
        buffer = torch.empty(n * nut * p, device=packed.device, dtype=torch.float16)
    sm = buffer.reshape(-1)[: n * nut * p].view(n, nut, p)
    bn, nu = 16, 64
    dummy = packed.lo
    _fuse_scales_kernel[(triton.cdiv(n, bn), triton.cdiv(nut, nu))](
        packed.d, packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy, sm, n, nut, SPU=32 // spec.group, P=p,
        KQUANT=spec.kquant, HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn, BN=bn, NU=nu,
        num_warps=4)
    return replace(packed, sm=sm, f16_scales=False)


def supports(packed: PackedWeight) -> bool:
    """Quantized formats with integer codes (float weights go to cuBLAS as they are; the
    codebook formats, whose codes index a grid, are dequantized for it too)."""
    return (packed.qtype not in FLOAT_DTYPES and packed.spec is not None
            and packed.spec.int_codes)


def m_pad(m: int) -> int:
    """The accumulator's columns for m rows of x: a power of two, at least 32. The MMA needs
    16; 32 costs half as much in every shape and format of the H200 sweep (gate_up Q4_K 136
    against 254 us, the Q6_K head 633 against 1,020), for the same tiles."""
    return max(32, triton.next_power_of_2(m))


def slot_order(x: torch.Tensor, lo_bits: int, nu: int, dtype: torch.dtype) -> torch.Tensor:
    """x (m, K) as the kernel reads it: for each step of nu units of 32 elements and each slot j
    of pack.py's words, the [nu*LO, m] block of elements u*32 + j*LO + w (unit u, lane w), m
    contiguous; K zero-padded to whole steps (the weight's codes past K are masked to 0)."""
    m, k = x.shape
    step = nu * 32
    if k % step:
        x = torch.nn.functional.pad(x, (0, step - k % step))
    nj = 32 // lo_bits
    xs = x.view(m, -1, nu, nj, lo_bits).permute(1, 3, 2, 4, 0)  # (steps, j, u, w, m)
    return xs.to(dtype).contiguous()


# shared memory the pipeliner may fill with x tiles (of the H200's 227 KiB a block)
_SMEM_FOR_X = 160 << 10


def qgemm_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """Tile sizes for one launch: BN rows per program, NU units of 32 per K step, SPLIT
    programs along K. From a tile sweep on an H200 (float16 products): a slot's
    tile is NU*LO = 32 columns wide up to 32 rows of x and 64 from 64 rows (at 128 rows NU 16
    took gate_up 28672x4096 Q4_K from 410 to 318 us, qkv 6144x4096 from 100 to 83 split 4);
    at 128 rows a weight whose 128-row blocks fill the SMs takes BN 128 with 8 warps (gate_up
    315 us); K is split until the programs fill the SMs twice over, each split keeping at
    least 4 steps (Q4_K 6144x4096 at 16 rows: 68 us split 4 against 96 unsplit)."""
    spec = packed.spec
    n, nut = packed.rows, packed.cols // 32
    mp = m_pad(m)
    nul = 64 if mp >= 64 else 32
    nu = max(nul // spec.lo, 16 // spec.lo, 1)
    sms = _sm_count(packed.device)
    if mp == 128 and -(-n // 128) >= sms:
        return {"BN": 128, "NU": nu, "SPLIT": 1, "num_warps": 8}
    bn = 64
    split = 1
    while -(-n // bn) * split < 2 * sms and nut // (split * 2) >= 4 * nu:
        split *= 2
    return {"BN": bn, "NU": nu, "SPLIT": split, "num_warps": 4}


def _stages(nu: int, mp: int, esize: int) -> int:
    """Software-pipelining depth whose x tiles fit the shared memory (Triton's default, 3,
    asked for 276 KiB at 128 rows and 16 units a step)."""
    step_bytes = nu * 32 * mp * esize
    return max(1, min(3, _SMEM_FOR_X // step_bytes))


def qgemm(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None, config: dict[str, int] | None = None,
          scale_buffer: torch.Tensor | None = None, exact: bool = False) -> torch.Tensor:
    """y = x @ W^T for x (m, K), 1 <= m <= MAX_M, W quantized -> (m, N) in out_dtype (default
    x's dtype). `config` overrides the tiles (qgemm_config's where exact, else
    qgemm_wide.wide_config's), for tuning and tests. A weight with unfused f16
    scales (a streamed layer at precision="fast") has its fused plane made first, into
    `scale_buffer` if given (see with_fused_scales). exact: float32 weights, x and products
    (see the module's docstring)."""
    if x.dim() != 2 or x.shape[1] != packed.cols:
        raise ValueError(f"x must be (m, {packed.cols}), got {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"qgemm takes 1..{MAX_M} rows of x, got {m}; use matmul()")
    if not supports(packed):
        raise ValueError(f"qgemm multiplies quantized weights, not {packed.qtype.name}")
    if exact and m > EXACT_MAX_M:
        def launch(xb: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
            return qgemm(xb, packed, out=into, out_dtype=out_dtype or x.dtype, config=config,
                         scale_buffer=scale_buffer, exact=True)

        return in_row_blocks(launch, x, EXACT_MAX_M, out, packed.rows, out_dtype or x.dtype)
    n, nut = packed.rows, packed.cols // 32
    out_dtype = out_dtype or x.dtype
    spec = packed.spec
    if packed.f16_scales and packed.sm is None and sm_width(spec) > 0:
        packed = with_fused_scales(packed, scale_buffer)
    if not exact:
        return qgemm_wide(x, packed, out, out_dtype, config)
    cfg = dict(config) if config else qgemm_config(packed, m)
    if not config:
        # float32 tiles take twice the registers: the 128-row blocks' 8 warps would spill
        cfg.update(BN=min(cfg["BN"], 64), num_warps=4)
    warps = cfg.pop("num_warps", 4)
    split = cfg.pop("SPLIT", 1)
    nu = cfg["NU"] = max(cfg["NU"], 16 // spec.lo)  # the MMA's K: 16 at least
    wdt = torch.float32
    stages = cfg.pop("num_stages", None) or _stages(nu, m_pad(m), wdt.itemsize)
    units, split = split_units(nut, nu, split)
    xt = slot_order(x, spec.lo, nu, wdt)
    part = outputs(m, n, split, out, out_dtype, x.device)
    _qgemm_kernel[(triton.cdiv(n, cfg["BN"]), split)](
        xt, *planes(packed), part,
        m, n, nut, units, part.stride(-2), part.stride(0) if split > 1 else 0,
        **format_constants(packed), M_PAD=m_pad(m),
        WDT=tl.float32, IEEE=not _INTERPRET, num_warps=warps, num_stages=stages, **cfg)
    return finish(part, split, out, out_dtype)
