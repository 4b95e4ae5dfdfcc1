"""The decoder block every family shares (model.families): the Llama block (Llama 1/2/3,
Mistral, SmolLM, Qwen2 with QKV bias), with each family's variations as named pieces that its
ModelConfig turns on: query/key norms per head (Qwen3, Gemma 3) or over the whole projection
(OLMo 2), post-norms (Gemma 3, OLMo 2, GLM-4), no pre-norms (OLMo 2), GeGLU (Gemma 3),
LayerNorm and a parallel FFN (Cohere 2), global layers without RoPE (Cohere 2), a
per-position query temperature (Ministral 3). The fast paths (the CPU's native layer, the
fused CUDA decode kernels) hold the Llama block; a family takes the torch ops where they
lack its piece."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from .. import envs, kernels, native
from ..modelfile.config import ModelConfig
from .cpu_decode import decode_attention
from .cpu_native import decode_layer as native_decode_layer
from .cpu_native import native_layer
from .cpu_native import serves as native_serves
from .cpu_native_moe import decode as moe_native_decode
from .attention_sinks import sink_attention
from .delta_net import delta_net
from .gated_attention import gated_attention
from .mla import mla_attention
from .moe import MoeWeights, moe_ffn, router_input
from .ring import ring_keys, ring_step, ring_write, window_attention, window_kv, wraps
from .rope import RopeTable
from .step import Step

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4
_ZERO = torch.zeros(())  # baddbmm's ignored input (beta=0)
# One causal token on CPU takes `_cpu_decode`, the general path's ops less their overhead
# (False: the general path, which gives the same bits; tests compare the two).
CPU_DECODE = True
# ... and through the native ops where they serve it (model.cpu_native; False: the torch ops)
CPU_NATIVE = True


def fused_decode_serves(k_cache: torch.Tensor) -> bool:
    """The fused decode kernels serve CUDA fp16/bf16 caches: RoPE + cache write, split-K
    attention (tests/gpu/test_engine.py checks them against the CPU engine on the H200).
    SLIPSTREAM_FUSED_DECODE=0 falls back to the torch ops, for comparison."""
    return (k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16)
            and _cuda_kernels() and envs.get("SLIPSTREAM_FUSED_DECODE"))


@functools.lru_cache(maxsize=None)
def _cuda_kernels() -> bool:
    return kernels.available()

class Linear(Protocol):
    """What the block asks of a linear layer, whatever its format (weights.linear.Linear gives
    the defaults): (T, in) -> (T, out); `residual=r` adds r, which the GPU kernels fold into
    the matmul's epilogue; the norm and SwiGLU that precede a matmul can be fused into it."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None
                 ) -> torch.Tensor: ...

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps))."""
        ...

    def glu_matmul(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None,
                   act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up) (+ residual) for gate_up = [gate | up]."""
        ...


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor | None  # (hidden,); None without pre-norms (cfg.pre_norms)
    attn_q: Linear | None  # hidden -> n_heads * head_dim (None when only attn_qkv exists)
    attn_k: Linear | None  # hidden -> n_kv_heads * head_dim
    attn_v: Linear | None  # hidden -> n_kv_heads * head_dim
    attn_output: Linear  # n_heads * head_dim -> hidden
    ffn_norm: torch.Tensor | None  # (hidden,)
    ffn_gate: Linear | None  # hidden -> ffn (None when only ffn_gate_up exists)
    ffn_up: Linear | None  # hidden -> ffn
    ffn_down: Linear | None  # ffn -> hidden (None in a mixture-of-experts layer)
    # Optional fused projections, set by loaders whose format allows concatenating rows:
    # one call instead of three (or two) matters when each call is a small memory-bound GEMV.
    attn_qkv: Linear | None = None  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim
    ffn_gate_up: Linear | None = None  # hidden -> 2 * ffn
    # per-head RMSNorm weights of the queries and keys (cfg.qk_norm), (head_dim,) each
    attn_q_norm: torch.Tensor | None = None
    attn_k_norm: torch.Tensor | None = None
    # RMSNorm weights of the attention and FFN outputs (cfg.post_norms), (hidden,) each
    post_attention_norm: torch.Tensor | None = None
    post_ffw_norm: torch.Tensor | None = None
    # Gemma 4: the per-layer embedding's branch (model.per_layer): hidden -> per_layer_dim,
    # per_layer_dim -> hidden, and the RMSNorm after it, (hidden,); and the layer's output
    # scale, (1,)
    inp_gate: Linear | None = None
    proj: Linear | None = None
    post_norm: torch.Tensor | None = None
    layer_output_scale: torch.Tensor | None = None
    # A layer split for hybrid decode (hybrid.split): ffn_gate_up / ffn_down then hold the
    # GPU's intermediate units only. The other units are either here, in the same format
    # (prefill, large trees), or computed elsewhere by `ffn_host` (decode): never both.
    ffn_gate_up_rest: Linear | None = None  # hidden -> 2 * (the other units)
    ffn_down_rest: Linear | None = None  # (the other units) -> hidden
    ffn_host: "FFNShare | None" = None
    # A mixture-of-experts layer's FFN (model.moe), in place of the dense FFN's linears
    moe: MoeWeights | None = None
    # its shared expert's linears (moe.shared holds them too): hidden -> 2 * shared width,
    # its parts, and shared width -> hidden
    ffn_gate_up_shexp: Linear | None = None
    ffn_gate_shexp: Linear | None = None
    ffn_up_shexp: Linear | None = None
    ffn_down_shexp: Linear | None = None
    # each query head's sink logit (cfg.attn_sinks: gpt-oss), (n_heads,) float32
    attn_sinks: torch.Tensor | None = None
    # multi-head latent attention (cfg.mla: DeepSeek; model.mla): the query latent's linears
    # (hidden -> q_lora, q_lora -> n_heads * mla_k_head) and norm (q_lora,), the key/value
    # latent's linear (hidden -> kv_lora + rope) and norm (kv_lora,), and the per-head key
    # and value projections of the latent, float32 (n_heads, kv_lora, nope) and
    # (n_heads, mla_v_head, kv_lora)
    attn_q_a: Linear | None = None
    attn_q_b: Linear | None = None
    attn_q_a_norm: torch.Tensor | None = None
    attn_kv_a_mqa: Linear | None = None
    attn_kv_a_norm: torch.Tensor | None = None
    attn_k_b: torch.Tensor | None = None
    attn_v_b: torch.Tensor | None = None
    # Qwen3.5's linear attention (cfg.recurrent; model.delta_net): the projections to
    # queries/keys/values (attn_qkv: hidden -> conv_dim), to the output gate z (attn_gate:
    # hidden -> heads * state), to each value head's write strength and decay (ssm_beta,
    # ssm_alpha: hidden -> heads) and back (ssm_out: heads * state -> hidden); float32 the
    # conv's taps (conv_dim, kernel), -exp(A_log) and dt_bias (heads,), the gated norm (state,)
    attn_gate: Linear | None = None
    ssm_beta: Linear | None = None
    ssm_alpha: Linear | None = None
    ssm_out: Linear | None = None
    ssm_conv1d: torch.Tensor | None = None
    ssm_a: torch.Tensor | None = None
    ssm_dt: torch.Tensor | None = None
    ssm_norm: torch.Tensor | None = None
    # Qwen3.5-MoE's shared-expert gate (model.moe.SharedExpert.gate), (hidden,) float32
    ffn_gate_inp_shexp: torch.Tensor | None = None
    # The layer's CPU decode form through the native ops (model.cpu_native), made at its first
    # CPU decode token: a NativeLayer, or False where the layer cannot take one.
    cpu_native: object = None

    @property
    def is_cuda(self) -> bool:
        """Whether the layer's tensors live on a CUDA device, told by its norm weights (every
        family has some: pre-norms, or OLMo 2's post-norms)."""
        return any(t is not None and t.is_cuda for t in (
            self.attn_norm, self.ffn_norm, self.post_attention_norm, self.post_ffw_norm))


class FFNShare(Protocol):
    """Part of a layer's FFN computed off the layer's device (the CPU's share in hybrid
    decode): `start(h)` hands it the normed input without waiting; `finish(partial)` returns
    partial plus its down-projection partial sum, on partial's device."""

    def start(self, h: torch.Tensor) -> None: ...

    def finish(self, partial: torch.Tensor) -> torch.Tensor: ...


# float32 CPU norms of at least this many elements (a prefill's) take one native pass
# (ss_rms_norm_rows_f32) on the calling thread; smaller ones (decode's) keep F.rms_norm
NATIVE_NORM_MIN = 1 << 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as one kernel where possible: per-op overhead dominates
    batch-1 decode, on CPU and inside a CUDA graph alike."""
    if x.is_cuda and _cuda_kernels():
        return kernels.rms_norm(x, weight, eps)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() >= NATIVE_NORM_MIN and weight.numel() == x.shape[-1]):
        lib = native.library()
        if lib is not None:
            xc, wc = x.contiguous(), weight.contiguous()
            out = torch.empty_like(xc)
            lib.ss_rms_norm_rows_f32(xc.data_ptr(), wc.data_ptr(), xc.numel() // x.shape[-1],
                                     x.shape[-1], eps, out.data_ptr())
            return out
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _HAS_RMS_NORM:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def post_normed(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> torch.Tensor:
    """x + rms_norm(y, weight, eps): a sublayer's output normed before the residual add (the
    post-norms), as one kernel on CUDA (where per-launch overhead is a decode step's cost) and
    the two ops elsewhere. The kernel gives x's dtype, so it takes the sums whose type is x's
    (a float16 output added to a float32 residual, as attention's is), computed in float32."""
    if (y.is_cuda and torch.promote_types(x.dtype, y.dtype) == x.dtype
            and x.stride(-1) == 1 and _cuda_kernels()):
        return kernels.rms_norm(y, weight, eps, add_to=x)
    return x + rms_norm(y, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without a bias (Cohere 2), computed in float32 as rms_norm is."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None, eps).to(x.dtype)


def block_norm(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The family's norm (cfg.norm): RMSNorm, or LayerNorm for Cohere 2. The final norm
    before the head is the same kind."""
    if cfg.norm == "layer":
        return layer_norm(x, weight, cfg.norm_eps)
    return rms_norm(x, weight, cfg.norm_eps)


def pre_norm(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """x normed before a sublayer; x itself in a block without pre-norms (OLMo 2)."""
    return block_norm(cfg, x, weight) if cfg.pre_norms else x


def pre_normed(cfg: ModelConfig, lin: Linear, x: torch.Tensor, norm: torch.Tensor | None
               ) -> torch.Tensor:
    """lin(pre_norm(x)): the RMSNorm fused into the matmul where the linear can (its
    norm_matmul); the other norms, or none, before a plain call."""
    if cfg.pre_norms and cfg.norm == "rms":
        return lin.norm_matmul(x, norm, cfg.norm_eps)
    return lin(pre_norm(cfg, x, norm))


def qk_normed(cfg: ModelConfig, w: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
    """qkv (T, (n_heads + n_kv_heads [+ n_kv_heads]) * head_dim), as the projections return it,
    with each query head and each key head RMS-normed by its own weight (cfg.qk_norm: Qwen3),
    the values passed through. The norm runs over one head's dimensions, before RoPE; with
    cfg.qk_norm_whole (OLMo 2) over all of a token's queries, and all its keys, at once."""
    T, d = qkv.shape[0], cfg.head_dim
    q_end, k_end = cfg.n_heads * d, (cfg.n_heads + cfg.n_kv_heads) * d
    if cfg.qk_norm_whole:
        q = rms_norm(qkv[:, :q_end], w.attn_q_norm, cfg.norm_eps)
        k = rms_norm(qkv[:, q_end:k_end], w.attn_k_norm, cfg.norm_eps)
        return torch.cat((q, k, qkv[:, k_end:]), dim=1)
    q = rms_norm(qkv[:, :q_end].reshape(-1, d), w.attn_q_norm, cfg.norm_eps)
    k = rms_norm(qkv[:, q_end:k_end].reshape(-1, d), w.attn_k_norm, cfg.norm_eps)
    return torch.cat((q.view(T, -1), k.view(T, -1), qkv[:, k_end:]), dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
              group: int, scale: float | None = None) -> torch.Tensor:
    """GQA attention of T new queries over the first `step.span` cached keys, masked as the
    step says (`Step.with_mask`).

    q: (T, n_heads, d); k, v: (n_kv_heads, span, d). Returns (T, n_heads * d).
    The query heads sharing one KV head are folded into the row dimension so K and V are
    never copied per query head: (n_kv, group * T, d) against (n_kv, span, d).
    """
    T, n_heads, d = q.shape
    n_kv = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not step.needs_mask:  # one token over exactly its slots: no mask, no permutes
        qg = q.view(n_kv, group, d)
        if q.device.type == "cpu":
            # Two bmm and a softmax: CPU SDPA costs ~2.5x more at these tiny shapes, and
            # decode on CPU is bound by per-op overhead (so the scale rides on the first bmm).
            scores = torch.baddbmm(_ZERO, qg, k.transpose(1, 2), beta=0, alpha=scale)
            out = torch.bmm(torch.softmax(scores, dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(qg, k, v, scale=scale)
        return out.reshape(1, n_heads * d)
    qg = q.permute(1, 0, 2).reshape(n_kv, group * T, d)  # rows ordered (group, T)
    mask = step.mask if step.mask is not None else step.with_mask(group).mask
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n_heads, T, d).permute(1, 0, 2).reshape(T, n_heads * d)


def uses_fused_decode(step: Step, k_cache: torch.Tensor) -> bool:
    """Whether a step runs the fused decode kernels: decided by its shape (one causal token,
    slot = position), the device and the cache dtype, whether or not it is being captured."""
    return step.tokens == 1 and step.causal and fused_decode_serves(k_cache)


def block_forward(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable,
                  window: int = 0, per_layer: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder block on x (T, hidden) for the tokens `step` describes.

    cfg: the layer's config (ModelConfig.layer(i): where layers differ, its own head size,
    heads, FFN size, and whether it reuses another layer's keys and values).
    cos_sin: `rope.angles(step.positions)`, computed once per forward and shared by all layers
    of one RoPE table.
    k_cache, v_cache: this layer's (n_kv_heads, max_ctx, head_dim) slices; the new keys and
    values are written in place, at `step.slots` (a layer with cfg.kv_reuse reads the slices
    of the layer it reuses, which that layer wrote earlier in the same pass). A
    linear-attention layer (cfg.recurrent: Qwen3.5) gets its conv and recurrent states
    instead, updated in place (model.delta_net).
    window: a sliding-window layer's width (cfg.window_of), 0 for a global one; a step that
    needs a mask then carries the window in it (Step.with_window).
    per_layer: Gemma 4's per-layer embedding input of this layer (T, per_layer_dim), which
    the branch after the FFN reads (model.per_layer).
    """
    if w.moe is not None and w.moe.ahead is not None:  # guess the next layer's experts
        w.moe.ahead(x, "input")
    y = _block(cfg, w, x, cos_sin, step, k_cache, v_cache, rope, window)
    if per_layer is not None or cfg.layer_scale:
        from .per_layer import layer_tail  # Gemma 4 only; per_layer imports this module
        y = layer_tail(cfg, w, y, per_layer)
    return y


def _block(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
           cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
           k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable,
           window: int = 0) -> torch.Tensor:
    T = x.shape[0]
    if cfg.mla:  # DeepSeek: the latent attention (its own cache layout: model.mla)
        attn = mla_attention(cfg, w, rms_norm(x, w.attn_norm, cfg.norm_eps), cos_sin, step,
                             k_cache, rope, rms_norm)
        return _after_attention(cfg, w, attn, x)
    if cfg.recurrent:  # Qwen3.5's linear attention: the cache pair holds its conv and
        # recurrent states (runtime.kv_cache), not keys and values (model.delta_net)
        y = delta_net(cfg, w, rms_norm(x, w.attn_norm, cfg.norm_eps), step, k_cache, v_cache,
                      rms_norm)
        return _ffn(cfg, w, x + y.to(x.dtype))
    if cfg.attn_gate:  # Qwen3.5's full attention, its output gated (model.gated_attention)
        attn = gated_attention(cfg, w, rms_norm(x, w.attn_norm, cfg.norm_eps), cos_sin, step,
                               k_cache, v_cache, rope, rms_norm, attention)
        return _after_attention(cfg, w, attn, x)
    if cfg.kv_reuse:
        return _after_attention(cfg, w, _reused_kv_attention(
            cfg, w, x, cos_sin, step, k_cache, v_cache, rope, window), x)
    if (T == 1 and CPU_DECODE and x.device.type == "cpu" and w.attn_qkv is not None
            and not step.needs_mask and not cfg.attn_temp_scale and not cfg.v_norm
            and not cfg.attn_sinks):
        return _cpu_decode(cfg, w, x, cos_sin, step.start, k_cache, v_cache, rope, window)
    n_qk = cfg.n_heads + cfg.n_kv_heads
    # the fused decode kernels hold windows, per-head q/k norms, a query temperature (Ministral
    # 3), a global layer without RoPE (Cohere 2) and value norms (Gemma 4); not attention sinks
    if uses_fused_decode(step, k_cache) and not cfg.attn_sinks:
        # RoPE (after the per-head q/k norms), the cache write and split-K attention over the
        # window in three kernels that read the position from device memory, instead of a dozen
        # small ops (and a graph can replay them).
        if w.attn_qkv is not None:
            qkv = pre_normed(cfg, w.attn_qkv, x, w.attn_norm)
        else:
            h = pre_norm(cfg, x, w.attn_norm)
            qkv = torch.cat((w.attn_q(h), w.attn_k(h), w.attn_v(h)), dim=-1)
        head_norms = cfg.qk_norm and not cfg.qk_norm_whole
        if cfg.qk_norm_whole:
            qkv = qk_normed(cfg, w, qkv)
        q = kernels.rope_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, step.positions,
                                   cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope.style,
                                   rope_dim=rope.rope_dim,
                                   q_norm=w.attn_q_norm if head_norms else None,
                                   k_norm=w.attn_k_norm if head_norms else None,
                                   eps=cfg.norm_eps, ring=bool(window),
                                   rotate=bool(window or cfg.global_rope),
                                   q_temp=((cfg.attn_temp_scale, cfg.attn_temp_floor)
                                           if cfg.attn_temp_scale else None),
                                   v_norm=cfg.v_norm)
        attn = kernels.decode_attention(q, k_cache, v_cache, step.positions,
                                        cfg.attention_scale, cfg.gqa_group, span=step.span,
                                        window=window)
        return _after_attention(cfg, w, attn.reshape(1, -1), x)
    if w.attn_qkv is not None:
        qkv = pre_normed(cfg, w.attn_qkv, x, w.attn_norm)
        if cfg.qk_norm:
            qkv = qk_normed(cfg, w, qkv)
        qkv = qkv.view(T, n_qk + cfg.n_kv_heads, cfg.head_dim)
        qk, v = qkv[:, :n_qk], qkv[:, n_qk:]
    else:
        h = pre_norm(cfg, x, w.attn_norm)
        qk = torch.cat((w.attn_q(h), w.attn_k(h)), dim=-1)
        if cfg.qk_norm:
            qk = qk_normed(cfg, w, qk)
        qk = qk.view(T, n_qk, cfg.head_dim)
        v = w.attn_v(h).view(T, cfg.n_kv_heads, cfg.head_dim)
    if cfg.v_norm:  # Gemma 4: each value head RMS-normed, without a weight
        v = unit_rms_norm(v, cfg.norm_eps)
    if window or cfg.global_rope:  # (Cohere 2's global layers take no RoPE)
        qk = rope.apply(qk, cos_sin)  # q and k heads rotate together: one pass, same angles
    q, k = qk[:, :cfg.n_heads], qk[:, cfg.n_heads:]
    if cfg.attn_temp_scale:
        q = q * attention_temperature(cfg, step.positions)[:, None, None]
    k_new, v_new = k.transpose(0, 1), v.transpose(0, 1)  # (n_kv, T, d); copy_ casts
    if wraps(step, window, k_cache):  # a sliding-window layer's ring (model.ring)
        attn = _ring_attention(cfg, w, q.to(k_cache.dtype), k_new, v_new, step, k_cache,
                               v_cache, window)
        return _after_attention(cfg, w, attn, x)
    if step.start is not None:  # a contiguous run of slots the host knows: a slice write
        k_cache[:, step.start:step.start + T] = k_new
        v_cache[:, step.start:step.start + T] = v_new
    else:
        k_cache.index_copy_(1, step.slots, k_new.to(k_cache.dtype))
        v_cache.index_copy_(1, step.slots, v_new.to(v_cache.dtype))
    # one token over its own slots (no mask) reads only its window's; a masked step's mask
    # holds the window (Step.with_window)
    lo = max(0, step.span - window) if window and not step.needs_mask else 0
    if cfg.attn_sinks:  # gpt-oss: a sink logit per head in each softmax
        attn = sink_attention(q.to(k_cache.dtype), k_cache[:, lo:step.span],
                              v_cache[:, lo:step.span], step, cfg.gqa_group,
                              cfg.attention_scale, w.attn_sinks)
        return _after_attention(cfg, w, attn, x)
    attn = attention(q.to(k_cache.dtype), k_cache[:, lo:step.span], v_cache[:, lo:step.span],
                     step, cfg.gqa_group, cfg.attention_scale)
    return _after_attention(cfg, w, attn, x)


def _ring_attention(cfg: ModelConfig, w: LayerWeights, q: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, step: Step, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, window: int) -> torch.Tensor:
    """Attention of a step over a ring that it reaches past (model.ring): one causal token
    is written, then reads its window's slices; a masked step reads the ring as it was
    and its own keys, then writes them."""
    ring = k_cache.shape[1]
    if not step.needs_mask:  # one causal token at a host-known slot
        k_cache[:, step.start % ring] = k_new[:, 0]
        v_cache[:, step.start % ring] = v_new[:, 0]
        if q.device.type == "cpu" and not cfg.attn_sinks:  # model.cpu_decode's ops and bits
            qg = q.view(cfg.n_kv_heads, cfg.gqa_group, cfg.head_dim)
            return window_attention(qg, k_cache, v_cache, step.start, window,
                                    cfg.attention_scale).reshape(1, -1)
        k, v = window_kv(k_cache, v_cache, step.start, window)
    else:
        if step.ring != ring:  # the engine builds it once per pass; a direct caller here
            step = ring_step(step, window, cfg.gqa_group, ring)
        k, v = ring_keys(k_cache, v_cache, k_new, v_new)
    if cfg.attn_sinks:  # gpt-oss: a sink logit per head in each softmax
        attn = sink_attention(q, k, v, step, cfg.gqa_group, cfg.attention_scale, w.attn_sinks)
    else:
        attn = attention(q, k, v, step, cfg.gqa_group, cfg.attention_scale)
    if step.needs_mask:
        ring_write(k_cache, v_cache, k_new, v_new, step)
    return attn


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension without a weight, in float32 (Gemma 4's values)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _reused_kv_attention(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
                         cos_sin: tuple[torch.Tensor, torch.Tensor], step: Step,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeTable,
                         window: int) -> torch.Tensor:
    """The attention of a layer that projects queries only (cfg.kv_reuse: Gemma 4's last
    layers), over the keys and values another layer wrote into k_cache and v_cache for the
    same slots earlier in this pass."""
    T, d = x.shape[0], cfg.head_dim
    q = w.attn_q(pre_norm(cfg, x, w.attn_norm))
    if cfg.qk_norm:
        q = rms_norm(q.reshape(-1, d), w.attn_q_norm, cfg.norm_eps)
    q = rope.apply(q.view(T, cfg.n_heads, d), cos_sin)
    lo = max(0, step.span - window) if window and not step.needs_mask else 0
    return attention(q.to(k_cache.dtype), k_cache[:, lo:step.span], v_cache[:, lo:step.span],
                     step, cfg.gqa_group, cfg.attention_scale)


def attention_temperature(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """Llama 4's per-position query factor (cfg.attn_temp_scale: Ministral 3), float32 (T,):
    1 below the original context, growing with the log of how many times past it a query
    stands, so that attention stays sharp over contexts the model was stretched to."""
    times = torch.floor(positions.float() / cfg.attn_temp_floor)
    return 1.0 + cfg.attn_temp_scale * torch.log1p(times)


def _after_attention(cfg: ModelConfig, w: LayerWeights, attn: torch.Tensor,
                     x: torch.Tensor) -> torch.Tensor:
    """The block's output from its attention's: the residual add and the FFN after it, or
    (cfg.parallel: Cohere 2) the FFN on the input attention read, both added to x."""
    if not cfg.parallel:
        return _ffn(cfg, w, _attention_residual(cfg, w, attn, x))
    h = pre_norm(cfg, x, w.attn_norm)  # the normed input attention read
    y = w.attn_output(attn, residual=x)
    if w.ffn_gate_up is not None:  # the gated product fused into the matmul where it can be
        return w.ffn_down.glu_matmul(w.ffn_gate_up(h), residual=y, act=cfg.ffn_act)
    return w.ffn_down(_ACTIVATIONS[cfg.ffn_act](w.ffn_gate(h)) * w.ffn_up(h), residual=y)


def _attention_residual(cfg: ModelConfig, w: LayerWeights, attn: torch.Tensor,
                        x: torch.Tensor) -> torch.Tensor:
    """x plus the attention's output projection, normed first where the family norms it."""
    if cfg.post_norms:
        return post_normed(x, w.attn_output(attn), w.post_attention_norm, cfg.norm_eps)
    return w.attn_output(attn, residual=x)


def _cpu_decode(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], pos: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rope: RopeTable, window: int = 0) -> torch.Tensor:
    """block_forward of one causal token at slot `pos` on CPU: the general path's ops on the
    same values (so the same bits), with fewer calls around them (model.cpu_decode), since
    per-call overhead bounds CPU decode as much as the matmuls do. Where the native ops serve
    the layer (model.cpu_native), the same math in four calls instead, to float32 rounding."""
    if (CPU_NATIVE and w.ffn_host is None and w.ffn_down_rest is None  # Llama blocks only
            and llama_block(cfg) and not window):
        nl = native_layer(w)
        if nl is not None and native_serves(x, pos, k_cache, v_cache):
            return native_decode_layer(cfg, nl, x, cos_sin, pos, k_cache, v_cache, rope)
    if CPU_NATIVE and w.moe is not None and not window:  # a mixture of experts (one call)
        if (y := moe_native_decode(cfg, w, x, cos_sin, pos, k_cache, v_cache, rope)) is not None:
            return y
    qkv = pre_normed(cfg, w.attn_qkv, x, w.attn_norm)
    if cfg.qk_norm:
        qkv = qk_normed(cfg, w, qkv)
    attn = decode_attention(cfg, qkv, cos_sin, pos, k_cache, v_cache, rope, window,
                            rotate=bool(window) or cfg.global_rope)
    return _after_attention(cfg, w, attn, x)


def llama_block(cfg: ModelConfig) -> bool:
    """Whether cfg's block is the plain Llama block (none of the families' variations)."""
    return not (cfg.qk_norm or cfg.post_norms or cfg.ffn_act != "silu" or cfg.attn_scale
                or cfg.attn_sinks
                or cfg.attn_temp_scale or not cfg.pre_norms or cfg.norm != "rms"
                or cfg.parallel or not cfg.global_rope or not cfg.uniform)


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def gated(act: str, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] (T, 2 * ffn): the gated FFN's product, act
    "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return _ACTIVATIONS[act](gate) * up


def _ffn_output(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor, y: torch.Tensor
                ) -> torch.Tensor:
    """x plus the FFN's output y, normed first where the family norms it (post_ffw_norm)."""
    return post_normed(x, y, w.post_ffw_norm, cfg.norm_eps) if cfg.post_norms else y


def _ffn_norm(w: LayerWeights) -> torch.Tensor | None:
    """The FFN's pre-norm: ffn_norm, or in gpt-oss and GLM-4.5 (which have none) the tensor
    llama.cpp names post_attention_norm and applies before the FFN (families.gptoss). A
    family with both (Gemma) applies post_attention_norm as a post-norm instead."""
    return w.ffn_norm if w.ffn_norm is not None else w.post_attention_norm


def _ffn(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The gated FFN half of the block, with its residual: folded into the down projection's
    epilogue, unless a norm comes between them (post_norms)."""
    if w.moe is not None:  # a mixture of experts: the routed experts' gated FFNs
        if w.moe.ahead is not None:  # guess the next layer's experts
            w.moe.ahead(x, "attention")
        y = moe_ffn(pre_norm(cfg, x, _ffn_norm(w)), w.moe, x, _moe_norm(cfg)).to(x.dtype)
        return _ffn_output(cfg, w, x, y) if cfg.post_norms else x + y
    if w.ffn_host is not None or w.ffn_down_rest is not None:
        return _split_ffn(cfg, w, x)
    residual = None if cfg.post_norms else x
    if w.ffn_gate_up is not None:
        gate_up = pre_normed(cfg, w.ffn_gate_up, x, _ffn_norm(w))
        y = w.ffn_down.glu_matmul(gate_up, residual=residual, act=cfg.ffn_act)
    else:
        h = pre_norm(cfg, x, _ffn_norm(w))
        y = w.ffn_down(_ACTIVATIONS[cfg.ffn_act](w.ffn_gate(h)) * w.ffn_up(h),
                       residual=residual)
    return _ffn_output(cfg, w, x, y)


def moe_router_input(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """What layer w's router reads (model.moe.moe_ffn's `r`) where its FFN's residual stream
    is x: the FFN's pre-norm of x, or Gemma 4's router input."""
    assert w.moe is not None
    if w.moe.router_scale is not None:
        return router_input(x, w.moe.router_scale, _moe_norm(cfg))
    return pre_norm(cfg, x, _ffn_norm(w))


def _moe_norm(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The RMSNorm a mixture of experts' own norms take (model.moe.Norm): the block's, or
    without weight (Gemma 4's router input)."""
    def norm(t: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return rms_norm(t, weight, cfg.norm_eps) if weight is not None else \
            unit_rms_norm(t, cfg.norm_eps)
    return norm


def _split_ffn(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The gated FFN over intermediate units split in two (hybrid.split): each side's down
    projection is a partial sum over its own units, and the two add up to the whole. The share
    computed elsewhere gets its input first, so that it runs while this device runs its own.
    The residual rides in the first partial sum, unless a post-FFN norm (Gemma) must see the
    whole sum first. Families with LayerNorm, no pre-norms or a parallel FFN are never split
    (hybrid.split.layer_splittable)."""
    h = rms_norm(x, w.ffn_norm, cfg.norm_eps)
    if w.ffn_host is not None:
        w.ffn_host.start(h)
    residual = None if cfg.post_norms else x
    y = w.ffn_down.glu_matmul(w.ffn_gate_up(h), residual=residual, act=cfg.ffn_act)
    if w.ffn_host is not None:
        y = w.ffn_host.finish(y)
    else:
        y = w.ffn_down_rest.glu_matmul(w.ffn_gate_up_rest(h), residual=y, act=cfg.ffn_act)
    return _ffn_output(cfg, w, x, y)
