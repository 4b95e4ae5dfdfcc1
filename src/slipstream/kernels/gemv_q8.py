"""Decode GEMV with int8 activations: y = x @ W^T + r, for 1..8 rows of x, W in a GGUF format.

Why: the fp32 GEMV in gemv.py is bound by instructions, not by HBM. Unpacking each code to a
float and multiplying it costs ~4 instructions per weight, so Q4_K streams at ~1 TB/s of the
H200's ~4.3 TB/s. Here x is first quantized to int8 per block of 32 elements (one fp32 scale per
block, as llama.cpp's q8_1), and the weight codes are multiplied four at a time, as bytes, by
`dp4a` (a 4-way int8 dot product with int32 accumulation):

* A 32-bit word of the lo plane (pack.py) holds 32/LO codes. One shift and one AND yield four
  codes, one per byte (byte b holds slot NE*b + e of the word, for extraction e < NE = 8/LO),
  so a Q4 word costs two dp4a and about three integer ops for its eight weights.
* x is stored so that those four bytes meet their activations as one word: the quantized block
  is written as 8 words, word k holding the bytes of elements k, k+8, k+16, k+24. Extraction e
  of lane w then pairs with word e*LO + w, for every LO (2, 4 or 8).
* High bits (Q5_*, Q3_K, Q6_K) are spread once per word from their plane into byte positions
  (two shift-and-mask steps) and OR-ed onto each extraction.
* 16-element scale groups (Q2_K, Q3_K, Q6_K) take two dp4a per word against x with the other
  half's bytes masked off: bytes 0-1 of an x word are elements 0-15 of the block, bytes 2-3 are
  16-31.

Per group g the integer dot D = sum(q * xq) gives sum(w * x) ~= s*xs*D - (s*OFF + t)*xs*sum(xq)
for w = s*(q - OFF) - t; sum(xq) per half-block comes with the quantized x. Only x is rounded
(to 8 bits, relative error <= 1/254 of each block's max), so this serves precision="fast"; the
fp32 kernels in gemv.py stay the exact path the CPU is checked against.

Under TRITON_INTERPRET=1 (CPU CI), dp4a is emulated with shifts, so the same kernel logic runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gemv import MAX_M, _group_scale_min, _m_pad, check_routed, expert_rows
from .pack import FLOAT_DTYPES, PackedWeight, sm_width

QK = 32  # activation elements per int8 block (one scale), and elements per unit of pack.py
GLU_ACTS = ("silu", "gelu_tanh")  # the gated FFN activations quantize_x forms: SwiGLU, GeGLU


# Triton's CPU interpreter (CI) cannot run inline PTX: there dp4a is emulated
_USE_ASM = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + sum over the four bytes of a (unsigned) times those of b (signed); int32."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c
        for k in tl.static_range(4):
            r += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return r


@triton.jit
def _quantize_store(x, row, uu, umask, xq_ptr, xm_ptr, NUT):
    """x [BU, 4, 8] fp32 (element b*8 + k of each block of 32) -> int8 codes (round half away
    from zero of x * 127/amax, in fp32) stored as 8 words per block (word k = bytes of elements
    k, k+8, k+16, k+24), and per block 4 int32 of metadata: the scale amax/127 (its fp32 bits),
    the code sums of elements 0-15 and 16-31, and of all 32 (one 16-byte load in the GEMV)."""
    b3 = tl.arange(0, 4)[None, :, None]
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [BU]
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    v = x * inv[:, None, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)  # [-127, 127]
    # bytes 0-2 as unsigned fields, byte 3 signed: the sum is the word, with no int32 overflow
    fields = tl.where(b3 == 3, q << 24, (q & 0xFF) << (b3 * 8))
    words = tl.sum(fields, axis=1)  # [BU, 8]
    tl.store(xq_ptr + row * (NUT * 8) + uu[:, None] * 8 + tl.arange(0, 8)[None, :], words,
             mask=umask[:, None])
    qsum = tl.sum(q, axis=2)  # [BU, 4]: elements b*8 .. b*8+7
    first = tl.arange(0, 4)[None, :] < 2
    h0 = tl.sum(tl.where(first, qsum, 0), axis=1)
    h1 = tl.sum(tl.where(first, 0, qsum), axis=1)
    meta = xm_ptr + (row * NUT + uu) * 4
    tl.store(meta, (amax / 127.0).to(tl.int32, bitcast=True), mask=umask)
    tl.store(meta + 1, h0, mask=umask)
    tl.store(meta + 2, h1, mask=umask)
    tl.store(meta + 3, h0 + h1, mask=umask)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, xm_ptr, NUT, stride_xm, F, GLU: tl.constexpr,
                       GELU: tl.constexpr, BU: tl.constexpr):
    """BU blocks of one row of x; with GLU, of silu(x[:, :F]) * x[:, F:] (SwiGLU's product,
    so the FFN's down projection needs no separate elementwise kernels), or with GELU too of
    gelu_tanh(x[:, :F]) * x[:, F:] (GeGLU: Gemma)."""
    row = tl.program_id(0)
    uu = tl.program_id(1) * BU + tl.arange(0, BU)
    umask = uu < NUT
    offs = row * stride_xm + uu[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + \
        tl.arange(0, 8)[None, None, :]
    x = tl.load(x_ptr + offs, mask=umask[:, None, None], other=0.0).to(tl.float32)
    if GLU:
        up = tl.load(x_ptr + F + offs, mask=umask[:, None, None], other=0.0).to(tl.float32)
        if GELU:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            u2 = 1.5957691216057308 * (x + 0.044715 * x * x * x)
            x = x / (1.0 + tl.exp(-u2)) * up
        else:
            x = x / (1.0 + tl.exp(-x)) * up
    _quantize_store(x, row, uu, umask, xq_ptr, xm_ptr, NUT)


@triton.jit
def _rms_norm_q8_kernel(x_ptr, w_ptr, xq_ptr, xm_ptr, NUT, stride_xm, eps,
                        BU: tl.constexpr, CH: tl.constexpr):
    """RMSNorm (fp32 statistics, as kernels.rms_norm) of BU blocks of one row, quantized for
    the GEMV. Every program sums the squares of the whole row itself (from L2: a row is a few
    KiB), so the row spreads over many programs with no second pass; one program per row was
    latency-bound (4.4 us for 4096 wide on the H200, against 2.5 us for quantize_x's grid)."""
    row = tl.program_id(0)
    k = NUT * 32
    acc = tl.zeros([CH], dtype=tl.float32)
    for start in range(0, k, CH):
        c = start + tl.arange(0, CH)
        v = tl.load(x_ptr + row * stride_xm + c, mask=c < k, other=0.0).to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / k + eps)
    uu = tl.program_id(1) * BU + tl.arange(0, BU)
    umask = uu < NUT
    offs = uu[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + \
        tl.arange(0, 8)[None, None, :]
    x = tl.load(x_ptr + row * stride_xm + offs, mask=umask[:, None, None],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=umask[:, None, None], other=0.0).to(tl.float32)
    _quantize_store(x * inv * w, row, uu, umask, xq_ptr, xm_ptr, NUT)


@triton.jit
def _f16_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT, s, SPU: tl.constexpr,
                KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr):
    """(scale, tmin) of sub-group s from the GGUF scale planes, rounded to f16 exactly as
    pack.fuse_scales stores them: d*sc is exact in fp32 (an 11-bit by at most 8-bit product),
    so one round-to-nearest-even to f16 gives the fused plane's bits. A layer then computes the
    same whether its scales are fused (resident) or not (streamed, 10 % fewer bytes)."""
    scale, tmin = _group_scale_min(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, uu, umask2, NUT, s, SPU,
                                   KQUANT, HAS_MIN, PACKED_SCMN)
    scale = scale.to(tl.float16).to(tl.float32)
    if HAS_MIN:
        tmin = tmin.to(tl.float16).to(tl.float32)
    return scale, tmin


@triton.jit
def _gemv_q8_kernel(xq_ptr, xm_ptr, lo_ptr, hi_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, sm_ptr,
                    r_ptr, y_ptr, M, N, NUT, stride_rm, stride_ym, ids_ptr, X_DIV,
                    LO: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
                    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_SCMN: tl.constexpr,
                    SM: tl.constexpr, HAS_RES: tl.constexpr,
                    M_PAD: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr,
                    USE_ASM: tl.constexpr, ROUTED: tl.constexpr = False):
    """SM: per-unit scales come from the fused f16 plane (pack.fuse_scales), P = SPU * (1 +
    HAS_MIN) entries per unit. Otherwise from the GGUF planes: the plain f16 d per unit (Q4_0,
    Q5_0, Q8_0), or d/dmin/sc/mn rounded as fusing rounds them (_f16_scales).
    ROUTED: one routed expert per program_id(1), M = 1 (gemv.gemv_routed)."""
    NE: tl.constexpr = 8 // LO  # extractions per word, four codes (one per byte) each
    SPU: tl.constexpr = 32 // G  # scale groups per unit of 32
    C: tl.constexpr = NE * HI  # high bits that belong to one byte of a lo word
    LOMASK: tl.constexpr = ((1 << LO) - 1) * 0x01010101
    HIMASK: tl.constexpr = (((1 << HI) - 1) << LO) * 0x01010101
    P: tl.constexpr = SPU * (2 if HAS_MIN else 1)
    row0 = 0  # the weight's first plane row (a constant unless routed)
    if ROUTED:  # see gemv.gemv_routed; a quantized x row is NUT * 8 words and NUT * 4 of meta
        p = tl.program_id(1)
        row0 = tl.load(ids_ptr + p).to(tl.int64) * N
        xq_ptr += (p // X_DIV) * (NUT * 8)
        xm_ptr += (p // X_DIV) * (NUT * 4)
        y_ptr += p * stride_ym
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    wrows = row0 + rows  # the rows' planes (an expert's, in a routed launch)
    offs_u = tl.arange(0, NU)
    offs_w = tl.arange(0, LO)
    offs_m = tl.arange(0, M_PAD)
    mmask = offs_m < M
    r3 = wrows[:, None, None]
    w3 = offs_w[None, None, :]
    acc = tl.zeros([M_PAD, BN, NU], dtype=tl.float32)
    for u0 in range(0, NUT, NU):
        uu = u0 + offs_u
        umask = uu < NUT
        qmask = rmask[:, None, None] & umask[None, :, None]
        qoff = r3 * (NUT * LO) + uu[None, :, None] * LO + w3  # [BN, NU, LO]
        words = tl.load(lo_ptr + qoff, mask=qmask, other=0)
        if HI > 0:
            h = tl.load(hi_ptr + qoff, mask=qmask, other=0).to(tl.int32) & ((1 << (4 * C)) - 1)
            # spread: the C high bits of byte b's slots move from bits [C*b, C*b+C) to byte b
            h = (h | (h << (16 - 2 * C))) & (((1 << (2 * C)) - 1) * 0x10001)
            h = (h | (h << (8 - C))) & (((1 << C) - 1) * 0x01010101)
        # per-unit scales [BN, NU]
        umask2 = rmask[:, None] & umask[None, :]
        if SM:
            sm = tl.load(sm_ptr + (r3 * NUT + uu[None, :, None]) * P +
                         tl.arange(0, P)[None, None, :], mask=umask2[:, :, None],
                         other=0.0).to(tl.float32)  # [BN, NU, P]
            if P == 2:
                sa, sb = tl.split(sm)
                if HAS_MIN:
                    s0, t0 = sa, sb
                else:
                    s0, s1 = sa, sb
            else:  # P == 4: (s0, s1, t0, t1) -> pairs (s0, t0), (s1, t1)
                pa, pb = tl.split(tl.reshape(sm, [BN, NU, 2, 2]))
                s0, t0 = tl.split(pa)
                s1, t1 = tl.split(pb)
        elif KQUANT or HAS_MIN:
            r2 = wrows[:, None]
            u2 = uu[None, :]
            s0, t0 = _f16_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, u2, umask2, NUT, 0, SPU,
                                 KQUANT, HAS_MIN, PACKED_SCMN)
            if SPU == 2:
                s1, t1 = _f16_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, r2, u2, umask2, NUT, 1, SPU,
                                     KQUANT, HAS_MIN, PACKED_SCMN)
        else:
            s0 = tl.load(d_ptr + wrows[:, None] * NUT + uu[None, :], mask=umask2,
                         other=0.0).to(tl.float32)
        # One row of x at a time: dp4a's operands are then [BN, NU, LO] tensors with x
        # broadcast over rows only. (Broadcasting the codes over x's rows as well, in one 4-D
        # dp4a, gave results off by ~1e-3 on the H200 for m > 1: the inline asm does not
        # survive two operands broadcast along different axes.) The unpacking below is the
        # same for every row, so the compiler computes it once.
        for mi in tl.static_range(M_PAD):
            xrow = umask & (tl.full([NU], mi, tl.int32) < M)
            xm = tl.load(xm_ptr + (mi * NUT + uu[:, None]) * 4 + tl.arange(0, 4)[None, :],
                         mask=xrow[:, None], other=0)  # [NU, 4]
            xa, xb = tl.split(tl.reshape(xm, [NU, 2, 2]))  # (bits, sum1), (sum0, sum)
            xs_bits, qs1 = tl.split(xa)
            qs0, qs = tl.split(xb)
            xs = xs_bits.to(tl.float32, bitcast=True)[None, :]  # [1, NU]
            xbase = xq_ptr + mi * (NUT * 8) + uu[None, :, None] * 8 + w3  # [1, NU, LO]
            D0 = tl.zeros([BN, NU, LO], dtype=tl.int32)
            if SPU == 2:
                D1 = tl.zeros([BN, NU, LO], dtype=tl.int32)
            for e in tl.static_range(NE):
                if NE == 1:
                    code = words
                else:
                    code = (words >> (e * LO)) & LOMASK
                if HI > 0:
                    if LO >= e * HI:
                        code = code | ((h << (LO - e * HI)) & HIMASK)
                    else:
                        code = code | ((h >> (e * HI - LO)) & HIMASK)
                xw = tl.load(xbase + e * LO, mask=xrow[None, :, None], other=0)  # [1, NU, LO]
                if SPU == 1:
                    D0 = _dp4a(code, tl.broadcast_to(xw, [BN, NU, LO]), D0, USE_ASM)
                else:
                    D0 = _dp4a(code, tl.broadcast_to(xw & 0xFFFF, [BN, NU, LO]), D0, USE_ASM)
                    D1 = _dp4a(code, tl.broadcast_to(xw & -65536, [BN, NU, LO]), D1, USE_ASM)
            # sum(w*x) over a group = s*xs*(D - OFF*sum(xq)) - t*xs*sum(xq): the offset is
            # taken off in integers, exactly, so no large terms cancel in fp32
            if SPU == 1:
                qsg = qs[None, :]
                part = (s0 * xs) * (tl.sum(D0, axis=2) - OFF * qsg).to(tl.float32)
                if HAS_MIN:
                    part -= t0 * (xs * qsg.to(tl.float32))
            else:
                qsg0 = qs0[None, :]
                qsg1 = qs1[None, :]
                part = xs * (s0 * (tl.sum(D0, axis=2) - OFF * qsg0).to(tl.float32) +
                             s1 * (tl.sum(D1, axis=2) - OFF * qsg1).to(tl.float32))
                if HAS_MIN:
                    part -= xs * (t0 * qsg0.to(tl.float32) + t1 * qsg1.to(tl.float32))
            if M_PAD == 1:
                acc += part[None, :, :]
            else:
                acc += tl.where(offs_m[:, None, None] == mi, part[None, :, :], 0.0)
    y = tl.sum(acc, axis=2)  # [M_PAD, BN]
    ymask = mmask[:, None] & rmask[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + offs_m[:, None] * stride_rm + rows[None, :], mask=ymask,
                     other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=ymask)


def _q8_buffers(m: int, nut: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(m, nut * 8, device=device, dtype=torch.int32),
            torch.empty(m, nut, 4, device=device, dtype=torch.int32))


def quantize_x(x: torch.Tensor, glu: bool = False, act: str = "silu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, K), K a multiple of 32 -> (xq int32 (m, K/32*8), meta int32 (m, K/32, 4)) in the
    layout `_gemv_q8_kernel` reads (see `_quantize_store`). glu: x is (m, 2K) [gate | up] and
    act(gate) * up is quantized, act "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    if act not in GLU_ACTS:
        raise ValueError(f"unknown gated activation {act!r}; expected one of {GLU_ACTS}")
    m, k = x.shape
    if glu:
        k //= 2
    if k % QK:
        raise ValueError(f"x's width must be a multiple of {QK}, got {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    nut = k // QK
    xq, xm = _q8_buffers(m, nut, x.device)
    bu = min(64, triton.next_power_of_2(nut))
    _quantize_x_kernel[(m, triton.cdiv(nut, bu))](x, xq, xm, nut, x.stride(0), k, GLU=glu,
                                                  GELU=act == "gelu_tanh", BU=bu, num_warps=4)
    return xq, xm


def rms_norm_q8(x: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_x(rms_norm(x, weight, eps)) in one kernel (statistics in fp32; the normalized
    row is quantized without an intermediate rounding to x's dtype)."""
    m, k = x.shape
    if k % QK or weight.shape != (k,):
        raise ValueError(f"x (m, K) with K a multiple of {QK} and weight (K,) needed, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    nut = k // QK
    xq, xm = _q8_buffers(m, nut, x.device)
    bu = min(64, triton.next_power_of_2(nut))  # as quantize_x
    _rms_norm_q8_kernel[(m, triton.cdiv(nut, bu))](x, weight, xq, xm, nut, x.stride(0), eps,
                                                   BU=bu, CH=1024, num_warps=4)
    return xq, xm


def supports(packed: PackedWeight) -> bool:
    """Quantized formats with integer codes only: float weights have none to feed dp4a, and
    the codebook and i-quant grid formats' codes index a grid (they take gemv.py's float32
    GEMV instead)."""
    return packed.qtype not in FLOAT_DTYPES and packed.spec.int_codes


def gemv_q8_config(packed: PackedWeight, m: int) -> dict[str, int]:
    """Tiles: each program streams BN rows, NU units (NU*LO words, 16-byte vectors per lane) per
    step; ~1 KB of codes per row and step at m = 1, fewer units as m grows (the int32 partial
    sums are [m, BN, NU, LO] registers)."""
    spec = packed.spec
    nut = packed.cols // QK
    mp = _m_pad(m)
    nu = max(4, 256 // spec.lo // mp)
    nu = min(nu, max(4, triton.next_power_of_2(nut)))
    return {"BN": 2, "NU": nu, "num_warps": 4}


def gemv_q8(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None,
            config: dict[str, int] | None = None) -> torch.Tensor:
    """y = x @ W^T (+ residual) for x (m <= 8, K) in any float dtype, W quantized; fp32
    accumulation, x rounded to int8 per block of 32 (see the module docstring)."""
    if x.dim() != 2 or x.shape[1] != packed.cols:
        raise ValueError(f"x must be (m, {packed.cols}), got {tuple(x.shape)}")
    _check(packed, x.shape[0])
    return gemv_q8_quantized(*quantize_x(x), packed, out=out, out_dtype=out_dtype or x.dtype,
                             residual=residual, config=config)


def _check(packed: PackedWeight, m: int) -> None:
    if not supports(packed):
        raise ValueError(f"gemv_q8 needs a quantized weight, got {packed.qtype.name}")
    if packed.sm is None and sm_width(packed.spec) and not packed.f16_scales:
        raise ValueError(f"gemv_q8 needs {packed.qtype.name}'s scales fused (pack.fuse_scales) "
                         f"or marked f16_scales (pack.f16_scales)")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv_q8 takes 1..{MAX_M} rows of x, got {m}")


def gemv_q8_quantized(xq: torch.Tensor, xm: torch.Tensor, packed: PackedWeight,
                      out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                      residual: torch.Tensor | None = None,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    """gemv_q8 on an x already quantized (quantize_x, rms_norm_q8)."""
    m, n = xq.shape[0], packed.rows
    if xq.shape != (m, packed.cols // QK * 8) or xm.shape != (m, packed.cols // QK, 4):
        raise ValueError(f"quantized x of shape {tuple(xq.shape)} does not fit K={packed.cols}")
    _check(packed, m)
    if out is None:
        out = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    if residual is not None:
        if residual.shape != (m, n):
            raise ValueError(f"residual must be ({m}, {n}), got {tuple(residual.shape)}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    spec = packed.spec
    cfg = dict(config or gemv_q8_config(packed, m))
    warps = cfg.pop("num_warps", 4)
    dummy = packed.lo
    _gemv_q8_kernel[(triton.cdiv(n, cfg["BN"]),)](
        xq, xm, packed.lo, packed.hi if packed.hi is not None else dummy,
        packed.d if packed.d is not None else dummy,
        packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy,
        packed.sm if packed.sm is not None else dummy,
        residual if residual is not None else out, out, m, n, packed.cols // QK,
        residual.stride(0) if residual is not None else 0, out.stride(0), dummy, 1,
        LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off, KQUANT=spec.kquant,
        HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn,
        SM=packed.sm is not None, HAS_RES=residual is not None, M_PAD=_m_pad(m),
        USE_ASM=_USE_ASM, num_warps=warps, **cfg)
    return out


def gemv_q8_routed(xq: torch.Tensor, xm: torch.Tensor, packed: PackedWeight,
                   ids: torch.Tensor, n_experts: int, x_div: int = 1,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """gemv_q8_quantized for each routed pair p: y[p] = x[p // x_div] @ W_{ids[p]}^T, with
    `packed` stacking n_experts experts' (N, K) weights (see gemv.gemv_routed) and x
    quantized (quantize_x, rms_norm_q8). Returns (P, N)."""
    n = expert_rows(packed, n_experts)
    nut = packed.cols // QK
    if xq.dim() != 2 or xq.shape[1] != nut * 8 or xm.shape != (xq.shape[0], nut, 4):
        raise ValueError(f"quantized x of shape {tuple(xq.shape)} does not fit K={packed.cols}")
    check_routed(xq.shape[0], ids, x_div)
    _check(packed, 1)
    p = ids.shape[0]
    if out is None:
        out = torch.empty(p, n, device=xq.device, dtype=out_dtype)
    spec = packed.spec
    cfg = dict(gemv_q8_config(packed, 1))
    warps = cfg.pop("num_warps", 4)
    dummy = packed.lo
    _gemv_q8_kernel[(triton.cdiv(n, cfg["BN"]), p)](
        xq, xm, packed.lo, packed.hi if packed.hi is not None else dummy,
        packed.d if packed.d is not None else dummy,
        packed.m if packed.m is not None else dummy,
        packed.sc if packed.sc is not None else dummy,
        packed.mn if packed.mn is not None else dummy,
        packed.sm if packed.sm is not None else dummy,
        out, out, 1, n, nut, 0, out.stride(0), ids, x_div,
        LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off, KQUANT=spec.kquant,
        HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn,
        SM=packed.sm is not None, HAS_RES=False, M_PAD=1,
        USE_ASM=_USE_ASM, ROUTED=True, num_warps=warps, **cfg)
    return out
