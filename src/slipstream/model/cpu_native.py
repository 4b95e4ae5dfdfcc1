"""One CPU decode token's layer through the native ops (slipstream.native): four calls around the
four packed matmuls, where the torch ops (model.cpu_decode) make about twenty-five.

    norm -> qkv matmul -> RoPE + cache write + attention -> o matmul
         -> residual + norm -> gate_up matmul -> SwiGLU -> down matmul -> residual

The math is the torch path's (the same roundings to bfloat16 at the same places, the same
float32 residual adds), but sums run in another order, so the bits are not the same:
tests/model/test_cpu_native.py compares the two. Serves layers whose four linears decode
through packed kernels (weights.cpu.PackedDecodeLinear) with no bias past q/k/v, a
float32 cache, and a context up to NATIVE_MAX_SPAN (past it torch's threaded bmm is faster).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import native
from ..modelfile.config import ModelConfig
from .cpu_decode import thread_buffers
from .rope import RopeTable

# Slots attended to: the C attention is single-threaded, and past about 1000 slots torch's
# two-threaded bmm caught up with it on the 2-core machine (a CPU decode token of the default
# model: 8.2 against 11.5 ms at slot 0, 16.8 against 16.0 at slot 1000).
NATIVE_MAX_SPAN = 1024
# Where all four matmuls are q4vnni and q/k/v have no bias, the whole layer is one C call
# (native/decode_layer.c, the same calls in the same order, so the same bits): the Python
# between eight calls cost ~30 us of a ~230 us layer on the 2-core machine.
# Tests turn it off to compare.
FUSED_LAYER = True
Kernel = Callable[[torch.Tensor], torch.Tensor]

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LayerDesc(ctypes.Structure):
    """native/decode_layer.c's ss_layer."""

    _fields_ = [("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("attn_norm", _P), ("ffn_norm", _P),
                ("hidden", _I64), ("n_q", _I64), ("n_kv", _I64), ("d", _I64), ("ffn", _I64),
                ("rope_dim", _I64), ("rope_style", _I64), ("q4_flags", _I64),
                ("eps", _F), ("scale", _F)]


class _ScratchDesc(ctypes.Structure):
    """native/decode_layer.c's ss_scratch."""

    _fields_ = [(name, _P) for name in
                ("h", "work", "attn", "mid", "act", "qkv", "o", "gate_up", "down")]


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
    # the four packed weights' q4_matvec.c descriptors (weights.cpu.vnni.Q4VnniLinear.desc)
    # where all four are q4vnni: decode_layer then calls the C matvec itself, into buffers of
    # its own, rather than the kernels (each a Python call and a tensor allocation)
    descs: tuple[int, int, int, int] | None = None
    qkv_rows: int = 0  # the fused q/k/v's output width (its buffer's), where descs is set
    q4_flags: int = 0  # ss_q4_matvec's flags but the thread count (Q4VnniLinear's)
    # decode_layer.c's ss_layer for this layer (made at its first fused token)
    fused: _LayerDesc | None = None


def native_layer(w) -> NativeLayer | None:
    """The native form of LayerWeights w, made at its first decode and kept on it; None where
    the layer cannot take it (then w.cpu_native is False, and the torch ops serve it)."""
    nl = w.cpu_native
    if nl is None:
        nl = w.cpu_native = _make(w) or False
    return nl or None


def _make(w) -> NativeLayer | None:
    """(A split FFN, hybrid.split, is turned away by the caller at every token.)"""
    if native.library() is None or w.ffn_gate_up is None:
        return None
    linears = (w.attn_qkv, w.attn_output, w.ffn_gate_up, w.ffn_down)
    # weights.cpu.PackedDecodeLinear's (looked up by name: the model's math does not
    # import the weight formats)
    ask = [getattr(lin, "one_row_kernel", None) for lin in linears]
    if None in ask:
        return None
    decode = [one_row_kernel() for one_row_kernel in ask]
    if None in decode or any(bias is not None for _, bias in decode[1:]):
        return None
    (qkv, qkv_bias), (out, _), (gate_up, _), (down, _) = decode
    norms = [n.float().contiguous() for n in (w.attn_norm, w.ffn_norm)]
    packed = [getattr(lin, "packed", None) for lin in linears]
    # q4_matvec.c's descriptors only: q6vnni's and cb4's have one too, for other kernels
    descs = tuple(getattr(p, "desc", None) if getattr(p, "kind", None) in ("q4vnni", "q8vnni")
                  else None for p in packed)
    if None in descs:
        descs = None
    else:  # the buffers decode_layer writes them into are sized from the config
        qkv_w, o_w, gate_up_w, down_w = packed
        if not (o_w.out_features == down_w.out_features == qkv_w.in_features and
                gate_up_w.out_features == 2 * down_w.in_features):
            descs = None
    return NativeLayer(qkv, qkv_bias, out, gate_up, down, *norms, descs=descs,
                       qkv_rows=packed[0].out_features if descs else 0,
                       q4_flags=packed[0].flags if descs else 0)


class _Scratch:
    """One thread's buffers for one model shape: the normed row (a matmul's bfloat16 input),
    the attention's queries and scores, its bfloat16 output, the residual after attention, and
    the SwiGLU row."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, group: int, ffn: int,
                 max_ctx: int, qkv_rows: int):
        self.h = torch.empty(1, hidden, dtype=torch.bfloat16)
        self.work = torch.empty(n_heads * head_dim + group * max_ctx)
        self.attn = torch.empty(1, n_heads * head_dim, dtype=torch.bfloat16)
        self.mid = torch.empty(1, hidden)
        self.act = torch.empty(1, ffn, dtype=torch.bfloat16)
        # the q4vnni matmuls' outputs (bfloat16, as the packed kernels give them)
        self.qkv = torch.empty(1, qkv_rows, dtype=torch.bfloat16)
        self.o = torch.empty(1, hidden, dtype=torch.bfloat16)
        self.gate_up = torch.empty(1, 2 * ffn, dtype=torch.bfloat16)
        self.down = torch.empty(1, hidden, dtype=torch.bfloat16)
        self.ptrs = tuple(t.data_ptr() for t in (self.h, self.work, self.attn, self.mid,
                                                  self.act, self.qkv, self.o, self.gate_up))
        self._desc = _ScratchDesc(*self.ptrs, self.down.data_ptr())
        self.desc = ctypes.addressof(self._desc)


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
                       max_ctx, nl.qkv_rows)
    fused = descs_fused(cfg, nl, rope) if FUSED_LAYER else None
    if fused is not None:
        out = torch.empty(1, cfg.hidden)
        ang, ang_sin = cos_sin
        lib.ss_decode_layer(fused.addr, s.desc, x.data_ptr(), out.data_ptr(),
                            ang.data_ptr(), ang_sin.data_ptr(), pos, k_cache.data_ptr(),
                            v_cache.data_ptr(), max_ctx, torch.get_num_threads())
        return out
    h_p, work_p, attn_p, mid_p, act_p, qkv_p, o_p, gate_up_p = s.ptrs
    eps = cfg.norm_eps
    descs = nl.descs
    # q4_matvec.c's flags: bfloat16 in and out, torch's thread count (see Q4VnniLinear)
    flags = nl.q4_flags | torch.get_num_threads() << 8
    lib.ss_rms_norm_bf16(x.data_ptr(), nl.attn_norm.data_ptr(), cfg.hidden, eps, h_p)
    if descs is not None:
        lib.ss_q4_matvec(descs[0], h_p, qkv_p, 1, flags)
        qkv = s.qkv
    else:
        qkv = nl.qkv(s.h)
    if nl.qkv_bias is not None:
        qkv = torch.add(nl.qkv_bias, qkv)  # float32, as the torch path adds it
    ang, ang_sin = cos_sin  # "normal": complex (cos, sin) pairs; "neox": cos and sin
    lib.ss_decode_attention(qkv.data_ptr(), qkv.dtype == torch.float32, ang.data_ptr(),
                            ang_sin.data_ptr(), rope.rope_dim, rope.style != "normal", pos,
                            k_cache.data_ptr(), v_cache.data_ptr(), max_ctx, cfg.n_heads,
                            cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim),
                            work_p, attn_p)
    if descs is not None:
        lib.ss_q4_matvec(descs[1], attn_p, o_p, 1, flags)
        y = s.o
    else:
        y = nl.out(s.attn)
    lib.ss_add_rms_norm_bf16(x.data_ptr(), y.data_ptr(), nl.ffn_norm.data_ptr(), cfg.hidden,
                             eps, mid_p, h_p)
    if descs is not None:
        lib.ss_q4_matvec(descs[2], h_p, gate_up_p, 1, flags)
        gate_up = s.gate_up
    else:
        gate_up = nl.gate_up(s.h)
    lib.ss_silu_mul_bf16(gate_up.data_ptr(), cfg.ffn, act_p)
    if descs is not None:
        lib.ss_q4_matvec(descs[3], act_p, s.down.data_ptr(), 1, flags)
        return torch.add(s.mid, s.down)
    return torch.add(s.mid, nl.down(s.act))


def descs_fused(cfg: ModelConfig, nl: NativeLayer, rope: RopeTable) -> _LayerDesc | None:
    """The layer's ss_layer for decode_layer.c, made at its first call (a layer belongs to one
    model, so its shape and RoPE do not change); None where the layer needs the call-by-call
    path (a matmul that is not q4vnni, or a q/k/v bias)."""
    if nl.descs is None or nl.qkv_bias is not None:
        return None
    if nl.fused is None:
        desc = _LayerDesc(*nl.descs, nl.attn_norm.data_ptr(), nl.ffn_norm.data_ptr(),
                          cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn,
                          rope.rope_dim, int(rope.style != "normal"), nl.q4_flags,
                          cfg.norm_eps, 1.0 / math.sqrt(cfg.head_dim))
        desc.addr = ctypes.addressof(desc)
        nl.fused = desc
    return nl.fused
