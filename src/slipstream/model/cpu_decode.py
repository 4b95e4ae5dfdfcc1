"""The attention half of one decode token on CPU, with as few torch calls as the math allows.

A CPU decode step of a small model is bound by per-call overhead as much as by its matmuls:
each torch call costs a few microseconds (more in a decode step than in a loop, since the
weights streamed by the matmuls evict the interpreter's and the dispatcher's working set), and
a layer made about forty. Here RoPE writes through buffers whose complex and per-head views
are made once, so the rotation and the views around it are two calls instead of a dozen, and
the attention output lands in a buffer already shaped for the output projection.

Every op is the general path's (model.llama.block_forward), on the same values in the same
order, so the bits are the same (tests/weights/test_cpu_packed.py compares the two).
"""

from __future__ import annotations

import threading

import torch

from ..modelfile.config import ModelConfig
from .ring import window_attention
from .rope import RopeTable


class _Scratch:
    """Buffers of one head shape, reused by every layer and step of a thread: the q/k/v row in
    float32 (RoPE's input, widened as RopeTable.apply widens it; v as the cache write would),
    RoPE's output, their complex and per-head views, and the attention output in the cache
    dtype."""

    def __init__(self, n_q: int, n_kv: int, d: int, dtype: torch.dtype):
        n = n_q + n_kv
        self.qkv = torch.empty(1, (n + n_kv) * d)
        self.rot_c = torch.view_as_complex(self.qkv[:, :n * d].view(1, n, d // 2, 2))
        self.v = self.qkv[0, n * d:].view(n_kv, d)
        self.out = torch.empty(n, d)
        self.out_c = torch.view_as_complex(self.out.view(1, n, d // 2, 2))
        self.q = self.out[:n_q].view(n_kv, n_q // n_kv, d)
        self.k = self.out[n_q:]
        self.attn = torch.empty(n_kv, n_q // n_kv, d, dtype=dtype)
        self.attn_row = self.attn.view(1, n_q * d)


_LOCAL = threading.local()  # per thread: two models decoding at once never share buffers


def thread_buffers(make, *key):
    """make(*key), made once per thread and key (two models decoding at once on two threads
    never share buffers), outside inference mode so that calls outside it may write them too."""
    cache = _LOCAL.__dict__.setdefault("scratch", {})
    s = cache.get((make, *key))
    if s is None:
        with torch.inference_mode(False):
            s = cache[(make, *key)] = make(*key)
    return s


def decode_attention(cfg: ModelConfig, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...],
                     pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rope: RopeTable, window: int = 0, rotate: bool = True) -> torch.Tensor:
    """Attention of one causal token at slot `pos` (which it writes) over slots 0..pos (the
    last `window` of them for a sliding-window layer, whose cache may be a ring: model.ring).
    rotate=False: no RoPE (Cohere 2's global layers).

    qkv: (1, (n_q + 2 n_kv) d), as the fused q/k/v projection returns it. Returns (1, n_q d)
    in the cache dtype: a view of a thread-local buffer, valid until the thread's next call
    (the output projection reads it at once)."""
    n_q, n_kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n = n_q + n_kv
    s = thread_buffers(_Scratch, n_q, n_kv, d, k_cache.dtype)
    if not rotate:
        qkv = qkv.view(1, n + n_kv, d)
        q, k, v = qkv[0, :n_q].view(n_kv, n_q // n_kv, d), qkv[0, n_q:n], qkv[0, n:]
    elif rope.style == "normal" and rope.rope_dim == d:  # RopeTable.apply's ops, into s.out
        s.qkv.copy_(qkv)
        torch.mul(s.rot_c, cos_sin[0], out=s.out_c)
        q, k, v = s.q, s.k, s.v
    else:
        qkv = qkv.view(1, n + n_kv, d)
        qk = rope.apply(qkv[:, :n], cos_sin)[0]
        q, k, v = qk[:n_q].view(n_kv, n_q // n_kv, d), qk[n_q:], qkv[0, n:]
    slot = pos % k_cache.shape[1]  # a sliding-window layer's ring (model.ring); else pos
    k_cache[:, slot] = k
    v_cache[:, slot] = v
    if q.dtype != k_cache.dtype:
        q = q.to(k_cache.dtype)
    window_attention(q, k_cache, v_cache, pos, window, cfg.attention_scale, out=s.attn)
    return s.attn_row
