"""One CPU decode token's mixture-of-experts layer in one native call (native/decode_moe_layer.c):
norm, q/k/v, the per-head q/k norms, RoPE, the cache write, attention, o, the residual, the FFN
norm, the router's softmax and top k, the k experts and the residual, where torch made ~40
calls around the matvecs (a third of a Qwen3-30B-A3B-shaped 12-layer file's decode token on the
2-core EPYC, the head aside).

Serves Qwen3-MoE- and Mixtral-shaped layers: the plain pre-norm block (per-head q/k norms
allowed), q/k/v and o packed for q4_matvec.c or q6_matvec.c with no bias (q/k/v one linear,
or up to three parts of different layouts: Q4_K_M's), softmax routing with no bias, groups,
scale or shared expert. The experts: a bank whose one-token sum is the native one
(weights.cpu.expert_decode) is summed inside the call where it holds every expert resident
with a native descriptor; any other bank (experts read from the file: weights.expert_tiers)
gets the routing back and sums through its own ffn_one, which gives the resident call's bits,
so resident and tiered banks still agree bit for bit.

The math is model.llama's torch path (the same roundings to bfloat16 at the matvecs, float32
elsewhere), the sums in another order: tests/model/test_cpu_native_moe.py compares the two.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .. import native
from ..modelfile.config import ModelConfig
from .cpu_native import NATIVE_MAX_SPAN
from .rope import RopeTable

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# the kinds whose records q4_matvec.c reads (weights.cpu.vnni), and q6_matvec.c's
_Q4_KINDS = ("q4vnni", "q8vnni")
_Q6_KIND = "q6vnni"


class _Matvec(ctypes.Structure):
    """native/decode_moe_layer.c's moe_matvec."""

    _fields_ = [("w", _P), ("rows", _I64), ("q6", _I64)]


_QKV_PARTS = 3  # decode_moe_layer.c's MAX_QKV_PARTS


class _MoeLayerDesc(ctypes.Structure):
    """native/decode_moe_layer.c's ss_moe_layer."""

    _fields_ = [("qkv", _Matvec * _QKV_PARTS), ("n_qkv", _I64), ("o", _Matvec),
                ("attn_norm", _P), ("ffn_norm", _P),
                ("q_norm", _P), ("k_norm", _P), ("router", _P), ("experts", _P),
                ("hidden", _I64), ("n_q", _I64), ("n_kv", _I64), ("d", _I64),
                ("rope_dim", _I64), ("rope_style", _I64), ("q4_flags", _I64),
                ("n_experts", _I64), ("top_k", _I64), ("normalize", _I64), ("act", _I64),
                ("eps", _F), ("scale", _F)]


@dataclass
class MoeNativeLayer:
    """A layer's ss_moe_layer and the tensors and descriptors it points into (kept alive)."""

    desc: _MoeLayerDesc
    addr: int
    keep: tuple
    summed: bool  # the experts are summed in the call (their table is in desc)
    # what it was made from: remade where any of them is no longer the layer's (a bank's
    # one-token sum swapped, as tests do; a layer's linears replaced by a store)
    sources: tuple = ()


def moe_native_layer(cfg: ModelConfig, w, rope: RopeTable) -> MoeNativeLayer | None:
    """The native form of LayerWeights w, made at its first decode token and kept on it; None
    where the layer cannot take it (see the module doc)."""
    nl = w.moe.cpu_native
    if nl is None or (nl and not all(a is b for a, b in zip(nl.sources, _sources(w)))):
        nl = w.moe.cpu_native = _make(cfg, w, rope) or False
    return nl or None


def _sources(w) -> tuple:
    """The objects a layer's native form is made from, compared by identity at each token."""
    return (w.attn_qkv, w.attn_output, w.attn_norm, w.ffn_norm, w.attn_q_norm, w.attn_k_norm,
            w.moe.router, w.moe.experts, getattr(w.moe.experts, "one_token", None))


def block_serves(cfg: ModelConfig) -> bool:
    """Whether cfg's block is the one decode_moe_layer.c computes."""
    return not (cfg.post_norms or cfg.ffn_act != "silu" or cfg.attn_scale or cfg.attn_sinks
                or cfg.attn_temp_scale or not cfg.pre_norms or cfg.norm != "rms"
                or cfg.parallel or not cfg.global_rope or not cfg.uniform or cfg.v_norm
                or cfg.qk_norm_whole or cfg.mla or cfg.recurrent or cfg.attn_gate
                or cfg.kv_reuse)


def _routing_serves(moe) -> bool:
    return (moe.gating == "softmax" and moe.router_bias is None and moe.selection_bias is None
            and moe.groups <= 1 and moe.scale == 1.0 and moe.expert_scale is None
            and moe.router_scale is None and moe.expert_norm is None
            and moe.expert_post_norm is None and moe.shared is None
            and moe.router.dtype == torch.float32 and moe.router.device.type == "cpu")


def _matvecs(lin) -> list[_Matvec] | None:
    """A linear's packed weights as decode_moe_layer.c's matvecs (one, or one per part of a
    weights.cpu PartsLinear), where each is q4_matvec.c's or q6_matvec.c's with no bias and
    the flags decode_moe_layer.c passes (bfloat16 in and out); else None."""
    ask = getattr(lin, "one_row_kernel", None)
    decode = ask() if ask is not None else None
    if decode is None or decode[1] is not None:
        return None
    packed = lin.packed
    out = []
    for p in getattr(packed, "parts", [packed]):
        kind = getattr(p, "kind", None)
        if kind not in (*_Q4_KINDS, _Q6_KIND) or getattr(p, "bias", None) is not None \
                or getattr(p, "flags", 0) != 0:
            return None
        out.append(_Matvec(p.desc, p.out_features, int(kind == _Q6_KIND)))
    return out


def _expert_table(bank) -> tuple[ctypes.Array, tuple] | None:
    """Every expert's moe_ffn.c descriptor, in id order, where the bank holds them all resident
    and sums a token's experts natively (its one_token carries `expert_descriptor`)."""
    describe = getattr(getattr(bank, "one_token", None), "expert_descriptor", None)
    gate_up, down = getattr(bank, "gate_up", None), getattr(bank, "down", None)
    if describe is None or gate_up is None or down is None:
        return None
    descs = [describe(g, d) for g, d in zip(gate_up, down)]
    if any(d is None for d in descs):
        return None
    table = (ctypes.c_void_p * len(descs))(*(ctypes.addressof(d) for d in descs))
    return table, tuple(descs)


def _make(cfg: ModelConfig, w, rope: RopeTable) -> MoeNativeLayer | None:
    moe = w.moe
    if (native.library() is None or moe is None or not block_serves(cfg)
            or w.ffn_host is not None or w.ffn_down_rest is not None
            or not _routing_serves(moe) or moe.top_k > 64
            or getattr(moe.experts, "act", None) not in _GLU_ACTS):
        return None
    qkv, out = _matvecs(w.attn_qkv), _matvecs(w.attn_output)
    if qkv is None or out is None or len(qkv) > _QKV_PARTS or len(out) != 1 or \
            sum(m.rows for m in qkv) != (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim:
        return None
    if cfg.qk_norm and (w.attn_q_norm is None or w.attn_k_norm is None):
        return None
    f32 = [t.float().contiguous() if t is not None else None for t in
           (w.attn_norm, w.ffn_norm, w.attn_q_norm if cfg.qk_norm else None,
            w.attn_k_norm if cfg.qk_norm else None)]
    if f32[0] is None or f32[1] is None:
        return None
    router = moe.router.contiguous()
    if tuple(router.shape) != (moe.experts.n_experts, cfg.hidden):
        return None
    table = _expert_table(moe.experts)

    def addr(t):
        return None if t is None else t.data_ptr()

    parts = (_Matvec * _QKV_PARTS)(*qkv)
    desc = _MoeLayerDesc(parts, len(qkv), out[0], *map(addr, f32), router.data_ptr(),
                         None if table is None else ctypes.addressof(table[0]),
                         cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope.rope_dim,
                         int(rope.style != "normal"), 0, moe.experts.n_experts,
                         moe.top_k, int(moe.normalize), _GLU_ACTS[moe.experts.act],
                         cfg.norm_eps, cfg.attention_scale)
    return MoeNativeLayer(desc, ctypes.addressof(desc), (f32, router, table),
                          table is not None, _sources(w))


# decode_ops.c's ss_glu_f32 `act` of each expert activation (weights.cpu.expert_decode's)
_GLU_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def serves(x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the call takes this token: model.cpu_native's conditions (float32 rows and
    caches, a context its single-threaded attention is quick at)."""
    return (pos < NATIVE_MAX_SPAN and x.dtype == torch.float32 and x.is_contiguous()
            and x.shape[0] == 1 and k_cache.dtype == torch.float32
            and v_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def decode(cfg: ModelConfig, w, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
           pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable
           ) -> torch.Tensor | None:
    """decode_moe_layer where the layer and this token take it, else None (the torch ops)."""
    nl = moe_native_layer(cfg, w, rope)
    if nl is None or not serves(x, pos, k_cache, v_cache):
        return None
    return decode_moe_layer(nl, w, x, cos_sin, pos, k_cache, v_cache)


def decode_moe_layer(nl: MoeNativeLayer, w, x: torch.Tensor,
                     cos_sin: tuple[torch.Tensor, torch.Tensor], pos: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """block_forward of one causal token at slot `pos` (x (1, hidden) float32), writing the
    token's key and value at slot pos of this layer's (n_kv, max_ctx, d) caches."""
    lib = native.library()
    d = nl.desc
    out = torch.empty(1, d.hidden)
    mid, hf = torch.empty(1, d.hidden), torch.empty(1, d.hidden)
    ids = torch.empty(d.top_k, dtype=torch.int64)
    weights = torch.empty(d.top_k)
    ang, ang_sin = cos_sin
    rc = lib.ss_decode_moe_layer(nl.addr, x.data_ptr(), out.data_ptr(), ang.data_ptr(),
                                 ang_sin.data_ptr(), pos, k_cache.data_ptr(),
                                 v_cache.data_ptr(), k_cache.shape[1], torch.get_num_threads(),
                                 mid.data_ptr(), hf.data_ptr(), ids.data_ptr(),
                                 weights.data_ptr())
    if rc < 0:
        raise MemoryError(f"the native MoE layer could not allocate its scratch (slot {pos})")
    moe = w.moe
    if moe.ahead is not None:  # the next layer's guess, from the residual after attention
        moe.ahead(mid, "attention")
    if rc == 1:
        return out
    y = moe.experts.ffn_one(ids.tolist(), weights, hf)
    return mid + y.to(mid.dtype)
