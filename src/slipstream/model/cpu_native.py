"""One CPU decode token's layer through the native ops (slipstream.native): four calls around the
four packed matmuls, where the torch ops (model.cpu_decode) make about twenty-five.

    norm -> qkv matmul -> RoPE + cache write + attention -> o matmul
         -> residual + norm -> gate_up matmul -> SwiGLU -> down matmul -> residual

The math is the torch path's (the same roundings to bfloat16 at the same places, the same
float32 residual adds), but sums run in another order, so the bits are not the same:
tests/model/test_cpu_native.py compares the two. Serves layers whose four linears decode
through packed kernels (weights.cpu_packed.PackedDecodeLinear) with no bias past q/k/v, a
float32 cache, and a context up to NATIVE_MAX_SPAN (past it torch's threaded bmm is faster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import native
from ..config import ModelConfig
from .cpu_decode import thread_buffers
from .rope import RopeTable

# Slots attended to: the C attention is single-threaded, and past about 1000 slots torch's
# two-threaded bmm caught up with it on the 2-core machine (a CPU decode token of the default
# model: 8.2 against 11.5 ms at slot 0, 16.8 against 16.0 at slot 1000, session 14).
NATIVE_MAX_SPAN = 1024
Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class NativeLayer:
    """A layer's packed kernels and norm weights, looked up once."""

    qkv: Kernel
    qkv_bias: torch.Tensor | None
    out: Kernel
    gate_up: Kernel
    down: Kernel
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor


def native_layer(w) -> NativeLayer | None:
    """The native form of LayerWeights w, made at its first decode and kept on it; None where
    the layer cannot take it (then w.cpu_native is False, and the torch ops serve it)."""
    nl = w.cpu_native
    if nl is None:
        nl = w.cpu_native = _make(w) or False
    return nl or None


def _make(w) -> NativeLayer | None:
    """(A split FFN, weights.hybrid, is turned away by the caller at every token.)"""
    if native.library() is None or w.ffn_gate_up is None:
        return None
    linears = (w.attn_qkv, w.attn_output, w.ffn_gate_up, w.ffn_down)
    # weights.cpu_packed.PackedDecodeLinear's (looked up by name: the model's math does not
    # import the weight formats)
    ask = [getattr(lin, "one_row_kernel", None) for lin in linears]
    if None in ask:
        return None
    decode = [one_row_kernel() for one_row_kernel in ask]
    if None in decode or any(bias is not None for _, bias in decode[1:]):
        return None
    (qkv, qkv_bias), (out, _), (gate_up, _), (down, _) = decode
    norms = [n.float().contiguous() for n in (w.attn_norm, w.ffn_norm)]
    return NativeLayer(qkv, qkv_bias, out, gate_up, down, *norms)


class _Scratch:
    """One thread's buffers for one model shape: the normed row (a matmul's bfloat16 input),
    the attention's queries and scores, its bfloat16 output, the residual after attention, and
    the SwiGLU row."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, group: int, ffn: int,
                 max_ctx: int):
        self.h = torch.empty(1, hidden, dtype=torch.bfloat16)
        self.work = torch.empty(n_heads * head_dim + group * max_ctx)
        self.attn = torch.empty(1, n_heads * head_dim, dtype=torch.bfloat16)
        self.mid = torch.empty(1, hidden)
        self.act = torch.empty(1, ffn, dtype=torch.bfloat16)
        self.ptrs = tuple(t.data_ptr() for t in (self.h, self.work, self.attn, self.mid,
                                                  self.act))


def serves(x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode_layer takes this token: float32 rows and caches laid out as it reads
    them, and a context short enough for its single-threaded attention."""
    return (pos < NATIVE_MAX_SPAN and x.dtype == torch.float32 and x.is_contiguous()
            and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def decode_layer(cfg: ModelConfig, nl: NativeLayer, x: torch.Tensor,
                 cos_sin: tuple[torch.Tensor, torch.Tensor], pos: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """block_forward of one causal token at slot `pos` (x (1, hidden) float32), writing the
    token's key and value at slot pos of this layer's (n_kv, max_ctx, d) caches."""
    lib = native.library()
    max_ctx = k_cache.shape[1]
    s = thread_buffers(_Scratch, cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.gqa_group, cfg.ffn,
                       max_ctx)
    h_p, work_p, attn_p, mid_p, act_p = s.ptrs
    eps = cfg.norm_eps
    lib.ss_rms_norm_bf16(x.data_ptr(), nl.attn_norm.data_ptr(), cfg.hidden, eps, h_p)
    qkv = nl.qkv(s.h)
    if nl.qkv_bias is not None:
        qkv = torch.add(nl.qkv_bias, qkv)  # float32, as the torch path adds it
    ang, ang_sin = cos_sin  # "normal": complex (cos, sin) pairs; "neox": cos and sin
    lib.ss_decode_attention(qkv.data_ptr(), qkv.dtype == torch.float32, ang.data_ptr(),
                            ang_sin.data_ptr(), rope.rope_dim, rope.style != "normal", pos,
                            k_cache.data_ptr(), v_cache.data_ptr(), max_ctx, cfg.n_heads,
                            cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim),
                            work_p, attn_p)
    y = nl.out(s.attn)
    lib.ss_add_rms_norm_bf16(x.data_ptr(), y.data_ptr(), nl.ffn_norm.data_ptr(), cfg.hidden,
                             eps, mid_p, h_p)
    gate_up = nl.gate_up(s.h)
    lib.ss_silu_mul_bf16(gate_up.data_ptr(), cfg.ffn, act_p)
    return torch.add(s.mid, nl.down(s.act))
