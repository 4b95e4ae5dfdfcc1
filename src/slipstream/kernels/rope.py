"""RoPE plus the KV-cache write for one decode token, in one launch.

The unfused decode step spends ~8 small kernels per layer here (complex multiply, reshapes, casts,
two `index_copy_`). This kernel reads the fused projection row once and writes the rotated q, the
rotated k into its cache slot and the raw v into its cache slot.

The position is read from device memory (`pos`, a (1,) int64 tensor), never from the host, so a
CUDA graph captured once replays correctly at any position. A position past the cache writes
nothing to it, and one past the cos/sin table leaves q and k unrotated: the caller checks the
context on the host; this only keeps a bad value from scribbling over memory.

Pairings match `slipstream.model.rope.RopeTable`: "normal" rotates (2i, 2i+1), "neox" rotates
(i, i + rope_dim/2); dims past rope_dim pass through unrotated. Math is fp32.

Families that RMS-norm each query and key head before RoPE (Qwen3, Gemma 3: `q_norm` and
`k_norm`, (head_dim,) weights) have the norm done here too, on the head this program already
holds in registers: the unfused form is two norm kernels and a concatenation per layer and token.
The other per-head pieces of the families ride along the same way: a layer without RoPE
(Cohere 2's global layers: `rotate=False`), Llama 4's query temperature (Ministral 3:
`q_temp=(scale, floor)`, q times 1 + scale * log1p(floor(pos / floor)), read from the device's
position like the angles), and an RMSNorm without weight over each value head (Gemma 4:
`v_norm=True`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STYLES = ("normal", "neox")
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rope_cache_kernel(x_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, qn_ptr, kn_ptr,
                       eps, n_heads, n_kv, max_ctx, max_pos,
                       stride_cos, stride_q, stride_kh, stride_ks, stride_vh, stride_vs,
                       temp_scale, temp_floor,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                       NEOX: tl.constexpr, PASS_START: tl.constexpr,
                       PASS_BLOCK: tl.constexpr, HAS_PASS: tl.constexpr,
                       DIM_BLOCK: tl.constexpr, QK_NORM: tl.constexpr, RING: tl.constexpr,
                       ROTATE: tl.constexpr, Q_TEMP: tl.constexpr, V_NORM: tl.constexpr):
    # One program per head of the qkv row: [0, n_heads) q, then n_kv k heads, then n_kv v heads.
    h = tl.program_id(0)
    pos = tl.load(pos_ptr)
    # a ring (model.ring) holds position pos at pos mod its slots; a full cache at pos
    if RING:
        slot = pos % max_ctx
    else:
        slot = pos
    row = x_ptr + h * HEAD_DIM
    if h < n_heads + n_kv:
        i = tl.arange(0, HALF_BLOCK)
        im = i < HALF
        if NEOX:
            o1 = i
            o2 = i + HALF
        else:
            o1 = 2 * i
            o2 = 2 * i + 1
        x1 = tl.load(row + o1, mask=im, other=0.0).to(tl.float32)
        x2 = tl.load(row + o2, mask=im, other=0.0).to(tl.float32)
        if HAS_PASS or QK_NORM:
            j = PASS_START + tl.arange(0, PASS_BLOCK)
            jm = j < HEAD_DIM
            t = tl.load(row + j, mask=jm, other=0.0).to(tl.float32)  # none without a tail
        if QK_NORM:  # the head's RMSNorm over all its dims, rotated and passed alike
            ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(t * t, axis=0)
            inv = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
            if h < n_heads:
                nw = qn_ptr
            else:
                nw = kn_ptr
            x1 = x1 * inv * tl.load(nw + o1, mask=im, other=0.0).to(tl.float32)
            x2 = x2 * inv * tl.load(nw + o2, mask=im, other=0.0).to(tl.float32)
            t = t * inv * tl.load(nw + j, mask=jm, other=0.0).to(tl.float32)
        if ROTATE:
            # A position past the table reads row 0 (angle 0) instead of out-of-bounds memory.
            p_tab = tl.where(pos < max_pos, pos, 0)
            c = tl.load(cos_ptr + p_tab * stride_cos + i, mask=im, other=1.0)
            s = tl.load(sin_ptr + p_tab * stride_cos + i, mask=im, other=0.0)
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        else:
            y1 = x1
            y2 = x2
        # q and k may differ in dtype (fp32 q, fp16 cache), so each branch stores its own.
        if h < n_heads:
            if Q_TEMP:  # model.llama.attention_temperature, after the rotation as there
                times = tl.floor(pos.to(tl.float32) / temp_floor)
                f = 1.0 + temp_scale * tl.log(1.0 + times)
                y1 = y1 * f
                y2 = y2 * f
                if HAS_PASS:
                    t = t * f
            qd = q_ptr + h * stride_q
            tl.store(qd + o1, y1.to(qd.dtype.element_ty), mask=im)
            tl.store(qd + o2, y2.to(qd.dtype.element_ty), mask=im)
            if HAS_PASS:  # partial rotary: the tail past rope_dim is copied as is
                tl.store(qd + j, t.to(qd.dtype.element_ty), mask=jm)
        elif slot < max_ctx:
            kd = k_ptr + (h - n_heads) * stride_kh + slot * stride_ks
            tl.store(kd + o1, y1.to(kd.dtype.element_ty), mask=im)
            tl.store(kd + o2, y2.to(kd.dtype.element_ty), mask=im)
            if HAS_PASS:
                tl.store(kd + j, t.to(kd.dtype.element_ty), mask=jm)
    elif slot < max_ctx:
        d = tl.arange(0, DIM_BLOCK)
        dm = d < HEAD_DIM
        t = tl.load(row + d, mask=dm, other=0.0)
        if V_NORM:  # model.llama.unit_rms_norm, in fp32
            tf = t.to(tl.float32)
            t = tf * (1.0 / tl.sqrt(tl.sum(tf * tf, axis=0) / HEAD_DIM + eps))
        dst = v_ptr + (h - n_heads - n_kv) * stride_vh + slot * stride_vs
        tl.store(dst + d, t.to(dst.dtype.element_ty), mask=dm)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                   n_heads: int, n_kv_heads: int, head_dim: int, style: str,
                   rope_dim: int | None = None, q_dtype: torch.dtype | None = None,
                   out: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                   ring: bool = False, rotate: bool = True,
                   q_temp: tuple[float, float] | None = None,
                   v_norm: bool = False) -> torch.Tensor:
    """Rotate q and k of one token, write k and v into the caches at slot `pos`, return q.

    qkv: (1, (n_heads + 2 * n_kv_heads) * head_dim) or (n_heads + 2 * n_kv_heads, head_dim),
        rows q heads, then k heads, then v heads (the fused projection output); any float dtype.
    cos, sin: (max_pos, rope_dim / 2) float32 tables (`RopeTable.cos` / `.sin`).
    k_cache, v_cache: (n_kv_heads, max_ctx, head_dim), last dim contiguous; written in place.
    pos: (1,) int64 on the device; read by the kernel, never on the host.
    rope_dim: rotated dims per head (default head_dim); the rest pass through.
    q_norm, k_norm: (head_dim,) RMSNorm weights applied to each query / key head (over all its
        dims, in fp32, with `eps`) before the rotation; both or neither.
    ring: the caches are a sliding-window layer's ring (model.ring): the token's key and value
        go to slot pos mod max_ctx.
    rotate: False for a layer without RoPE (q and k pass unrotated, normed where asked).
    q_temp: (scale, floor) of Llama 4's query temperature, or None.
    v_norm: each value head RMS-normed without a weight (with `eps`) before its cache write.
    Returns q rotated, (n_heads, head_dim), in q_dtype (default: the cache dtype), or in `out`.
    """
    if style not in STYLES:
        raise ValueError(f"unknown rope style {style!r}; expected one of {STYLES}")
    rope_dim = head_dim if rope_dim is None else rope_dim
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"rope_dim must be even and in (0, {head_dim}], got {rope_dim}")
    rows = n_heads + 2 * n_kv_heads
    if qkv.numel() != rows * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} must hold one token of {rows} heads x "
                         f"{head_dim} (only T=1 is supported)")
    if not qkv.is_contiguous():
        qkv = qkv.contiguous()
    half = rope_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != half or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (max_pos, {half}) float32 with a contiguous last "
                             f"dim, got {tuple(t.shape)} {t.dtype}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must match")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[0] != n_kv_heads or c.shape[2] != head_dim \
                or c.stride(2) != 1:
            raise ValueError(f"{name} must be ({n_kv_heads}, max_ctx, {head_dim}) with a "
                             f"contiguous last dim, got {tuple(c.shape)}")
        if c.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} dtype {c.dtype} is not one of {CACHE_DTYPES}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if pos.numel() != 1 or pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"pos must be a (1,) int64 tensor, got {tuple(pos.shape)} {pos.dtype}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together: both or neither")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None and (t.shape != (head_dim,) or t.device != qkv.device):
            raise ValueError(f"{name} must be ({head_dim},) on {qkv.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if out is None:
        out = torch.empty(n_heads, head_dim, device=qkv.device,
                          dtype=k_cache.dtype if q_dtype is None else q_dtype)
    elif out.shape != (n_heads, head_dim) or out.stride(1) != 1:
        raise ValueError(f"out must be ({n_heads}, {head_dim}) with a contiguous last dim, "
                         f"got {tuple(out.shape)}")
    if q_temp is not None and not q_temp[1] > 0:
        raise ValueError(f"q_temp's floor must be > 0, got {q_temp[1]}")
    pass_block = triton.next_power_of_2(max(head_dim - rope_dim, 1))
    norm = q_norm is not None
    _rope_cache_kernel[(rows,)](
        qkv, cos, sin, out, k_cache, v_cache, pos, q_norm if norm else qkv,
        k_norm if norm else qkv, eps, n_heads, n_kv_heads, k_cache.shape[1], cos.shape[0],
        cos.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        float(q_temp[0]) if q_temp else 0.0, float(q_temp[1]) if q_temp else 1.0,
        HEAD_DIM=head_dim, HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        NEOX=style == "neox", PASS_START=rope_dim, PASS_BLOCK=pass_block,
        HAS_PASS=rope_dim < head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        QK_NORM=norm, RING=ring, ROTATE=rotate, Q_TEMP=q_temp is not None, V_NORM=v_norm,
        num_warps=1)
    return out
