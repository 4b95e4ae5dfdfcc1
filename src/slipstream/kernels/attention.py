"""Split-K ("flash-decoding") attention for one query position over the KV cache.

Decode attention at batch 1 reads the whole cache once and does almost no math, so it is bound by
memory bandwidth and by how many SMs take part. The cache slots [0, span) are cut into a fixed
number of splits; each program takes one KV head, up to G_BLOCK of the query heads that share it
(GQA: query head h uses KV head h // group, so K and V are read once per group) and one split, and
runs an online softmax over it. A second small kernel combines the splits by their log-sum-exp.

The position is read from device memory, and the grid depends only on `span` (a host bound), so
one captured CUDA graph serves every position below span: splits that start past the position do
no work and are left out of the combine. Slots past the position are masked and never loaded.

A sliding-window layer (`window` > 0: Gemma 3's local layers, Cohere 2's) reads only the slots
of the last `window` positions: the splits cut [lo, lo + min(span, window)) with lo = pos + 1 -
window (or 0) computed on the device, so the launch still depends only on host bounds and a
1024-slot window over a 32k context reads 1024 slots, not 32k. Such a layer's cache may be a
ring shorter than the context (model.ring): linear slot n is read at n mod the cache's slot
count, in linear order, so a ring gives the bits a full cache gives.

Numerics: q and the probabilities go through tensor cores in the cache dtype (fp16/bf16); scores,
softmax statistics and accumulators are fp32.

Block sizes come from offline sm_90 compiles (registers, spills), not from timings on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float16, torch.bfloat16)
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, po_ptr, plse_ptr, qk_scale, group, span, split,
                  window, ring, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                  stride_ph, stride_ps, stride_lh,
                  HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    kvh = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr).to(tl.int32)
    lo = tl.maximum(pos + 1 - window, 0)  # the window's first slot (global: window >= span)
    start = lo + sp * split
    end = tl.minimum(tl.minimum(start + split, pos + 1), span)  # <= start: nothing to do

    g = hb * G_BLOCK + tl.arange(0, G_BLOCK)
    gm = g < group
    heads = kvh * group + g  # (G_BLOCK,) query heads of this KV head
    d = tl.arange(0, D_BLOCK)
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)  # (G_BLOCK, D_BLOCK); padded rows are zero

    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([G_BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_BLOCK], dtype=tl.float32)
    acc = tl.zeros([G_BLOCK, D_BLOCK], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        kv_mask = nm[:, None] & dm[None, :]
        slot = n % ring  # linear slot n sits at n mod the ring (a full cache: at n)
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (G_BLOCK, BLOCK_N), log2 units
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid slot
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if start < end:  # splits past the position store nothing; the combine skips them
        lse = m_i + tl.math.log2(l_i)
        tl.store(plse_ptr + heads * stride_lh + sp, lse, mask=gm)
        o = acc / l_i[:, None]
        tl.store(po_ptr + heads[:, None] * stride_ph + sp * stride_ps + d[None, :], o,
                 mask=gm[:, None] & dm[None, :])


@triton.jit
def _combine_kernel(po_ptr, plse_ptr, pos_ptr, out_ptr, n_splits, span, split, window,
                    stride_ph, stride_ps, stride_lh, stride_oh,
                    HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    h = tl.program_id(0)
    pos = tl.load(pos_ptr).to(tl.int32)
    last = tl.minimum(pos, span - 1)
    lo = tl.maximum(pos + 1 - window, 0)
    n_valid = tl.minimum((last - lo) // split + 1, n_splits)  # splits that saw a slot
    s = tl.arange(0, S_BLOCK)
    sm = s < n_valid
    lse = tl.load(plse_ptr + h * stride_lh + s, mask=sm, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, axis=0))  # masked splits weigh 0; split 0 is always live
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, D_BLOCK)
    dm = d < HEAD_DIM
    o = tl.load(po_ptr + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=sm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: an H200's count, so the plan matches the GPU's
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def plan(span: int, n_kv: int, group: int, head_dim: int, n_sms: int = 132
         ) -> tuple[int, int, int, int, int]:
    """(block_n, g_block, split, n_splits, num_warps) for a launch over `span` slots.

    Tiles of K and V are 16 KiB each in fp16 for d 64 and 128 (sm_90, 8 warps: ~200 registers,
    no spills; 4 warps spill). G_BLOCK is 16, tl.dot's smallest M; a group above 16 takes
    several head blocks, each reading K and V. Splits: as many as keep one wave of programs
    (one per SM) without starting a second, never less than one tile each, at most MAX_SPLITS
    (the combine keeps all of a head's partials in registers)."""
    block_n = 64 if head_dim > 64 else 128
    g_block = 16
    tiles = triton.cdiv(span, block_n)
    programs = n_kv * triton.cdiv(group, g_block)
    want = max(1, min(tiles, MAX_SPLITS, n_sms // programs))
    tiles_per_split = triton.cdiv(tiles, want)
    n_splits = triton.cdiv(tiles, tiles_per_split)
    return block_n, g_block, tiles_per_split * block_n, n_splits, 8


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pos: torch.Tensor, scale: float, group: int, span: int | None = None,
                     out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query position over cache slots 0..pos (with a
    window, over the slots of the last `window` positions only: max(0, pos + 1 - window)..pos).

    q: (n_heads, head_dim) or (1, n_heads * head_dim), n_heads = n_kv * group; any float dtype
        (it is rounded to the cache dtype for the dot products).
    k_cache, v_cache: (n_kv, slots, head_dim) fp16/bf16, last dim contiguous: the whole
        context, or with a window, a ring of at least `window` slots holding linear slot n at
        n mod slots (model.ring).
    pos: (1,) int64 on the device, the position of the query (its key is already at slot pos,
        mod the ring).
    span: host bound on pos + 1 (default: the slots); the launch shape depends only on it, so
        a captured graph serves every pos < span. Linear slots at or past span are never read.
    window: a sliding-window layer's width (0: global attention).
    Returns (n_heads, head_dim) in q's dtype (or writes `out`, same shape).
    """
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"must both be (n_kv, max_ctx, head_dim)")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must both be one of {CACHE_DTYPES}, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("cache last dim must be contiguous")
    n_kv, max_ctx, head_dim = k_cache.shape
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    n_heads = n_kv * group
    if q.numel() != n_heads * head_dim:
        raise ValueError(f"q {tuple(q.shape)} must hold {n_heads} heads x {head_dim} "
                         f"({n_kv} KV heads x group {group}), one position")
    q = q.reshape(n_heads, head_dim)
    if q.stride(1) != 1:
        q = q.contiguous()
    span = max_ctx if span is None else span
    if span < 1 or (not window and span > max_ctx):
        raise ValueError(f"span must be in [1, {max_ctx}], got {span}")
    if window > max_ctx and span > max_ctx:
        raise ValueError(f"a ring of {max_ctx} slots cannot hold a window of {window}")
    if pos.numel() != 1 or pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"pos must be a (1,) int64 tensor, got {tuple(pos.shape)} {pos.dtype}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: global attention), got {window}")
    if out is None:
        out = torch.empty(n_heads, head_dim, device=q.device, dtype=q.dtype)
    elif out.shape != (n_heads, head_dim) or out.stride(1) != 1:
        raise ValueError(f"out must be ({n_heads}, {head_dim}) with a contiguous last dim, "
                         f"got {tuple(out.shape)}")

    n_sms = _num_sms(q.device)
    # the splits cover the slots one query can read: its window, or the whole span
    reach = min(span, window) if window else span
    window = window or span  # a global layer's "window" holds every slot it may read
    block_n, g_block, split, n_splits, warps = plan(reach, n_kv, group, head_dim, n_sms)
    d_block = max(16, triton.next_power_of_2(head_dim))
    # Partial outputs, normalised per split, and their log2-sum-exp; fp32.
    part_o = torch.empty(n_heads, n_splits, head_dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(n_heads, n_splits, device=q.device, dtype=torch.float32)
    _split_kernel[(n_kv, triton.cdiv(group, g_block), n_splits)](
        q, k_cache, v_cache, pos, part_o, part_lse, scale * _LOG2E, group, span, split,
        window, max_ctx, q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        HEAD_DIM=head_dim, D_BLOCK=d_block, G_BLOCK=g_block, BLOCK_N=block_n, num_warps=warps)
    _combine_kernel[(n_heads,)](
        part_o, part_lse, pos, out, n_splits, span, split, window,
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0),
        HEAD_DIM=head_dim, D_BLOCK=d_block,
        S_BLOCK=max(2, triton.next_power_of_2(n_splits)), num_warps=4)
    return out


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               pos: int, scale: float, group: int, window: int = 0
                               ) -> torch.Tensor:
    """The oracle: plain fp64 softmax attention over slots 0..pos (host int), or the window's
    last slots (of a ring: linear slot n at n mod its slots), (n_heads, d)."""
    n_kv, slots, d = k_cache.shape
    lo = max(0, pos + 1 - window) if window else 0
    qg = q.reshape(n_kv, group, d).double()
    held = torch.arange(lo, pos + 1, device=k_cache.device) % slots  # a ring's slots
    k = k_cache[:, held].double()
    v = v_cache[:, held].double()
    p = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)
    return (p @ v).reshape(n_kv * group, d)


__all__ = ["MAX_SPLITS", "decode_attention", "plan", "reference_decode_attention"]
