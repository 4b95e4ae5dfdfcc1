"""The Llama-shaped decoder block (Llama 1/2/3, Mistral, SmolLM, Qwen2 with QKV bias)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .rope import RopeTable

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


def _use_fused_decode(k_cache: torch.Tensor) -> bool:
    """The fused decode kernels serve CUDA fp16/bf16 caches: RoPE + cache write, split-K
    attention (tests/gpu/test_engine.py checks them against the CPU engine on the H200).
    SLIPSTREAM_FUSED_DECODE=0 falls back to the torch ops, for comparison."""
    return (k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16)
            and _cuda_kernels() and os.environ.get("SLIPSTREAM_FUSED_DECODE", "1") == "1")


@functools.lru_cache(maxsize=None)
def _cuda_kernels() -> bool:
    from .. import kernels

    return kernels.available()

# (T, in) -> (T, out), knowing its own format; `linear(x, residual=r)` returns r + linear(x),
# which the GPU kernels fold into the matmul's epilogue.
Linear = Callable[..., torch.Tensor]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (hidden,)
    attn_q: Linear | None  # hidden -> n_heads * head_dim (None when only attn_qkv exists)
    attn_k: Linear | None  # hidden -> n_kv_heads * head_dim
    attn_v: Linear | None  # hidden -> n_kv_heads * head_dim
    attn_output: Linear  # n_heads * head_dim -> hidden
    ffn_norm: torch.Tensor  # (hidden,)
    ffn_gate: Linear | None  # hidden -> ffn (None when only ffn_gate_up exists)
    ffn_up: Linear | None  # hidden -> ffn
    ffn_down: Linear  # ffn -> hidden
    # Optional fused projections, set by loaders whose format allows concatenating rows:
    # one call instead of three (or two) matters when each call is a small memory-bound GEMV.
    attn_qkv: Linear | None = None  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim
    ffn_gate_up: Linear | None = None  # hidden -> 2 * ffn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as one kernel where possible: per-op overhead dominates
    batch-1 decode, on CPU and inside a CUDA graph alike."""
    if x.is_cuda and _cuda_kernels():
        from .. import kernels

        return kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _HAS_RMS_NORM:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


@dataclass(frozen=True)
class Step:
    """Which cache slots a forward step writes and reads.

    Eager steps know their start position on the host: keys go to start .. start + T - 1 and
    attention reads the first start + T slots. Graph-captured decode steps must not bake the
    position in, so they carry it only in `positions` (a device tensor), write with index_copy_
    and read a fixed `span` of slots, masking those past the position.
    """

    positions: torch.Tensor  # (T,) long, on the device
    span: int  # cache slots attention reads
    start: int | None = None  # host-known start position (eager), None in a captured graph
    mask: torch.Tensor | None = None  # (group * T, span) bool from `causal_mask`, or None


def causal_mask(positions: torch.Tensor, span: int, group: int) -> torch.Tensor:
    """(group * T, span) bool, True where query row may attend: key slot <= its position.

    Rows are ordered (group, T) to match `attention`'s folding of query heads. Built once per
    forward step and shared by every layer."""
    keys = torch.arange(span, device=positions.device)
    return (keys[None, :] <= positions[:, None]).repeat(group, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
              group: int) -> torch.Tensor:
    """Causal GQA attention of T new queries over the first `step.span` cached keys.

    q: (T, n_heads, d); k, v: (n_kv_heads, span, d). Returns (T, n_heads * d).
    The query heads sharing one KV head are folded into the row dimension so K and V are
    never copied per query head: (n_kv, group * T, d) against (n_kv, span, d).
    """
    T, n_heads, d = q.shape
    n_kv, S, _ = k.shape
    if T == 1 and step.start is not None:  # eager decode: no mask, no permutes
        qg = q.view(n_kv, group, d)
        if q.device.type == "cpu":
            # Two bmm and a softmax: CPU SDPA costs ~2.5x more at these tiny shapes, and
            # decode on CPU is bound by per-op overhead.
            scores = torch.bmm(qg * (1.0 / math.sqrt(d)), k.transpose(1, 2))
            out = torch.bmm(torch.softmax(scores, dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(qg, k, v, scale=1.0 / math.sqrt(d))
        return out.reshape(1, n_heads * d)
    qg = q.permute(1, 0, 2).reshape(n_kv, group * T, d)  # rows ordered (group, T)
    mask = step.mask
    if mask is None and (T > 1 or step.start is None):
        mask = causal_mask(step.positions, S, group)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
    return out.reshape(n_heads, T, d).permute(1, 0, 2).reshape(T, n_heads * d)


def _normed(linear: Linear, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """linear(rms_norm(x)), through the linear's fused norm+matmul when it has one."""
    fused = getattr(linear, "norm_matmul", None)
    if fused is not None:
        return fused(x, weight, eps)
    return linear(rms_norm(x, weight, eps))


def block_forward(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """One decoder block on x (T, hidden) at the positions `step` names.

    cos_sin: `rope.angles(step.positions)`, computed once per forward and shared by all layers.
    k_cache, v_cache: this layer's (n_kv_heads, max_ctx, head_dim) slices; the new keys and
    values are written in place.
    """
    T = x.shape[0]
    n_qk = cfg.n_heads + cfg.n_kv_heads
    if T == 1 and step.start is None and _use_fused_decode(k_cache):
        # Captured CUDA decode: RoPE, the cache write and split-K attention in three kernels
        # that read the position from device memory, instead of a dozen small ops.
        from .. import kernels

        if w.attn_qkv is not None:
            qkv = _normed(w.attn_qkv, x, w.attn_norm, cfg.norm_eps)
        else:
            h = rms_norm(x, w.attn_norm, cfg.norm_eps)
            qkv = torch.cat((w.attn_q(h), w.attn_k(h), w.attn_v(h)), dim=-1)
        q = kernels.rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, step.positions,
                                   cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope.style,
                                   rope_dim=rope.rope_dim)
        attn = kernels.decode_attention(q, k_cache, v_cache, step.positions,
                                        1.0 / math.sqrt(cfg.head_dim), cfg.gqa_group,
                                        span=step.span)
        return _ffn(cfg, w, w.attn_output(attn.reshape(1, -1), residual=x))
    if w.attn_qkv is not None:
        qkv = _normed(w.attn_qkv, x, w.attn_norm, cfg.norm_eps).view(
            T, n_qk + cfg.n_kv_heads, cfg.head_dim)
        qk, v = qkv[:, :n_qk], qkv[:, n_qk:]
    else:
        h = rms_norm(x, w.attn_norm, cfg.norm_eps)
        qk = torch.cat((w.attn_q(h), w.attn_k(h)), dim=-1).view(T, n_qk, cfg.head_dim)
        v = w.attn_v(h).view(T, cfg.n_kv_heads, cfg.head_dim)
    qk = rope.apply(qk, cos_sin)  # q and k heads rotate together: one pass, same angles
    q, k = qk[:, :cfg.n_heads], qk[:, cfg.n_heads:]
    k_new, v_new = k.transpose(0, 1), v.transpose(0, 1)  # (n_kv, T, d); copy_ casts
    if step.start is not None:
        k_cache[:, step.start:step.start + T] = k_new
        v_cache[:, step.start:step.start + T] = v_new
    else:
        k_cache.index_copy_(1, step.positions, k_new.to(k_cache.dtype))
        v_cache.index_copy_(1, step.positions, v_new.to(v_cache.dtype))
    attn = attention(q.to(k_cache.dtype), k_cache[:, :step.span], v_cache[:, :step.span], step,
                     cfg.gqa_group)
    return _ffn(cfg, w, w.attn_output(attn, residual=x))


def _ffn(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU half of the block, with its residual."""
    if w.ffn_gate_up is not None:
        gate_up = _normed(w.ffn_gate_up, x, w.ffn_norm, cfg.norm_eps)
        glu = getattr(w.ffn_down, "glu_matmul", None)
        if glu is not None:
            return glu(gate_up, residual=x)
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        h = rms_norm(x, w.ffn_norm, cfg.norm_eps)
        gate, up = w.ffn_gate(h), w.ffn_up(h)
    return w.ffn_down(F.silu(gate) * up, residual=x)
